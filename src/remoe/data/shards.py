"""Tokenising the document stream into shards, in parallel and resumably.

The stream of kept documents (with their planned splits) is cut into *units* of about
``shard_bytes`` bytes of text, in stream order; unit ``n`` becomes the files

* ``shards/uNNNNNN.bin``      -- its tokens, ``uint16``/``uint32``, in *sections*: for each
  (split, domain) in that order, the unit's documents of it in stream order, each + EOS;
* ``shards/uNNNNNN.lens.npy`` -- ``int64`` token count of each of those documents;
* ``shards/uNNNNNN.heldout.jsonl`` -- the held-out (validation/test) documents' text, by section
  (the training text is never copied); a document that came as token ids (Megatron) is
  decoded with the store's tokenizer (``meta.decoded``).

A Megatron train document that ends with EOS is not copied: consecutive ones form an
:class:`InPlace` run, recorded in the unit's journal line (``inplace``: label, domain, copied
documents of its section before it, dataset number, documents ``[first, stop)``, first token
in ``.bin``, tokens) and read from the dataset's ``.bin`` by the store.

A unit depends only on its documents, so ``workers`` processes encode units in parallel
(``tokenizers``' batch encoding, one thread each), at most ``2 * workers`` in flight; one
worker encodes in a thread of this process, also on one thread, while this thread reads on.
So ``workers`` is the number of cores the encoding uses; reading the sources (decompress, parse)
runs beside it and adds a part of one more. Every file
is written to a temporary name and moved into place, then the unit's line (sections, sizes,
sha256 of each file) is appended to ``journal.jsonl``: after a kill, the units of complete
journal lines are skipped (their text is read past, not encoded) and the others are redone
from scratch, so the result is bit-identical to an uninterrupted build. Only journaled units
are trusted: any other unit file is deleted before encoding starts and after a failure, and
the workers die with the build (:func:`die_with_parent`), so none writes after it is gone.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import io
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from remoe.fileio import atomic_open, atomic_write_bytes
from remoe.data.errors import DataError
from remoe.data.leftovers import is_temporary

JOURNAL = "journal.jsonl"
DEFAULT_SHARD_BYTES = 64 << 20
_ENCODE_BATCH_CHARS = 1 << 20


_RUN_BYTES = 64  # what an in-place run counts towards a unit's size


def unit_name(unit_id: int, what: str) -> str:
    return f"u{unit_id:06d}.{what}"


@dataclass
class InPlace:
    """Consecutive train documents ``[first, stop)`` of Megatron dataset ``dataset``: tokens
    ``[start, start + ntok)`` of its ``.bin``, read in place (never copied)."""

    dataset: int
    first: int
    stop: int
    start: int
    ntok: int


def iter_units(docs: Iterable[Any], labels: np.ndarray, dom_index: dict[str, int],
               shard_bytes: int, eos: int | None = None
               ) -> Iterator[tuple[int, list[tuple[int, int, str, Any]]]]:
    """``(unit id, [(split label, domain id, key, text, token ids or InPlace)])`` in stream
    order; with ``eos``, Megatron train documents ending with it become :class:`InPlace` runs."""
    items: list[tuple[int, int, str, Any]] = []
    size = unit = 0
    for i, doc in enumerate(docs):
        label, dom = int(labels[i]), dom_index[doc.domain]
        origin = getattr(doc, "origin", None)
        if (label == 0 and eos is not None and origin is not None and doc.ids.shape[0] and
                int(doc.ids[-1]) == eos):
            n = int(doc.ids.shape[0])
            last = items[-1] if items else None
            run = last[3] if last is not None and last[:2] == (0, dom) else None
            if (isinstance(run, InPlace) and run.dataset == origin[0] and run.stop == origin[1]
                    and run.start + run.ntok == origin[2]):
                run.stop, run.ntok = origin[1] + 1, run.ntok + n
                continue
            items.append((0, dom, doc.key, InPlace(origin[0], origin[1], origin[1] + 1,
                                                   origin[2], n)))
            size += _RUN_BYTES
        else:
            payload = doc.text if doc.text is not None else np.asarray(doc.ids)
            items.append((label, dom, doc.key, payload))
            size += len(payload) if isinstance(payload, str) else 2 * payload.shape[0]
        if size >= shard_bytes:
            yield unit, items
            items, size, unit = [], 0, unit + 1
    if items:
        yield unit, items


def read_journal(directory: Path) -> dict[int, dict[str, Any]]:
    """Units whose journal line is complete and whose files have the recorded sizes."""
    done: dict[int, dict[str, Any]] = {}
    path = directory / JOURNAL
    if not path.is_file():
        return done
    with open(path, "rb") as f:
        for line in f:
            try:
                meta = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if not isinstance(meta, dict) or "unit" not in meta:
                continue
            if all((directory / name).is_file() and (directory / name).stat().st_size ==
                   m["bytes"] for name, m in meta["files"].items()):
                done[int(meta["unit"])] = meta
    return done


@functools.lru_cache(maxsize=1)
def _tokenizer(tokenizer_json: str) -> Any:
    """One ``Tokenizer`` per process, reused by every unit it encodes: building one per unit
    kept ~7-9 MB of each dropped one alive (measured with tokenizers 0.23 on Pile-like text),
    so a build's memory grew with the number of units, i.e. with the corpus."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


