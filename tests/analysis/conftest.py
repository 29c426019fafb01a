"""Synthetic run directories in the documented layout (docs/ARCHITECTURE.md), built here.

``make_run`` writes config.yaml, metrics.jsonl with a hand-made three-stage sparsity curve,
eval.jsonl, routing/masks_<step>.npz, summary.json and (optionally) final/ with a micro model
(``save_pretrained``) and a tiny byte-level BPE ``tokenizer.json``; ``tokens_npz`` writes
evaluation tokens of two domains for ``--data``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

E, K, LAYERS = 8, 1, 2
TARGET = 1 - K / E
# the synthetic curve (steps 1..120): 0.5 at initialisation, a dense stage I alternating
# 0.19 / 0.21 up to step 30, a linear rise 0.3 -> 0.825 over steps 31..60 (stage II), then on
# target +/- 0.004 from step 61 on (stage III). Hand values: stage II starts at 31 (see the
# lambda of make_run), settling at 61, settling time 60 steps (tol 0.01, window 10).
STAGE2_START, SETTLE_STEP, NUM_STEPS = 31, 61, 120


def sparsity_curve(num_steps: int = NUM_STEPS) -> np.ndarray:
    steps = np.arange(1, num_steps + 1)
    s = 0.2 + 0.01 * (-1.0) ** steps
    rise = (steps >= STAGE2_START) & (steps < SETTLE_STEP)
    frac = (steps[rise] - STAGE2_START) / (SETTLE_STEP - 1 - STAGE2_START)
    s[rise] = 0.3 + (TARGET - 0.05 - 0.3) * frac
    on = steps >= SETTLE_STEP
    s[on] = TARGET + 0.004 * np.sin(steps[on])
    s[0] = 0.5  # random-init sparsity, above the dense trough
    return s


def save_masks(path: Path, masks: np.ndarray, token_ids: np.ndarray, step: int) -> None:
    """The trainer's mask-file format."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, masks=np.packbits(masks.astype(bool), axis=-1),
                        shape=np.array(masks.shape), token_ids=token_ids, step=np.array(step))


TEXTS = {
    "code": ["def f(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n",
             "import numpy as np\nx = np.zeros(3)\n", "class A:\n    pass\n"] * 6,
    "prose": ["The cat sat on the mat and looked at the sky.",
              "It was a bright cold day in April, and the clocks were striking.",
              "She walked along the river, thinking of home and of the sea."] * 8,
}


def make_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([t for ts in TEXTS.values() for t in ts], trainer=trainer)
    tok.save(str(path))


