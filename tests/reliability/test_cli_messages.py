"""First-hour papercuts stay fixed."""

import re
from pathlib import Path

import yaml

from remoe.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_readme_commands_name_runs_that_the_configs_write():
    names = {"tiny-remoe"}  # the default config's
    for p in (ROOT / "configs").rglob("*.yaml"):
        try:
            cfg = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError:
            continue
        name = ((cfg.get("run") or {}) if isinstance(cfg, dict) else {}).get("name")
        if isinstance(name, str):
            names.add(name)
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(),
                        flags=re.S | re.M)
    reading = ("remoe eval ", "remoe report ", "remoe analyze ")  # they read runs the tour trains
    used = {m for b in blocks for line in b.splitlines() if line.lstrip().startswith(reading)
            for m in re.findall(r"\bruns/([A-Za-z0-9_.-]+)", line.split("#")[0])}
    missing = sorted(u for u in used if u not in names and u not in ("a", "b", "NAME"))
    assert not missing, f"README names runs no config writes: {missing}"


def test_a_field_given_as_the_config_path_suggests_set(capsys):
    assert main(["train", "train.max_steps=10"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("(to change one field, use --set train.max_steps=10)"), err


def test_progress_line_of_a_run_without_lambda_does_not_print_one():
    from remoe.train.metrics import stats_text

    rec = {"lm_loss": 5.0, "sparsity": 0.875, "lambda": 0.0, "lr": 1e-3}
    assert "lambda" not in stats_text(rec)
    assert "lambda 1.00e-08" in stats_text({**rec, "lambda": 1e-8})