def encode_unit(job: dict[str, Any]) -> dict[str, Any]:
    """Tokenise one unit and write its three files; returns its journal entry.

    Documents are encoded in output order, ~1 MB of text per batch, and their tokens streamed
    into the ``.bin`` (hashed as written); each text is dropped from ``job["items"]`` once it
    is written, so memory is the unit's text and one batch, not the unit's tokens.
    """
    tok = _tokenizer(job["tokenizer_json"])
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    dtype = np.dtype(job["dtype"])
    eos = int(job["eos_id"])
    dtype_max = np.iinfo(dtype).max
    max_id = -1  # the largest id written (the store records it: training checks its model)
    items = job["items"]
    order = sorted(range(len(items)), key=lambda i: (items[i][0], items[i][1], i))
    lens: list[int] = []
    sections: list[list[int]] = []
    inplace: list[list[int]] = []
    heldout = io.BytesIO()
    out = Path(job["out_dir"])
    bin_name = unit_name(job["unit"], "bin")
    h = hashlib.sha256()
    with atomic_open(out / bin_name) as binf:
        pos = 0
        while pos < len(order):
            end, chars = pos, 0  # a batch: consecutive texts, ~1 MB
            while (end < len(order) and isinstance(items[order[end]][3], str) and
                   (end == pos or chars < _ENCODE_BATCH_CHARS)):
                chars += len(items[order[end]][3])
                end += 1
            if end > pos:
                encs = encode([items[order[j]][3] for j in range(pos, end)],
                              add_special_tokens=False)
                batch = [(order[j], enc.ids) for j, enc in zip(range(pos, end), encs)]
                del encs
            else:
                batch, end = [(order[pos], None)], pos + 1
            for i, ids in batch:
                label, dom, key, payload = items[i]
                items[i] = None  # its text is no longer needed
                if isinstance(payload, InPlace):
                    copied = (sections[-1][2] if sections and sections[-1][:2] == [label, dom]
                              else 0)
                    inplace.append([label, dom, copied, payload.dataset, payload.first,
                                    payload.stop, payload.start, payload.ntok])
                    continue
                arr = np.asarray(ids if ids is not None else payload, dtype=np.int64)
                if arr.size:
                    hi, lo = int(arr.max()), int(arr.min())
                    if hi > dtype_max or lo < 0:
                        raise DataError(
                            f"document {key}: token id {hi if hi > dtype_max else lo:,} does "
                            f"not fit the store's {dtype} (the tokenizer's vocabulary is "
                            f"{job.get('vocab_size', '?')}): give the tokenizer that made "
                            "the source")
                    max_id = max(max_id, hi)
                if not (arr.size and int(arr[-1]) == eos and ids is None):
                    arr = np.append(arr, eos)  # (a prepared Megatron document may end in EOS)
                data = arr.astype(dtype).tobytes()
                binf.write(data)
                h.update(data)
                lens.append(arr.size)
                if not sections or sections[-1][:2] != [label, dom]:
                    sections.append([label, dom, 0, 0, heldout.tell(), 0])
                sec = sections[-1]
                sec[2] += 1
                sec[3] += int(arr.size)
                if label != 0:  # a held-out document's text (token ids: decoded)
                    meta = {"pile_set_name": job["domains"][dom], "key": key}
                    if not isinstance(payload, str):
                        meta["decoded"] = True
                    rec = {"text": payload if isinstance(payload, str) else
                           tok.decode(arr[:-1].tolist(), skip_special_tokens=False), "meta": meta}
                    heldout.write(json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n")
                    sec[5] = heldout.tell() - sec[4]
            pos = end
        n_bin = binf.tell()
    files = {bin_name: {"sha256": h.hexdigest(), "bytes": n_bin}}
    blobs = {unit_name(job["unit"], "lens.npy"): _npy_bytes(np.asarray(lens, dtype=np.int64)),
             unit_name(job["unit"], "heldout.jsonl"): heldout.getvalue()}
    for name, data in blobs.items():
        atomic_write_bytes(out / name, data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    meta = {"unit": job["unit"], "sections": sections, "files": files,
            "max_id": max(max_id, eos)}
    if inplace:
        meta["inplace"] = inplace
    return meta


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=False)
    return buf.getvalue()


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """End this process as soon as the process ``parent`` ends, even by ``kill -9``: on Linux
    the kernel sends SIGKILL (``PR_SET_PDEATHSIG``); elsewhere a thread watches the parent
    id. A worker that outlived its build would finish its unit and move files into place that
    no journal line describes."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
        if armed:
            if os.getppid() != parent:  # it died before the signal was armed
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="remoe-parent-watch", daemon=True).start()


def _worker_start(parent: int) -> None:
    die_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


def process_pool(workers: int) -> Any:
    """A pool of ``workers`` spawned processes, each encoding on one thread, each ending with
    this process."""
    ctx = multiprocessing.get_context("spawn")
    return ctx.Pool(workers, initializer=_worker_start, initargs=(os.getpid(),))


@contextlib.contextmanager
def _serial_tokenizers() -> Iterator[None]:
    """``tokenizers`` encodes on this thread only while inside (it reads the variable at each
    batch call); the variable is restored after."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _encode_all(units: Iterator[tuple[int, list]], done: dict[int, dict[str, Any]],
                metas: dict[int, dict[str, Any]], on_unit: Callable[[dict[str, Any], bool], None],
                record: Callable[[dict[str, Any]], None], job_base: dict[str, Any],
                submit: Callable[[dict[str, Any]], Callable[[], dict[str, Any]]],
                in_flight: int) -> None:
    """Skip the journal's units, hand the others to ``submit`` (which returns a call that waits
    for the unit's entry) with at most ``in_flight`` pending, and record them in order."""
    pending: list[Callable[[], dict[str, Any]]] = []
    for uid, items in units:
        if uid in done:
            metas[uid] = done[uid]
            on_unit(done[uid], False)
            continue
        pending.append(submit({**job_base, "unit": uid, "items": items}))
        while len(pending) >= in_flight:
            record(pending.pop(0)())
    for wait in pending:
        record(wait())


