#!/usr/bin/env python3
"""Do saved remoe models work with transformers alone, at both ends of the supported range?

    python3 scripts/check_hf_compat.py [--work DIR] [--only newest|oldest] [--install-torch]

Run from the remoe environment (tests/hf/test_hf_compat.py runs it in the default test suite,
so CI runs it). It

1. saves, with remoe: two micro models (ReLU router with a tokenizer, as training writes a
   checkpoint; Lory, whose decoding keeps state) and two converted ones (``remoe convert
   from-hf`` of tiny random Mixtral -> TopK and Qwen2-MoE -> ReLU sources), and their reference
   logits and greedy generations (a plain argmax loop of full forward passes, one prompt at a
   time: no KV cache, no ``generate``) in WORK/reference.json;
2. for the NEWEST transformers on PyPI and the OLDEST one remoe's requirements allow (the
   ``>=`` bound of its ``transformers`` requirement), makes a fresh virtualenv holding only
   torch, that transformers, safetensors and tokenizers -- no remoe -- and runs
   scripts/hf_compat_venv.py there. torch is this environment's (the version remoe pins): a
   .pth file adds a directory of links to torch and the packages it requires, and nothing else;
   ``--install-torch`` pip-installs the same version into a base virtualenv instead. Checked
   there: logits equal remoe's, cached == uncached == batched left-padded ==
   one-prompt-at-a-time generation == remoe's, AutoTokenizer's ids == remoe's, and a loaded
   model saved again keeps its card, its checksums and readable files.

pip's wheel cache is used (nothing is passed to bypass it). Exit status: 0 when both versions
pass, 1 when a check fails (a transformers release that breaks a saved model), 2 when a
virtualenv cannot be made or pip cannot install (offline, or no such release).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD = HERE / "hf_compat_venv.py"
NEW_TOKENS = 16
WORDS = "alpha beta gamma delta river stone cloud paper light sound the a of and".split()


class SetupError(Exception):
    """A virtualenv could not be made or pip could not install (exit status 2)."""


def say(msg: str) -> None:
    print(f"check_hf_compat: {msg}", flush=True)


# -- the range -------------------------------------------------------------------------------

def oldest_transformers() -> str:
    """The ``>=`` bound of remoe's transformers requirement: pyproject.toml's dependency list
    beside this script, else the installed package's metadata."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    lines = requires("remoe") or []
    pyproject = HERE.parent / "pyproject.toml"
    if pyproject.is_file() and sys.version_info >= (3, 11):
        import tomllib

        lines = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    for line in lines:
        req = Requirement(line)
        if req.name == "transformers" and req.marker is None:
            lows = [s.version for s in req.specifier if s.operator in (">=", "==", "~=")]
            if lows:
                return lows[0]
    raise SetupError("remoe's requirements give transformers no lower bound (>=)")


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def link_torch(dest: Path) -> str:
    """``dest``: symbolic links to the installed files of this environment's torch and of the
    packages it requires, nothing else (no remoe, no transformers); returns ``dest``."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    dest.mkdir(parents=True)
    todo, seen = ["torch"], set()
    while todo:
        try:
            dist = distribution(todo.pop())
        except PackageNotFoundError:
            continue  # a requirement this platform does not install
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for f in dist.files or []:
            top = f.parts[0]
            if top not in ("..", "__pycache__") and not top.endswith(".pth") and \
                    not (dest / top).exists():
                (dest / top).symlink_to(Path(dist.locate_file(top)).resolve())
    return str(dest)


# -- 1. the saved models and their reference, with remoe --------------------------------------

def _randomize(model, seed: int, scale: float = 0.3):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # large enough that every weight matters in the logits
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * scale if p.dim() > 1 else 1.0 + 0.1 * noise)
    return model.eval()


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """n argmax tokens, each from a full forward pass over everything so far."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def build(work: Path) -> dict:
    import torch

    from remoe import ReMoEConfig, ReMoEForCausalLM
    from remoe.cli import main as remoe_main
    from remoe.data.tokenizer import save_tokenizer, train_tokenizer
    from remoe.train.checkpoint import write_model_dir

    texts = [" ".join(random.Random(i).choice(WORDS) for _ in range(120)) for i in range(40)]
    tok_path = work / "tokenizer.json"
    tok = train_tokenizer([texts], vocab_size=300)
    save_tokenizer(tok, tok_path)
    models: dict[str, dict] = {}

    def micro(name: str, **over):
        torch.manual_seed(0)
        cfg = ReMoEConfig.from_preset("micro", **{"vocab_size": 320, "num_experts": 4,
                                                  "max_position_embeddings": 64, **over})
        write_model_dir(work / name, _randomize(ReMoEForCausalLM(cfg), seed=1, scale=0.2),
                        tok_path)

    micro("micro-relu")
    micro("micro-lory", router="lory", lory_segment_len=4)
    prompt_texts = ["alpha beta gamma river stone", "the", "cloud paper light of the sound and"]
    tok_ids = [tok.encode(t).ids for t in prompt_texts]

    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM)

    backbone = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    sources = {
        "mixtral-topk": (MixtralForCausalLM(MixtralConfig(
            **backbone, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
            ["--router", "topk"]),
        "qwen2moe-relu": (Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **backbone, intermediate_size=40, moe_intermediate_size=24,
            shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
            qkv_bias=True)), ["--router", "relu"]),
    }
    for i, (name, (src_model, opts)) in enumerate(sources.items()):
        src = work / f"source-{name}"
        _randomize(src_model, seed=3 + i).save_pretrained(src)
        if remoe_main(["convert", "from-hf", str(src), str(work / name), *opts]) != 0:
            raise RuntimeError(f"remoe convert from-hf {src} failed")

    id_prompts = [[5, 17, 40, 3, 44], [8], [9, 60, 7, 7, 31, 25, 1, 64, 3]]
    for name in ("micro-relu", "micro-lory", *sources):
        model = ReMoEForCausalLM.from_pretrained(work / name).eval()
        cfg = model.config
        prompts = tok_ids if name == "micro-relu" else id_prompts
        ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model(ids).logits
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        models[name] = {"ids": ids.tolist(), "logits": logits.tolist(), "prompts": prompts,
                        "texts": prompt_texts if name == "micro-relu" else None, "pad": pad,
                        "new_tokens": NEW_TOKENS,
                        "generated": [_greedy(model, p, NEW_TOKENS) for p in prompts]}
    import transformers

    ref = {"remoe_env": {"transformers": transformers.__version__,
                         "torch": torch.__version__}, "models": models}
    (work / "reference.json").write_text(json.dumps(ref))
    return ref


