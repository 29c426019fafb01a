"""The half of scripts/check_hf_compat.py that runs inside a fresh virtualenv holding only torch,
transformers, safetensors and tokenizers: it never imports remoe (and fails if it can).

    VENV/bin/python -I scripts/hf_compat_venv.py WORK

For every model directory listed in WORK/reference.json (written by check_hf_compat.py with
remoe), loaded with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``:

* the logits of fixed token ids equal remoe's (max |diff| <= 1e-5);
* greedy generation agrees token for token four ways -- batched left-padded with the KV cache,
  batched without it, one prompt at a time with and without it -- and with remoe's own;
* a directory with a tokenizer: ``AutoTokenizer`` gives remoe's token ids (left padding);
* the first model saved again: the copy keeps the model card and a checksums.json that matches
  its files, its files are not 0600 under umask 022, and it loads with the same logits.

Prints one line per model and a JSON summary line ("RESULT {...}"); exits 1 on any mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path


def fail(msg: str) -> None:
    print(f"FAIL {msg}", flush=True)
    sys.exit(1)


def left_pad(prompts: list[list[int]], pad: int):
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generations(model, prompts: list[list[int]], pad: int, n: int) -> dict[str, list]:
    """The n greedy tokens after each prompt, four ways."""
    import torch

    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
    ids, mask = left_pad(prompts, pad)
    out = {}
    with torch.no_grad():
        for cache in (True, False):
            got = model.generate(input_ids=ids, attention_mask=mask, use_cache=cache, **kw)
            out[f"batched_cache={cache}"] = got[:, -n:].tolist()
            one = []
            for p in prompts:
                x = torch.tensor([p])
                got = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                     use_cache=cache, **kw)
                one.append(got[0, -n:].tolist())
            out[f"one_cache={cache}"] = one
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_resave(model, src: Path, dst: Path, ids, want_logits) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    os.umask(0o022)
    model.save_pretrained(dst)
    names = {p.name for p in dst.iterdir()}
    for need in ("README.md", "checksums.json", "modeling_remoe.py", "model.safetensors"):
        if need not in names:
            fail(f"{src.name}: save_pretrained of the loaded model wrote no {need}")
    if (dst / "README.md").read_text() != (src / "README.md").read_text():
        fail(f"{src.name}: the re-saved model card differs from the loaded directory's")
    files = json.loads((dst / "checksums.json").read_text())["files"]
    listed = {p.relative_to(dst).as_posix() for p in dst.rglob("*")
              if p.is_file() and p.name != "checksums.json"}
    if set(files) != listed:
        fail(f"{src.name}: re-saved checksums.json lists {sorted(set(files) ^ listed)} wrongly")
    for name, e in files.items():
        if (dst / name).stat().st_size != e["size"] or sha256(dst / name) != e["sha256"]:
            fail(f"{src.name}: re-saved checksums.json does not match {name}")
    for p in dst.iterdir():
        if p.is_file() and (p.stat().st_mode & 0o777) != 0o644:
            fail(f"{src.name}: re-saved {p.name} has mode {oct(p.stat().st_mode & 0o777)}, "
                 "not 0o644 under umask 022")
    again = AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True).eval()
    with torch.no_grad():
        diff = (again(ids).logits - want_logits).abs().max().item()
    if diff > 1e-5:
        fail(f"{src.name}: the re-saved model's logits differ by {diff:.3g}")


def main() -> None:
    work = Path(sys.argv[1]).resolve()
    try:
        import remoe  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        fail("remoe is importable in the compatibility virtualenv")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import logging

    class Keep(logging.Handler):  # transformers' own warnings (deprecations included)
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(f"{record.levelname}: {record.getMessage().splitlines()[0][:160]}")

    logged: list[str] = []
    logging.getLogger("transformers").addHandler(Keep(logging.WARNING))
    torch.manual_seed(0)
    ref = json.loads((work / "reference.json").read_text())
    summary = {"transformers": transformers.__version__, "torch": torch.__version__,
               "models": {}}
    first = True
    for name, r in ref["models"].items():
        d = work / name
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
            if not type(model).__module__.startswith("transformers_modules"):
                fail(f"{name}: loaded {type(model).__module__}, not the bundled code")
            ids = torch.tensor(r["ids"])
            with torch.no_grad():
                out = model(ids)
            diff = (out.logits - torch.tensor(r["logits"])).abs().max().item()
            if diff > 1e-5:
                fail(f"{name}: logits differ from remoe's by {diff:.3g}")
            prompts = r["prompts"]
            if r.get("texts"):  # the directory's tokenizer gives remoe's ids
                tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
                enc = tok(r["texts"], padding=True)
                got = [[t for t, m in zip(i, a) if m]
                       for i, a in zip(enc["input_ids"], enc["attention_mask"])]
                if got != prompts or tok.padding_side != "left":
                    fail(f"{name}: AutoTokenizer gives {got} (padding {tok.padding_side}), "
                         f"remoe gives {prompts} (left)")
            gens = generations(model, prompts, r["pad"], r["new_tokens"])
            for how, toks in gens.items():
                if toks != r["generated"]:
                    bad = sum(a != b for x, y in zip(toks, r["generated"]) for a, b in zip(x, y))
                    fail(f"{name}: {how} generation differs from remoe's in {bad} of "
                         f"{len(prompts) * r['new_tokens']} tokens: {toks} vs {r['generated']}")
            if first:
                # no dot in the name: transformers 4.56 cannot import the code of a directory
                # whose name has one (it makes the name a module path)
                check_resave(model, d, work / f"resaved_{transformers.__version__}_{name}"
                             .replace(".", "_"),
                             ids, torch.tensor(r["logits"]))
                first = False
        notes = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:160]}"
                        for w in caught} | set(logged))
        logged.clear()
        summary["models"][name] = {"max_logit_diff": diff, "warnings": notes}
        print(f"ok {name}: logits max diff {diff:.3g}; {len(gens)} ways x {len(prompts)} "
              f"prompts x {r['new_tokens']} tokens agree with remoe", flush=True)
    print("RESULT " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
