"""Built-in offline tasks (construction, lm-eval integration) and standard-task data lookup."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from lm_eval.api.model import LM

from remoe.eval.builtin_tasks import (BUILTIN_TASKS, DOMAIN, HELLASWAG, LAMBADA,
                                      BuiltinTaskConfig, write_builtin_tasks)
from remoe.eval.zeroshot import TaskPlan, run_tasks

CFG = BuiltinTaskConfig(num_examples=12, context_words=16, ending_words=6)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class AnswerKeyLM(LM):
    """Scores (context, continuation) pairs from an answer key, without any model.

    ``mode="oracle"``: the correct pair gets log-likelihood 0 and is greedy, any other -50;
    ``mode="uniform"``: every pair gets the same score (a model with no preference)."""

    def __init__(self, correct: set[tuple[str, str]], mode: str = "oracle") -> None:
        super().__init__()
        self.correct, self.mode, self.seen = correct, mode, []

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        out = []
        for r in requests:
            self.seen.append(r.args)
            hit = r.args in self.correct
            out.append((0.0, True) if self.mode == "oracle" and hit else
                       (-1.0, False) if self.mode == "uniform" else (-50.0, False))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def answer_key(task_dir: Path) -> set[tuple[str, str]]:
    key = set()
    for e in read_jsonl(task_dir / f"{LAMBADA}.jsonl"):
        key.add((e["context"], e["target"]))
    for t in (HELLASWAG, DOMAIN):
        for e in read_jsonl(task_dir / f"{t}.jsonl"):
            key.add((e["context"], " " + e["endings"][e["label"]]))
    return key


def test_construction_is_deterministic_and_correct(tmp_path, held_out_docs):
    a = write_builtin_tasks(held_out_docs, tmp_path / "a", CFG)
    b = write_builtin_tasks(held_out_docs, tmp_path / "b", CFG)
    c = write_builtin_tasks(held_out_docs, tmp_path / "c", BuiltinTaskConfig(
        num_examples=12, context_words=16, ending_words=6, seed=7))
    texts = {(d, k): t for d, docs in held_out_docs.items() for k, t in docs}
    for task in BUILTIN_TASKS:
        assert a["tasks"][task]["examples"] == 12
        fa, fb = (tmp_path / "a" / f"{task}.jsonl").read_bytes(), (tmp_path / "b" / f"{task}.jsonl").read_bytes()
        assert fa == fb  # same documents + config -> byte-identical task data
        assert fa != (tmp_path / "c" / f"{task}.jsonl").read_bytes()  # another seed differs
    assert c["key"] != a["key"]

    for e in read_jsonl(tmp_path / "a" / f"{LAMBADA}.jsonl"):
        word = e["target"][1:]
        assert e["target"].startswith(" ") and word.isalpha() and len(word) >= 3
        assert (e["context"] + e["target"]) in texts[(e["domain"], e["doc"])]
        assert word in e["context"].split() or word in e["context"].replace(".", " ").split()
    seen_labels = set()
    for e in read_jsonl(tmp_path / "a" / f"{HELLASWAG}.jsonl"):
        doc = texts[(e["domain"], e["doc"])]
        assert len(e["endings"]) == 4 and len(set(e["endings"])) == 4
        assert all(len(x.split()) == 6 for x in e["endings"])
        assert (e["context"] + " " + e["endings"][e["label"]]) in doc
        for i, x in enumerate(e["endings"]):
            if i != e["label"]:  # distractors: other documents of the same domain
                assert any(x in t for (d, k), t in texts.items()
                           if d == e["domain"] and k != e["doc"])
        seen_labels.add(e["label"])
    assert len(seen_labels) > 1  # the answer is not always in the same slot
    doms = set()
    for e in read_jsonl(tmp_path / "a" / f"{DOMAIN}.jsonl"):
        assert sorted(e["choice_domains"]) == sorted(held_out_docs)
        assert e["choice_domains"][e["label"]] == e["domain"]
        assert (e["context"] + " " + e["endings"][e["label"]]) in texts[(e["domain"], e["doc"])]
        doms.add(e["domain"])
    assert doms == set(held_out_docs)  # round-robin over the domains

    # an up-to-date directory is reused, not rewritten
    mtime = (tmp_path / "a" / f"{HELLASWAG}.jsonl").stat().st_mtime_ns
    assert write_builtin_tasks(held_out_docs, tmp_path / "a", CFG)["key"] == a["key"]
    assert (tmp_path / "a" / f"{HELLASWAG}.jsonl").stat().st_mtime_ns == mtime


def test_single_document_domain_is_skipped_for_hellaswag(tmp_path, held_out_docs):
    docs = {"alpha": held_out_docs["alpha"][:1], "beta": held_out_docs["beta"]}
    m = write_builtin_tasks(docs, tmp_path, CFG, tasks=[HELLASWAG])
    assert m["tasks"][HELLASWAG]["examples_per_domain"] == {"beta": 12}
    m = write_builtin_tasks({"alpha": held_out_docs["alpha"][:1]}, tmp_path / "x", CFG,
                            tasks=[HELLASWAG])
    assert HELLASWAG in m["skipped"] and not (tmp_path / "x" / f"{HELLASWAG}.yaml").exists()


def test_oracle_scores_one_and_uniform_scores_chance_through_lm_eval(tmp_path, held_out_docs,
                                                                     no_network):
    write_builtin_tasks(held_out_docs, tmp_path, CFG)
    plan = TaskPlan(builtin=list(BUILTIN_TASKS), builtin_dir=tmp_path)
    key = answer_key(tmp_path)

    oracle = AnswerKeyLM(key)
    res = run_tasks(oracle, plan)["results"]
    for task in (HELLASWAG, DOMAIN):
        assert res[task]["acc"] == res[task]["acc_norm"] == res[task]["acc_mutual_info"] == 1.0
    assert res[LAMBADA]["acc"] == 1.0 and res[LAMBADA]["perplexity"] == pytest.approx(1.0)
    # lm-eval joined context and ending with one space, exactly as the document reads
    assert sum(1 for a in oracle.seen if a in key) == 3 * 12

    uniform = run_tasks(AnswerKeyLM(key, mode="uniform"), plan)["results"]
    # equal scores: lm-eval picks the first choice, so acc = share of answers in slot 0
    for task in (HELLASWAG, DOMAIN):
        first = sum(e["label"] == 0 for e in read_jsonl(tmp_path / f"{task}.jsonl")) / 12
        assert uniform[task]["acc"] == pytest.approx(first)
        assert uniform[task]["acc_mutual_info"] == pytest.approx(first)
    assert uniform[LAMBADA]["acc"] == 0.0
    assert uniform[LAMBADA]["perplexity"] == pytest.approx(math.e)
    assert no_network == []


def test_missing_standard_task_is_reported_without_network(tmp_path, monkeypatch, no_network):
    import datasets.config
    import huggingface_hub.constants

    from remoe.eval.standard import resolve_standard_tasks

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty_ds_cache")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_hub"))
    (st,) = resolve_standard_tasks(["arc_easy"], task_data_dir=tmp_path / "nothing_here")
    assert st.config is None and st.column == "ARC-e"
    msg = st.missing
    assert "arc_easy" in msg and "allenai/ai2_arc" in msg and "ARC-Easy" in msg
    assert "skipped" in msg and "--task-data-dir" in msg and "HF_DATASETS_CACHE" in msg
    assert "save_to_disk('DIR/arc_easy')" in msg
    assert no_network == []


def test_standard_task_runs_from_a_local_data_dir(tmp_path, no_network):
    from remoe.eval.standard import resolve_standard_tasks

    qs = [("Which is a fruit?", ["stone", "apple", "car"], "B"),
          ("What is cold?", ["ice", "fire", "sun"], "A"),
          ("Which one flies?", ["rock", "fish", "bird"], "C")]
    d = tmp_path / "arc_easy"
    d.mkdir()
    with open(d / "test.jsonl", "w") as f:
        for i, (q, texts, ans) in enumerate(qs):
            f.write(json.dumps({"id": str(i), "question": q, "answerKey": ans,
                                "choices": {"text": texts, "label": ["A", "B", "C"]}}) + "\n")
    (st,) = resolve_standard_tasks(["arc_easy"], task_data_dir=tmp_path)
    assert st.missing is None and st.source == str(d)
    key = {(f"Question: {q}\nAnswer:", " " + texts["ABC".index(a)]) for q, texts, a in qs}
    res = run_tasks(AnswerKeyLM(key), TaskPlan(standard=[st]))
    assert res["results"]["arc_easy"]["acc"] == 1.0 and res["n_samples"]["arc_easy"] == 3
    assert no_network == []