def build_shards(units: Iterator[tuple[int, list]], out_dir: Path, job_base: dict[str, Any],
                 workers: int, on_unit: Callable[[dict[str, Any], bool], None]) -> list[dict]:
    """Encode every unit not yet in the journal; returns all units' journal entries in order.

    ``on_unit(entry, encoded)`` is called for each unit (progress).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    done = read_journal(out_dir)
    drop_untrusted(out_dir, done)
    metas: dict[int, dict[str, Any]] = {}
    _cut_partial_line(out_dir / JOURNAL)
    journal = open(out_dir / JOURNAL, "ab")

    def record(meta: dict[str, Any]) -> None:
        journal.write(json.dumps(meta, sort_keys=True).encode("utf-8") + b"\n")
        journal.flush()
        os.fsync(journal.fileno())
        metas[int(meta["unit"])] = meta
        on_unit(meta, True)

    try:
        if workers <= 1:  # a thread encodes while this one reads (the GIL is released)
            with _serial_tokenizers(), concurrent.futures.ThreadPoolExecutor(1) as encoder:
                _encode_all(units, done, metas, on_unit, record, job_base,
                            lambda job: encoder.submit(encode_unit, job).result, 2)
        else:
            with process_pool(workers) as pool:
                _encode_all(units, done, metas, on_unit, record, job_base,
                            lambda job: pool.apply_async(encode_unit, (job,)).get, 2 * workers)
    except BaseException:
        # the encoders are gone (a pool is terminated on leaving it): remove what the units
        # in flight wrote or were writing, so a full disk is as it was before they began
        drop_untrusted(out_dir, {**done, **metas})
        raise
    finally:
        journal.close()
    return [metas[u] for u in sorted(metas)]


def _cut_partial_line(path: Path) -> None:
    """Drop a last line that a kill or a full disk cut short, so the next line appended
    starts a line of its own (glued to it, it would be lost too)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "r+b") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def drop_untrusted(out_dir: Path, done: dict[int, dict[str, Any]]) -> None:
    """Remove every unit file that no complete journal line describes (a unit a killed build
    was writing, or one a worker left): only journaled units are ever trusted."""
    keep = {name for meta in done.values() for name in meta["files"]}
    for p in out_dir.iterdir():
        if p.name != JOURNAL and p.is_file() and (is_temporary(p.name) or p.name not in keep):
            p.unlink()
