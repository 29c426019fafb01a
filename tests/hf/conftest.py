"""Fixtures of the Hugging Face packaging tests: a tiny tokenizer, saved micro models, and a
Python that has torch/transformers/lm-eval but cannot import remoe."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

WORDS = "alpha beta gamma delta river stone cloud paper light sound the a of and".split()


def texts(n: int = 40) -> list[str]:
    return [" ".join(random.Random(i).choice(WORDS) for _ in range(120)) for i in range(n)]


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> str:
    from remoe.data.tokenizer import save_tokenizer, train_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(train_tokenizer([texts()], vocab_size=300), path)
    return str(path)


@pytest.fixture(scope="session")
def save_micro(tokenizer_path, tmp_path_factory):
    """``save_micro(name, seed=0, **config overrides)``: a random micro ReMoE written by
    ``write_model_dir`` (as training writes final/ and checkpoints); returns (dir, model)."""
    import torch

    from remoe import ReMoEConfig, ReMoEForCausalLM
    from remoe.train.checkpoint import write_model_dir

    root = tmp_path_factory.mktemp("models")

    def save(name: str, seed: int = 0, **overrides):
        torch.manual_seed(seed)
        cfg = ReMoEConfig.from_preset("micro", **{"vocab_size": 320, "num_experts": 4,
                                                  "max_position_embeddings": 64, **overrides})
        model = ReMoEForCausalLM(cfg).eval()
        with torch.no_grad():  # random routers and experts: make every expert matter
            for pname, p in model.named_parameters():  # q/k/v biases too (attention_bias)
                p.normal_(0, 0.2) if p.dim() > 1 or pname.endswith(".bias") else None
        return write_model_dir(root / name, model, tokenizer_path), model

    return save


SITE = sysconfig.get_paths()["purelib"]
# no site module (so no .pth files: remoe's editable install is one), no PYTHON* variables,
# no current directory: only the standard library and site-packages, which lacks remoe
PRELUDE = f"import sys; sys.path.append({SITE!r})\n"


def run_clean(code: str, tmp: Path, timeout: int = 300, argv: list[str] | None = None
              ) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(tmp / "hf_home"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-I", "-S", "-c", PRELUDE + code, *(argv or [])],
                       capture_output=True, text=True, cwd=tmp, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r
