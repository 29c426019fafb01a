"""Links, loops, FIFOs, devices and oversized documents in a source.

A ``.txt`` link pointing outside the source tree is followed (a data directory of links into a
shared store is common); a symlink loop, a dangling link and a FIFO inside a directory are
skipped with one counted warning; a source that is itself a FIFO or a device, or a link that
leads nowhere, is a one-line error; a document larger than the whole per-domain budget is said
to be skipped for its size (no more "no documents found" without a word why)."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from remoe.data import prepare_data
from remoe.data.userdata import read_user_source

from .conftest import data_cfg, doc_text, one_line_error, txt_corpus


def test_link_to_a_file_outside_the_source_is_followed(tmp_path):
    src = txt_corpus(tmp_path / "src")
    store = tmp_path / "store"
    store.mkdir()
    (store / "shared.txt").write_text(doc_text(999))
    (src / "alpha" / "linked.txt").symlink_to(store / "shared.txt")
    docs = {d.key: d for d in read_user_source(src)}
    assert "src/alpha/linked.txt" in docs  # keyed by where it sits, not where it leads
    assert docs["src/alpha/linked.txt"].domain == "alpha"
    assert docs["src/alpha/linked.txt"].text.startswith("document 999")


def test_loop_dangling_link_and_fifo_are_skipped_and_counted(tmp_path, caplog):
    src = txt_corpus(tmp_path / "src")
    (src / "alpha" / "loop.txt").symlink_to(src / "alpha" / "loop.txt")
    (src / "alpha" / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    os.mkfifo(src / "beta" / "pipe.txt")
    caplog.set_level(logging.WARNING, logger="remoe.data")
    result = []
    t = threading.Thread(target=lambda: result.append(list(read_user_source(src))), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "reading a FIFO hung"
    assert len(result[0]) == 12
    warned = [r.getMessage() for r in caplog.records if "skipped 3 entries" in r.getMessage()]
    assert len(warned) == 1 and "symlink loop" in warned[0], caplog.text


@pytest.mark.parametrize("kind", ["fifo", "chardev", "loop", "dangling"])
def test_a_source_that_is_not_a_file_or_directory_is_one_line(tmp_path, kind):
    p = tmp_path / "src.txt"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "chardev":
        p = Path("/dev/zero")
    elif kind == "loop":
        p.symlink_to(p)
    else:
        p.symlink_to(tmp_path / "nowhere.txt")
    msg = one_line_error(data_cfg(tmp_path, p))
    assert str(p) in msg
    assert ("neither a regular file nor a directory" in msg if kind in ("fifo", "chardev")
            else "leads nowhere" in msg), msg


def test_a_document_larger_than_the_budget_is_said_skipped_for_size(tmp_path, caplog):
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"text": doc_text(1, 30_000)}) + "\n")
    msg = one_line_error(data_cfg(tmp_path, big, max_bytes_per_domain=50_000))
    assert "larger than data.max_bytes_per_domain=50,000" in msg and "1 document(s)" in msg
    # beside documents that fit: a counted warning
    src = txt_corpus(tmp_path / "src")
    (src / "alpha" / "big.txt").write_text(doc_text(7, 30_000))
    caplog.set_level(logging.WARNING, logger="remoe.data")
    prepare_data(data_cfg(tmp_path, src, max_bytes_per_domain=50_000,
                      cache_dir=str(tmp_path / "c2")), progress=False)
    assert "1 document(s) skipped: each is larger than data.max_bytes_per_domain" in caplog.text
