"""Papercuts: Pile domains with a named JSONL source, `remoe data CONFIG`, and the
settling note only for adaptive routers."""

from __future__ import annotations

import json
import random
from pathlib import Path

from remoe.cli import main
from remoe.data.userdata import read_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_named_pile_file_keeps_its_set_names(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [
        {"text": "one", "meta": {"pile_set_name": "Github"}},
        {"text": "two", "meta": {"pile_set_name": "Wikipedia (en)"}},
        {"text": "three"}]))
    assert [d.domain for d in read_jsonl(p, domain="pile")] == ["Github", "Wikipedia (en)",
                                                                 "pile"]
    assert [d.domain for d in read_jsonl(p)][2] == "unknown"


def test_remoe_data_takes_the_experiment_config(tmp_path, monkeypatch, capsys):
    import argparse

    from remoe.datacli import add_arguments, config_from_args
    from remoe.experiment import load_config

    monkeypatch.chdir(tmp_path)
    sets = ["data.vocab_size=300", "data.cache_dir=cache", "data.max_bytes_per_domain=5000"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [str(REPO / "configs" / "tiny_remoe.yaml")] + [x for s in sets for x in ("--set", s)]
    got = config_from_args(parser.parse_args(argv))
    want = load_config(REPO / "configs" / "tiny_remoe.yaml", sets).data
    want.cache_dir = str((tmp_path / "cache").resolve())  # what the trainer resolves it to
    assert got == want
    # an option that training would not see is refused, naming the --set to use
    assert main(["data", argv[0], "--vocab-size", "512"]) == 2
    assert "use --set data.vocab_size=VALUE" in capsys.readouterr().err


def test_no_settling_note_for_a_fixed_sparsity_router(tmp_path, capsys):
    d = tmp_path / "corpus" / "one"
    d.mkdir(parents=True)
    words = "alpha beta gamma delta river stone cloud paper".split()
    for i in range(6):
        (d / f"{i}.txt").write_text(" ".join(random.Random(i).choice(words) for _ in range(300)))
    sets = {"data.sources": f"[{d}]", "data.cache_dir": tmp_path / "cache",
            "data.vocab_size": 300, "run.out_dir": tmp_path / "runs", "model.preset": "micro",
            "train.seq_len": 16, "train.micro_batch_size": 2, "train.max_steps": 3,
            "train.eval_every": 0, "train.save_every": 0, "train.eval_chunks_per_domain": 1,
            "analysis.record_masks_every": 0}
    for router in ("topk", "relu"):
        argv = ["train", "--no-progress", "--allocator", "default", "--set",
                f"model.router={router}", "--set", f"run.name={router}"]
        for k, v in sets.items():
            argv += ["--set", f"{k}={v}"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert ("has not settled" in out) == (router == "relu"), router


def test_auto_classes_ask_nothing_once_remoe_is_imported(save_micro):
    # AutoTokenizer reads config.json, whose auto_map names the bundled code,
    # so transformers asked "Do you wish to run the custom code?" even with remoe installed.
    # `from remoe import ReMoEForCausalLM` registers model_type "remoe" with the Auto classes: both load from the
    # installed package without trust_remote_code and without the question (README, "Saved
    # models"); the model is remoe's own class, not the bundled copy.
    import subprocess
    import sys

    path, _ = save_micro("auto-no-question")
    code = ("from remoe import ReMoEForCausalLM  # noqa\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"tok = AutoTokenizer.from_pretrained({str(path)!r})\n"
            f"model = AutoModelForCausalLM.from_pretrained({str(path)!r})\n"
            "print(type(model).__module__, tok('The cat')['input_ids'][:1])\n")
    r = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "custom code" not in r.stdout + r.stderr
    assert r.stdout.split()[0] == "remoe.model.llama"
