"""Progress output is remoe's own: transformers' "Writing model shards" / "Loading weights"
bars are off around remoe's saves and loads, and the caller's setting is kept afterwards."""

import pytest


@pytest.fixture
def hf_logging():
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    yield logging
    (logging.enable_progress_bar if was else logging.disable_progress_bar)()


def test_saves_and_loads_show_no_transformers_bars(tmp_path, capfd, hf_logging):
    import torch

    from remoe import ReMoEConfig, ReMoEForCausalLM
    from remoe.rundir.loading import load_model
    from remoe.train.checkpoint import write_model_dir

    hf_logging.enable_progress_bar()
    torch.manual_seed(0)
    write_model_dir(tmp_path / "m", ReMoEForCausalLM(ReMoEConfig.from_preset("micro",
                                                                            vocab_size=384)),
                    None)
    load_model(tmp_path / "m", device="cpu")
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "Loading weights" not in err
    assert hf_logging.is_progress_bar_enabled()  # the caller's setting is back


def test_no_hf_bars_keeps_a_disabled_setting(hf_logging):
    from remoe.rundir.bars import no_hf_bars

    hf_logging.disable_progress_bar()
    with no_hf_bars():
        assert not hf_logging.is_progress_bar_enabled()
    assert not hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    with no_hf_bars():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