# -- 2. the fresh virtualenvs ----------------------------------------------------------------

def _run(cmd: list[str], what: str, timeout: int = 900) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                                "PIP_NO_INPUT": "1"})
    except subprocess.TimeoutExpired:
        raise SetupError(f"{what}: timed out after {timeout} s") from None
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-8:])
        raise SetupError(f"{what} failed (exit {r.returncode}; offline, or no such release?):"
                         f"\n{tail}")
    return r.stdout


def _site(python: Path) -> str:
    return _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                f"{python} sysconfig").strip()


def make_venv(path: Path, packages: list[str]) -> Path:
    """A fresh virtualenv at ``path`` (no pip of its own: this environment's pip installs into
    it) with ``packages``; returns its python."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(path)], f"python -m venv {path}")
    python = path / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *packages],
         f"pip install {' '.join(packages)} into a fresh virtualenv")
    return python


def run_checks(work: Path, label: str, python: Path) -> dict:
    t0 = time.time()
    installed = _run([str(python), "-I", "-c", "import transformers, torch; "
                      "print(transformers.__version__, torch.__version__)"],
                     f"import transformers and torch in {python.parent.parent}").split()
    r = subprocess.run([str(python), "-I", str(CHILD), str(work)], capture_output=True,
                       text=True, cwd=work, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                                          "1"),
                            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                            "HF_HOME": str(work / f"hf_home-{label}")})
    result = {"label": label, "transformers": installed[0], "torch": installed[1],
              "ok": r.returncode == 0, "check_seconds": round(time.time() - t0),
              "log": [ln for ln in r.stdout.splitlines() if ln.startswith(("ok ", "FAIL "))]}
    for ln in r.stdout.splitlines():
        if ln.startswith("RESULT "):
            result["models"] = json.loads(ln[len("RESULT "):])["models"]
    if r.returncode != 0:
        result["error"] = ("\n".join(result["log"][-1:]) or
                           "\n".join(r.stderr.strip().splitlines()[-15:]))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, help="working directory (default: a temporary one, "
                    "removed at the end)")
    ap.add_argument("--only", choices=("newest", "oldest"), help="check one end only")
    ap.add_argument("--install-torch", action="store_true", help="pip-install torch into a "
                    "base virtualenv instead of linking this environment's (slower)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="remoe-hf-compat."))
    work.mkdir(parents=True, exist_ok=True)
    work = work.resolve()
    try:
        oldest = oldest_transformers()
        ends = {"newest": "", "oldest": f"=={oldest}"}
        if args.only:
            ends = {args.only: ends[args.only]}
        t0 = time.time()
        ref = build(work)
        say(f"saved {len(ref['models'])} models and their reference with remoe "
            f"(transformers {ref['remoe_env']['transformers']}) in {time.time() - t0:.0f} s")
        # each transformers into its own virtualenv, at once (transformers does not depend on
        # torch); torch: this environment's, seen through a .pth file naming a directory of
        # links to torch and its requirements only, or (--install-torch) installed once into a
        # base virtualenv; the .pth is written after the installs, so no pip sees a torch there
        t0 = time.time()
        wanted = {label: [f"transformers{spec}", "safetensors", "tokenizers"]
                  for label, spec in ends.items()}
        if args.install_torch:
            wanted["torch"] = [f"torch=={torch_version()}"]
        with ThreadPoolExecutor(len(wanted)) as pool:
            made = {label: pool.submit(make_venv, work / f"venv-{label}", pkgs)
                    for label, pkgs in wanted.items()}
            pythons = {label: f.result() for label, f in made.items()}
        base_site = _site(pythons.pop("torch")) if args.install_torch else \
            link_torch(work / "torch-only")
        for python in pythons.values():
            Path(_site(python), "_remoe_base_torch.pth").write_text(base_site + "\n")
        say(f"fresh virtualenvs (torch=={torch_version()}"
            + (" installed" if args.install_torch else " linked from this environment") + "; "
            + ", ".join(f"transformers{spec or ' newest'}" for spec in ends.values())
            + f") in {time.time() - t0:.0f} s")
        with ThreadPoolExecutor(len(pythons)) as pool:
            futures = {label: pool.submit(run_checks, work, label, python)
                       for label, python in pythons.items()}
            results = {label: f.result() for label, f in futures.items()}
    except SetupError as e:
        say(f"error: {e}")
        return 2
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    for label, r in results.items():
        where = "newest on PyPI" if label == "newest" else f"oldest allowed, >={oldest}"
        say(f"transformers {r['transformers']} ({where}), torch {r['torch']}: "
            f"{'ok' if r['ok'] else 'FAILED'} (checks {r['check_seconds']} s)")
        for ln in r["log"]:
            print(f"    {ln}", flush=True)
        for name, m in (r.get("models") or {}).items():
            for w in m["warnings"]:
                print(f"    warning ({name}): {w}", flush=True)
        if not r["ok"]:
            print(f"    {r['error']}", flush=True)
    if args.work is not None:
        (work / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
