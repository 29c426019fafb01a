"""docs/FINETUNE.md's worked example, run as written on a micro model: ReMoETrainer fine-tunes
a saved remoe model on a JSONL file; the loss falls and the sparsity stays on target."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _example() -> str:
    text = (DOCS / "FINETUNE.md").read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _set(code: str, name: str, value) -> str:
    code, n = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", code, flags=re.M)
    assert n == 1, name
    return code


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, micro_data_cfg):
    """A micro ReMoE (E=4, k=1) trained by remoe until its sparsity sits at its target."""
    from remoe.experiment import load_config
    from remoe.train.trainer import Trainer
    from tests.train.conftest import _overrides

    out = tmp_path_factory.mktemp("ft_source")
    cfg = load_config(None, _overrides(micro_data_cfg, out, "src", **{
        "model.num_experts": 4, "train.seq_len": 64, "train.max_steps": 150,
        "train.warmup_steps": 10, "train.eval_every": 0, "train.save_every": 0,
        "analysis.record_masks_every": 0}))
    t = Trainer(cfg, progress=False)
    try:
        t.train()
    finally:
        t.close()
    return out / "src" / "final"


#: band of the mean sparsity of the 4 logged steps around the target 0.75: 1.45x the largest
#: deviation measured over source seeds 0-7 under the default kernels and under
#: ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE on an Intel Xeon (AVX-512): means 0.681-0.793
#: (seed 7, default: 0.681; seed 0, the one here: 0.749 default, 0.793 second path); single
#: logged steps spread 0.664-0.815, so one step is not asserted on. The loss fell in all 16 runs.
SPARSITY_BAND = 0.1


@pytest.mark.kernel_paths
def test_the_worked_example_fine_tunes_with_sparsity_on_target(saved_model, tmp_path, capsys,
                                                               micro_data_cfg):
    from remoe.data.bundle import load_documents

    # "your texts": paragraphs of the corpus the source model trained on (fixed text: it used
    # to be the project's docs, which change). On text unlike that (the held-out split, or the
    # docs) the model turned sparser than its target (0.83 vs 0.75) and lambda, which can only
    # relax, could not bring it back: docs/FINETUNE.md says so
    docs = load_documents("train", cache_dir=micro_data_cfg.cache_dir)
    paragraphs = [" ".join(p.split()) for d in docs for p in d.text.split("\n\n")][:600]
    data = tmp_path / "my_texts.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs if len(p) > 80))
    code = _example()
    for name, value in (("MODEL", str(saved_model)), ("DATA", str(data)),
                        ("OUT", str(tmp_path / "ft")), ("STEPS", 40), ("SEQ", 64)):
        code = _set(code, name, value)
    exec(compile(code, "docs/FINETUNE.md", "exec"), {"__name__": "__main__"})  # noqa: S102
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    recs = [dict(zip(ln.split()[::2], map(float, ln.split()[1::2]))) for ln in lines]
    assert len(recs) == 4 and recs[-1]["loss"] < recs[0]["loss"]
    # on target within the band: lambda can only relax when the model turns sparser than its
    # target on its own (a gate at zero gets no gradient back), as in remoe train
    mean = sum(r["sparsity"] for r in recs) / len(recs)
    assert abs(mean - 0.75) < SPARSITY_BAND, recs
    from remoe import ReMoEForCausalLM

    tuned = ReMoEForCausalLM.from_pretrained(tmp_path / "ft" / "final")
    assert tuned.config.routing.num_experts == 4
