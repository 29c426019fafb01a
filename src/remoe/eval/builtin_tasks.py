"""Offline zero-shot tasks built from the held-out split of the corpus, as an lm-eval task dir.

Three tasks, defined on *text* (words = runs of non-whitespace), so one task set serves every
tokenizer and every model trained on the corpus:

``remoe_lambada`` (LAMBADA style, output ``loglikelihood``)
    A passage of up to ``context_words`` words from a held-out document of the LAMBADA
    domains (``prose`` when the corpus has it, else all domains), cut just before a target
    word; the target is ``" " + word``. Targets are alphabetic words of at least 3 letters
    (trailing punctuation dropped), not function words, that already occur in the passage,
    so the broader context helps predict them, as in LAMBADA. Metrics: ``acc`` (the greedy continuation is exactly
    the target: lm-eval's ``is_greedy``) and ``perplexity`` (exp of the mean negative
    log-likelihood of the target).
``remoe_hellaswag`` (HellaSwag style, ``multiple_choice``)
    Context: up to ``context_words`` words of a held-out document; choices: its true next
    ``ending_words`` words and ``num_choices - 1`` spans of the same length taken from *other*
    documents of the same domain. Metrics ``acc`` and ``acc_norm`` (log-likelihood per byte).
    Chance: ``1 / num_choices`` (25 %).
``remoe_domain`` (``multiple_choice``)
    The same kind of context; one candidate ending per domain (the true one, and a span from
    a document of each other domain). Chance: ``1 / number of domains``.

Contexts are cut where a single space separates two words; the candidate endings are written
without that space and lm-eval joins context and ending with its ``target_delimiter`` " ", so
every candidate is scored exactly as the text reads. Examples are drawn round-robin over the
domains, uniformly over the eligible positions of each domain, with ``random.Random`` seeded
by ``(seed, task)``: the same documents and config always give byte-identical files.

:func:`write_builtin_tasks` writes ``<task>.jsonl`` + ``<task>.yaml`` (``dataset_path: json``
with absolute ``data_files``; all tasks carry the tag ``remoe_builtin``) and ``manifest.json``
(config, document fingerprint, example counts); an up-to-date directory is reused as is.
Use it with ``TaskManager(include_path=dir)`` or ``lm_eval --include_path dir``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import yaml

from remoe.fileio import atomic_write_text

log = logging.getLogger("remoe.eval")

FORMAT_VERSION = 2
TASK_TAG = "remoe_builtin"
LAMBADA, HELLASWAG, DOMAIN = "remoe_lambada", "remoe_hellaswag", "remoe_domain"
BUILTIN_TASKS = (LAMBADA, HELLASWAG, DOMAIN)
MANIFEST = "manifest.json"

_WORD = re.compile(r"\S+")
_TARGET = re.compile(r"([A-Za-z]{3,})[.,;:!?\"')\]]*")
_ALPHA = re.compile(r"[A-Za-z]+")
# LAMBADA targets are content words (mostly names and nouns): function words are never targets
_STOPWORDS = frozenset("""
about above after again against all and any are because been before being below between both
but can cannot could did does doing down during each few for from further had has have having
her here hers herself him himself his how into its itself just let more most must myself nor
not now off once only other ought our ours ourselves out over own same shall she should some
such than that the their theirs them themselves then there these they this those through too
under until upon very was were what when where which while who whom why will with would yet
you your yours yourself yourselves thee thou thy thine hath doth shalt wilt
""".split())


@dataclass(frozen=True)
class BuiltinTaskConfig:
    """How the built-in tasks are drawn (every field is part of the cache key)."""

    num_examples: int = 300  # per task
    seed: int = 1234
    context_words: int = 48  # at most this many words of context (at least half of it)
    ending_words: int = 12  # length of every candidate ending (hellaswag, domain)
    num_choices: int = 4  # hellaswag: true ending + num_choices - 1 distractors
    lambada_domains: tuple[str, ...] | None = None  # None: ("prose",) if present, else all
    split: str = "test"

    def __post_init__(self) -> None:
        for name in ("num_examples", "context_words", "ending_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_choices < 2:
            raise ValueError(f"num_choices={self.num_choices} must be >= 2")
        if self.lambada_domains is not None:
            object.__setattr__(self, "lambada_domains", tuple(self.lambada_domains))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["lambada_domains"] = list(self.lambada_domains) if self.lambada_domains else None
        return d


class _Doc:
    """A document's text with its word spans and the word indices usable as cut points."""

    __slots__ = ("domain", "key", "text", "spans", "starts")

    def __init__(self, domain: str, key: str, text: str, ending_words: int) -> None:
        self.domain, self.key, self.text = domain, key, text
        self.spans = [m.span() for m in _WORD.finditer(text)]
        n = len(self.spans)
        # word k can start a candidate ending: a single space before it, room for the ending
        self.starts = [k for k in range(1, n - ending_words + 1)
                       if text[self.spans[k - 1][1]:self.spans[k][0]] == " "]

    def slice(self, a: int, b: int) -> str:
        """Text of words a..b-1 (with the whitespace between them)."""
        return self.text[self.spans[a][0]:self.spans[b - 1][1]]


