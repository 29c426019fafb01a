"""The micro-training fixtures of tests/train (``tiny_data_cfg``, ``make_overrides``), shared
with the router tests here that run a few real Trainer steps."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "remoe_tests_train_conftest", Path(__file__).resolve().parents[1] / "train" / "conftest.py")
_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_train)

tiny_data_cfg = _train.tiny_data_cfg
make_overrides = _train.make_overrides
