"""scripts/bench_table.py: the Markdown tables of docs/PERFORMANCE.md from a bench JSON."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_table.py"


def _doc():
    row = {"case": "E=8 G=1 k=1", "cpu_ms": 283.3, "cpu_rel_spread": 0.0416, "wall_ms": 283.4,
           "others_busy_cores": [0.01, 1.04], "peak_mem_mb": 81.3, "mfu": 0.7686,
           "vs_dense_cpu": 1.0967, "vs_dense_cpu_spread": {"min": 0.878, "max": 1.107}}
    return {"machine": {"cpu_model": "CPU", "cores_logical": 2, "torch": "2.13.0", "threads": 1,
                        "allocator": "tcmalloc (/usr/lib/x.so)", "loadavg_start": [2.6, 0, 0],
                        "loadavg_end": [1.1, 0, 0], "busy_spinners_started": 1},
            "elapsed_s": 166.2,
            "layer": {"rows": [{**row, "row": "relu"}, {**row, "row": "hf_grouped_mm",
                                                        "vs_dense_cpu": None, "mfu": None}],
                      "targets": [{"target": "relu / dense at E=8", "limit": "<= 1.15",
                                   "value": 1.097, "range": [0.878, 1.107], "met": True},
                                  {"target": "relu / dense at G=64", "limit": "<= 2.0",
                                   "value": 2.311, "range": [1.918, 2.766], "met": False}]}}


def test_renders_rows_and_targets(tmp_path):
    p = tmp_path / "b.json"
    p.write_text(json.dumps(_doc()))
    out = subprocess.run([sys.executable, str(SCRIPT), str(p)], capture_output=True, text=True,
                         check=True).stdout
    lines = out.splitlines()
    assert "1 thread(s), allocator tcmalloc" in lines[0] and "started beside it: 1; 166 s" in lines[0]
    assert "| E=8 G=1 k=1 | relu | 283 | 4% | **1.10** [0.88..1.11] | 283 | 0.0, 1.0 | 81 | 0.77 |" in lines
    assert "| E=8 G=1 k=1 | hf_grouped_mm | 283 | 4% | **-** [0.88..1.11] | 283 | 0.0, 1.0 | 81 | - |" in lines
    assert "| relu / dense at E=8 <= 1.15 | 1.10 [0.88..1.11] | met |" in lines
    assert "| relu / dense at G=64 <= 2.0 | 2.31 [1.92..2.77] | **missed** |" in lines


def test_bad_input_is_one_line_and_nonzero(tmp_path):
    p = tmp_path / "b.json"
    p.write_text('{"layer": {}}')
    r = subprocess.run([sys.executable, str(SCRIPT), str(p)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "not a remoe bench layer JSON" in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