def _by_domain(docs: Mapping[str, Iterable[Any]] | Iterable[Any]) -> dict[str, list[tuple[str, str]]]:
    """``{domain: [(key, text)]}`` sorted, from Documents or ``{domain: [Document | (key, text)
    | text]}``."""
    out: dict[str, list[tuple[str, str]]] = {}
    if isinstance(docs, Mapping):
        for dom, items in docs.items():
            for i, d in enumerate(items):
                pair = ((d.key, d.text) if hasattr(d, "text") else (str(i), d) if isinstance(d, str)
                        else (str(d[0]), d[1]))
                out.setdefault(dom, []).append(pair)
    else:
        for d in docs:
            out.setdefault(d.domain, []).append((d.key, d.text))
    return {dom: sorted(v) for dom, v in sorted(out.items())}


def docs_fingerprint(docs: Mapping[str, Sequence[tuple[str, str]]]) -> str:
    h = hashlib.sha256()
    for dom in sorted(docs):
        for key, text in docs[dom]:
            for part in (dom, key, text):
                b = part.encode("utf-8")
                h.update(len(b).to_bytes(8, "little"))
                h.update(b)
    return h.hexdigest()


def _round_robin(domains: list[str], n: int) -> list[str]:
    return [domains[i % len(domains)] for i in range(n)]


def _pick_position(rng: random.Random, docs: list[_Doc], cands: list[list[int]]) -> tuple[int, int]:
    """A (doc index, word index) uniform over all candidate positions of ``docs``."""
    i = rng.choices(range(len(docs)), weights=[len(c) for c in cands])[0]
    return i, rng.choice(cands[i])


