"""``--data calib`` (and ``auto`` without validation data): the calibration tokens of the last
recorded routing masks, from loose files or a committed ``routing.zip``."""

import shutil
import zipfile

import numpy as np

from remoe.lab.analysis.model_analyses import eval_tokens
from remoe.lab.analysis.runlog import Run


def _check(tokens, name):
    assert tokens.domains == ["calibration"] and tokens.source == f"calibration set of {name}"
    ids, dom = next(iter(tokens.batches()))
    assert ids.ndim == 2 and ids.shape[0] == dom.shape[0] and int(ids.min()) >= 1


def test_calibration_tokens_from_loose_masks_and_from_the_archive(remoe_run, tmp_path):
    _check(eval_tokens(Run(remoe_run), "calib", batch_size=2), "masks_0000040.npz")
    # auto falls back to them: the synthetic run's data cache does not exist
    _check(eval_tokens(Run(remoe_run), "auto", batch_size=2), "masks_0000040.npz")
    packed = tmp_path / "packed"
    shutil.copytree(remoe_run, packed, ignore=shutil.ignore_patterns("routing", "final"))
    with zipfile.ZipFile(packed / "routing.zip", "w") as z:
        for p in sorted((remoe_run / "routing").glob("masks_*.npz")):
            z.write(p, p.name)
    run = Run(packed)
    assert [s for s, _ in run.mask_files()] == [0, 10, 20, 30, 40]
    _check(eval_tokens(run, "calib", batch_size=2), "masks_0000040.npz")
    assert np.array_equal(next(iter(eval_tokens(run, "calib").batches()))[0].numpy(),
                          next(iter(eval_tokens(Run(remoe_run), "calib").batches()))[0].numpy())