def make_run(root: Path, name: str = "remoe-syn", router: str = "relu", *, with_model: bool = True,
             mask_steps=(0, 10, 20, 30, 40), flip_p: float = 0.05, seed: int = 0) -> Path:
    run = root / name
    run.mkdir(parents=True)
    cfg = {"run": {"name": name, "out_dir": str(root), "seed": seed},
           "model": {"preset": "micro", "router": router, "num_experts": E, "top_k": K},
           "data": {"sources": ["builtin"], "cache_dir": str(root / "no-cache")},
           "train": {"seq_len": 32, "eval_batch_size": 4},
           "analysis": {"record_masks_every": 10, "calib_tokens": 64}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    s = sparsity_curve() if router == "relu" else np.full(NUM_STEPS, TARGET)
    rng = np.random.default_rng(seed)
    with (run / "metrics.jsonl").open("w") as f:
        # lambda grows x1.2 per step while below target; lambda_0 is chosen so that
        # lambda * L_reg first reaches 1e-3 * L_lm at step 31 (5.50e-3 < 5.83e-3 at step 30,
        # 6.60e-3 >= 5.76e-3 at step 31): stage II starts at STAGE2_START
        lam = 1.39e-5
        for i, si in enumerate(s, start=1):
            lm = 6.0 * np.exp(-i / 40) + 3.0 + 0.02 * rng.standard_normal()
            reg = 2.0 if i < SETTLE_STEP else 0.3
            rec = {"step": i, "tokens": 256 * i, "flops": 1e9 * i, "lr": 1e-3, "loss": lm,
                   "lm_loss": lm, "reg_loss": reg if router == "relu" else 0.0,
                   "aux_loss": 0.0 if router == "relu" else 0.01,
                   "lambda": lam if router == "relu" else 0.0,
                   "sparsity": float(si), "layer_sparsity": [float(si) - 0.01, float(si) + 0.01],
                   "expert_counts": [[32.0] * E] * LAYERS, "step_tokens": 256, "grad_norm": 1.0,
                   "tokens_per_s": 1000.0, "elapsed_s": 0.25 * i, "active_k": E * (1 - float(si))}
            f.write(json.dumps(rec) + "\n")
            lam *= 1.2 if si < TARGET else 1 / 1.2
        f.write('{"step": 121, "tokens"')  # a line still being written: ignored
    with (run / "eval.jsonl").open("w") as f:
        for st, v in ((60, 4.2), (120, 3.9)):
            f.write(json.dumps({"step": st, "tokens": 256 * st, "val_loss": v, "val_ppl": np.exp(v),
                                "domains": {"code": v - 0.3, "prose": v + 0.3}}) + "\n")
    # routing masks: start random, each recording flips each entry with prob flip_p
    T = 64
    tokens = rng.integers(1, 300, T)
    masks = rng.random((LAYERS, T, E)) < 0.2
    for st in mask_steps:
        save_masks(run / "routing" / f"masks_{st:07d}.npz", masks, tokens, st)
        masks = masks ^ (rng.random(masks.shape) < flip_p)
    (run / "summary.json").write_text(json.dumps({"router": router, "target_sparsity": TARGET,
                                                  "val_loss": 3.9, "steps": NUM_STEPS}))
    if with_model:
        import torch

        from remoe import ReMoEConfig, ReMoEForCausalLM

        torch.manual_seed(seed)
        model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router=router, num_experts=E,
                                                         top_k=K))
        model.save_pretrained(run / "final", safe_serialization=True)
        make_tokenizer(run / "final" / "tokenizer.json")
    return run


def tokens_npz(path: Path, tokenizer: Path, seq_len: int = 32) -> Path:
    """Evaluation tokens of the two domains of TEXTS as ``--data FILE.npz``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    rows, doms = [], []
    for d, (name, texts) in enumerate(TEXTS.items()):
        ids = [i for t in texts for i in tok.encode(t).ids + [0]]
        n = len(ids) // seq_len
        rows += [ids[j * seq_len:(j + 1) * seq_len] for j in range(n)]
        doms += [d] * n
    np.savez(path, input_ids=np.array(rows, dtype=np.int64), domain_ids=np.array(doms),
             domains=np.array(list(TEXTS)))
    return path


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def remoe_run(runs_root) -> Path:
    return make_run(runs_root, "remoe-syn", "relu", flip_p=0.02)


@pytest.fixture(scope="session")
def topk_run(runs_root) -> Path:
    return make_run(runs_root, "moe-syn", "topk", with_model=False, flip_p=0.08, seed=1)


@pytest.fixture(scope="session")
def eval_npz(runs_root, remoe_run) -> Path:
    return tokens_npz(runs_root / "tokens.npz", remoe_run / "final" / "tokenizer.json")


@pytest.fixture(scope="session")
def synth():
    """The helpers and hand values of this file, for the test modules."""
    from types import SimpleNamespace

    return SimpleNamespace(TARGET=TARGET, STAGE2_START=STAGE2_START, SETTLE_STEP=SETTLE_STEP,
                           NUM_STEPS=NUM_STEPS, E=E, LAYERS=LAYERS, sparsity_curve=sparsity_curve,
                           save_masks=save_masks, make_run=make_run, tokens_npz=tokens_npz)