def _sample(rng: random.Random, pools: Mapping[str, tuple[list[_Doc], list[list[int]]]],
            domains: list[str], n: int, make, attempts: int = 50) -> list[dict[str, Any]]:
    """``n`` examples round-robin over ``domains``: each draws up to ``attempts`` unseen
    (document, position) pairs until ``make(dom, docs, i, j)`` returns the example's fields
    (``None``: rejected). Examples get ``id``, ``domain`` and ``doc`` in front."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, int, int]] = set()
    for dom in _round_robin(domains, n if domains else 0):
        ds, cands = pools[dom]
        for _ in range(attempts):
            i, j = _pick_position(rng, ds, cands)
            if (dom, i, j) in seen:
                continue
            fields = make(dom, ds, i, j)
            if fields is not None:
                seen.add((dom, i, j))
                out.append({"id": len(out), "domain": dom, "doc": ds[i].key, **fields})
                break
    return out


def _target(d: _Doc, k: int) -> str | None:
    """The LAMBADA target of word ``k`` (its letters, trailing punctuation dropped), if any."""
    m = _TARGET.fullmatch(d.text, *d.spans[k])
    return m.group(1) if m and m.group(1).lower() not in _STOPWORDS else None


def build_lambada(docs: Mapping[str, Sequence[tuple[str, str]]],
                  cfg: BuiltinTaskConfig) -> list[dict[str, Any]]:
    """LAMBADA-style examples ``{id, domain, doc, context, target}`` (see the module doc)."""
    rng = random.Random(f"{cfg.seed}/{LAMBADA}")
    wanted = cfg.lambada_domains or (("prose",) if "prose" in docs else tuple(docs))
    min_ctx = max(1, cfg.context_words // 2)
    pools: dict[str, tuple[list[_Doc], list[list[int]]]] = {}
    for dom in wanted:
        ds = [_Doc(dom, k, t, 1) for k, t in docs.get(dom, [])]
        cands = [[k for k in d.starts if k >= min_ctx and _target(d, k)] for d in ds]
        if any(cands):
            pools[dom] = (ds, cands)
        else:
            log.warning("%s: domain %r has no usable passage; skipped", LAMBADA, dom)

    def make(dom, ds, i, j):
        d = ds[i]
        target = _target(d, j)
        context = d.slice(max(0, j - cfg.context_words), j)
        if target not in _ALPHA.findall(context):  # the target must occur in the passage
            return None
        return {"context": context, "target": " " + target}

    return _sample(rng, pools, sorted(pools), cfg.num_examples, make, attempts=200)


def _endings_pools(docs: Mapping[str, Sequence[tuple[str, str]]], cfg: BuiltinTaskConfig,
                   task: str) -> dict[str, tuple[list[_Doc], list[list[int]]]]:
    """Per domain: documents with an ending start, and their cut points with enough context."""
    min_ctx = max(1, cfg.context_words // 2)
    pools = {}
    for dom, items in docs.items():
        ds = [d for d in (_Doc(dom, k, t, cfg.ending_words) for k, t in items) if d.starts]
        cuts = [[k for k in d.starts if k >= min_ctx] for d in ds]
        if not any(cuts):
            log.warning("%s: domain %r has no document long enough; skipped", task, dom)
            continue
        pools[dom] = (ds, cuts)
    return pools


def _distractor(rng: random.Random, ds: list[_Doc], exclude_doc: int | None, n_words: int,
                taken: set[str]) -> str | None:
    idx = [i for i in range(len(ds)) if i != exclude_doc]
    if not idx:
        return None
    for _ in range(50):
        i = rng.choices(idx, weights=[len(ds[k].starts) for k in idx])[0]
        k = rng.choice(ds[i].starts)
        ending = ds[i].slice(k, k + n_words)
        if ending not in taken:
            return ending
    return None


def build_hellaswag(docs: Mapping[str, Sequence[tuple[str, str]]],
                    cfg: BuiltinTaskConfig) -> list[dict[str, Any]]:
    """HellaSwag-style examples ``{id, domain, doc, context, endings, label}``."""
    rng = random.Random(f"{cfg.seed}/{HELLASWAG}")
    pools = _endings_pools(docs, cfg, HELLASWAG)
    for dom in [d for d, (ds, _) in pools.items() if len(ds) < 2]:
        log.warning("%s: domain %r has a single held-out document (distractors come from other "
                    "documents of the domain); skipped", HELLASWAG, dom)
        del pools[dom]

    def make(dom, ds, i, j):
        d = ds[i]
        endings = [d.slice(j, j + cfg.ending_words)]
        while len(endings) < cfg.num_choices:
            e = _distractor(rng, ds, i, cfg.ending_words, set(endings))
            if e is None:
                return None
            endings.append(e)
        label = rng.randrange(cfg.num_choices)
        endings[0], endings[label] = endings[label], endings[0]
        return {"context": d.slice(max(0, j - cfg.context_words), j), "endings": endings,
                "label": label}

    return _sample(rng, pools, sorted(pools), cfg.num_examples, make)


def build_domain_choice(docs: Mapping[str, Sequence[tuple[str, str]]],
                        cfg: BuiltinTaskConfig) -> list[dict[str, Any]]:
    """Examples ``{id, domain, doc, context, endings, label, choice_domains}``: which domain's
    span continues the context (one candidate per domain)."""
    rng = random.Random(f"{cfg.seed}/{DOMAIN}")
    pools = _endings_pools(docs, cfg, DOMAIN)
    doms = sorted(pools)
    if len(doms) < 2:
        log.warning("%s needs at least two domains with held-out documents; skipped", DOMAIN)
        return []

    def make(dom, ds, i, j):
        d = ds[i]
        endings, ok = [], True
        order = doms[:]
        rng.shuffle(order)
        for other in order:
            if other == dom:
                endings.append(d.slice(j, j + cfg.ending_words))
            else:
                e = _distractor(rng, pools[other][0], None, cfg.ending_words, set(endings))
                ok = ok and e is not None
                endings.append(e)
        if not ok:
            return None
        return {"context": d.slice(max(0, j - cfg.context_words), j), "endings": endings,
                "label": order.index(dom), "choice_domains": order}

    return _sample(rng, pools, doms, cfg.num_examples, make)


BUILDERS = {LAMBADA: build_lambada, HELLASWAG: build_hellaswag, DOMAIN: build_domain_choice}


def task_yaml(task: str, data_file: Path, hf_cache: Path) -> dict[str, Any]:
    """The lm-eval config of one built-in task reading ``data_file`` (JSON lines)."""
    cfg: dict[str, Any] = {
        "task": task,
        "tag": [TASK_TAG],
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": str(data_file)}, "cache_dir": str(hf_cache)},
        "test_split": "test",
        "doc_to_text": "context",
    }
    if task == LAMBADA:
        cfg.update(output_type="loglikelihood", doc_to_target="target", metric_list=[
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True}])
    else:
        cfg.update(output_type="multiple_choice", doc_to_target="label", doc_to_choice="endings",
                   target_delimiter=" ", metric_list=[
                       {"metric": m, "aggregation": "mean", "higher_is_better": True}
                       for m in ("acc", "acc_norm", "acc_mutual_info")])
    cfg["metadata"] = {"version": float(FORMAT_VERSION)}
    return cfg


def write_builtin_tasks(docs: Mapping[str, Iterable[Any]] | Iterable[Any], out_dir: str | Path,
                        cfg: BuiltinTaskConfig | None = None,
                        tasks: Sequence[str] = BUILTIN_TASKS) -> dict[str, Any]:
    """Build the built-in tasks from held-out ``docs`` into ``out_dir``; returns the manifest.

    ``docs``: :class:`remoe.data.Document` objects, or ``{domain: [Document | (key, text) |
    text]}``. The
    directory is reused when its manifest matches (same documents, config and format). The
    manifest lists ``tasks`` (``{name: {"examples": n, "file": ...}}``); a task with no
    examples (e.g. no domain qualifies) gets no YAML and is listed under ``skipped``.
    """
    cfg = cfg or BuiltinTaskConfig()
    unknown = [t for t in tasks if t not in BUILDERS]
    if unknown:
        raise ValueError(f"unknown built-in task(s) {unknown}; known: {', '.join(BUILDERS)}")
    by_dom = _by_domain(docs)
    out = Path(out_dir).resolve()
    key = hashlib.sha256(json.dumps(
        {"format": FORMAT_VERSION, "config": cfg.to_dict(), "docs": docs_fingerprint(by_dom),
         "tasks": sorted(tasks), "dir": str(out)}, sort_keys=True).encode()).hexdigest()
    old = _read_manifest(out)
    if old is not None and old.get("key") == key and all(
            (out / f"{t}.yaml").is_file() and (out / f"{t}.jsonl").is_file()
            for t in old.get("tasks", {})):
        return old
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    manifest: dict[str, Any] = {"format_version": FORMAT_VERSION, "key": key,
                                "config": cfg.to_dict(), "domains": sorted(by_dom),
                                "docs_per_domain": {d: len(v) for d, v in by_dom.items()},
                                "tasks": {}, "skipped": {}}
    for task in tasks:
        examples = BUILDERS[task](by_dom, cfg)
        for stale in (out / f"{task}.yaml", out / f"{task}.jsonl"):
            stale.unlink(missing_ok=True)
        if not examples:
            manifest["skipped"][task] = "no domain of the held-out split qualifies"
            continue
        data = out / f"{task}.jsonl"
        atomic_write_text(data, "".join(json.dumps(e, ensure_ascii=False) + "\n"
                                        for e in examples))
        atomic_write_text(out / f"{task}.yaml", yaml.safe_dump(
            task_yaml(task, data, out / ".hf_datasets"), sort_keys=False, allow_unicode=True))
        counts: dict[str, int] = {}
        for e in examples:
            counts[e["domain"]] = counts.get(e["domain"], 0) + 1
        manifest["tasks"][task] = {"examples": len(examples), "file": data.name,
                                   "examples_per_domain": counts}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def _read_manifest(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def builtin_tasks_from_bundle(bundle: Any, out_dir: str | Path | None = None,
                              cfg: BuiltinTaskConfig | None = None,
                              tasks: Sequence[str] = BUILTIN_TASKS) -> tuple[Path, dict[str, Any]]:
    """Build the tasks from a :class:`remoe.data.DataBundle`'s held-out split.

    ``out_dir`` defaults to ``<data cache>/eval_tasks/<split>``. Returns ``(dir, manifest)``.
    """
    cfg = cfg or BuiltinTaskConfig()
    out = Path(out_dir) if out_dir is not None else Path(bundle.cache_dir) / "eval_tasks" / cfg.split
    manifest = write_builtin_tasks(bundle.documents(cfg.split), out, cfg, tasks)
    return out.resolve(), manifest
