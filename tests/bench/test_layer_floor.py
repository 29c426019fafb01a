"""scripts/layer_floor.py: the floor of an MoE layer step from the library's kernels."""

import json
import subprocess
import sys
from pathlib import Path

from remoe.lab.bench.layer import LayerCase

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "layer_floor.py"


def test_floor_is_the_sum_of_its_pieces_relative_to_dense(load_script):
    case = LayerCase(T=128, d_model=32, d_ffn=64, E=4, G=2)
    r = load_script("layer_floor").measure(case, reps=1, rounds=1)
    ms = r["cpu_ms"]
    assert set(ms) == {"dense", "expert_gemms", "gather_scatter", "router"}
    assert all(v > 0 for v in ms.values())
    assert abs(r["floor_ms"] - (ms["expert_gemms"] + ms["gather_scatter"] + ms["router"])) < 1e-9
    # one round: the median ratio is that round's
    assert abs(r["vs_dense"]["floor"] - r["floor_ms"] / ms["dense"]) < 1e-9
    assert r["floor_vs_dense_range"] == [r["vs_dense"]["floor"]] * 2


def test_cli_skips_cases_the_bench_does_not_have_and_writes_json(tmp_path):
    out = tmp_path / "floor.json"
    args = ["--experts", "8", "16", "--granularity", "1", "2", "--tokens", "256", "--reps", "1",
            "--rounds", "1", "--json", str(out)]
    p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                       check=True)
    cases = [c["case"] for c in json.loads(out.read_text())["cases"]]
    assert cases == ["E=8 G=1 k=1", "E=8 G=2 k=1", "E=16 G=1 k=1"]
    assert p.stdout.count("floor") == 3
