from pathlib import Path

import pytest
import yaml


@pytest.fixture
def write_spec(tmp_path):
    """Write a spec (dict) to tmp_path/spec.yaml with a valid micro base unless given."""
    def write(spec: dict, name: str = "spec.yaml") -> Path:
        spec = dict(spec)
        spec.setdefault("budget", "test")
        spec.setdefault("base", {"model": {"preset": "micro", "num_experts": 4},
                                 "data": {"cache_dir": str(tmp_path / "data")},
                                 "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 3}})
        p = tmp_path / name
        p.write_text(yaml.safe_dump(spec, sort_keys=False))
        return p
    return write
