"""``train.init_lr``: the learning rate of a run that starts from existing weights (peak: a fresh
schedule; source: the source run's last lr; a number), said in one line at the start, recorded
and kept by ``--resume``."""

from __future__ import annotations

import json

import pytest

from remoe.errors import ConfigError
from remoe.experiment import load_config
from remoe.train.trainer import Trainer


def _cfg(make_overrides, out, name, **extra):
    ov = make_overrides(out, name, **extra)
    if "train.init_from" in extra:
        ov = [o for o in ov if not o.startswith("model.preset=")]
    return load_config(None, ov)


def _train(cfg, resume=False):
    t = Trainer(cfg, progress=False, resume=resume)
    try:
        return t.train()
    finally:
        t.close()


def _lrs(run):
    return [json.loads(x)["lr"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def source(tmp_path_factory, micro_data_cfg):
    from tests.train.conftest import _overrides

    out = tmp_path_factory.mktemp("lr_source")
    _train(load_config(None, _overrides(micro_data_cfg, out, "src", **{
        "analysis.record_masks_every": 0})))
    return out / "src"


def test_peak_is_a_fresh_schedule_and_says_so(source, make_overrides, tmp_path, capsys):
    cfg = _cfg(make_overrides, tmp_path, "peak", **{"train.init_from": source,
                                                   "analysis.record_masks_every": 0})
    _train(cfg)
    err = capsys.readouterr().err
    assert "fresh schedule: the learning rate warms up again from 0 to its peak" in err
    lrs = _lrs(tmp_path / "peak")
    assert lrs[0] == pytest.approx(cfg.train.lr / 2) and max(lrs) == pytest.approx(cfg.train.lr)


def test_source_continues_at_the_sources_last_lr_and_resume_keeps_it(
        source, make_overrides, tmp_path, capsys):
    last = _lrs(source)[-1]
    extra = {"train.init_from": source, "train.init_lr": "source",
             "analysis.record_masks_every": 0}
    _train(_cfg(make_overrides, tmp_path, "src-lr", **extra))
    assert f"the learning rate starts at the source's last {last:g} without warm-up" in (
        capsys.readouterr().err)
    lrs = _lrs(tmp_path / "src-lr")
    # the source stopped above train.min_lr: from there, down the cosine to min_lr
    assert lrs[0] == last and lrs == sorted(lrs, reverse=True) and lrs[-1] > 2e-4
    assert json.loads((tmp_path / "src-lr" / "init_from.json").read_text())["lr_start"] == last

    # a number at or below train.min_lr is held; a resume keeps the schedule
    import shutil

    extra = {**extra, "train.init_lr": "1e-4"}
    cfg = _cfg(make_overrides, tmp_path, "num", **extra)
    _train(cfg)
    lrs = _lrs(tmp_path / "num")
    assert lrs == [1e-4] * 6
    shutil.rmtree(tmp_path / "num" / "checkpoints" / "step_0000006")
    (tmp_path / "num" / "checkpoints" / "LATEST").write_text("step_0000003")
    shutil.rmtree(tmp_path / "num" / "final")
    _train(cfg, resume=True)
    assert _lrs(tmp_path / "num") == lrs


def test_bad_init_lr_is_one_line_naming_the_field(source, make_overrides, tmp_path):
    with pytest.raises(ConfigError, match=r"train.init_lr='fast' must be peak, source or"):
        _cfg(make_overrides, tmp_path, "x", **{"train.init_from": source,
                                               "train.init_lr": "fast"})
    with pytest.raises(ConfigError, match=r"train.init_lr='source' needs train.init_from"):
        load_config(None, ["train.init_lr=source"])
    # a source without a training log has no last learning rate
    cfg = _cfg(make_overrides, tmp_path, "y", **{"train.init_from": source / "final",
                                                 "train.init_lr": "source"})
    (tmp_path / "lonely").mkdir()
    shutil_copy = __import__("shutil").copytree
    shutil_copy(source / "final", tmp_path / "lonely" / "model")
    cfg.train.init_from = str(tmp_path / "lonely" / "model")
    with pytest.raises(ConfigError, match=r"train.init_lr=source: .* has no training log"):
        Trainer(cfg, progress=False)
    assert not (tmp_path / "y").exists()
