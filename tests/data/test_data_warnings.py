"""What reading user data says: every oddity counted and located, once per build."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import VOCAB, make_text  # noqa: E402
from test_data_shards import prepare  # noqa: E402


def _odd_jsonl(path: Path) -> Path:
    lines = [json.dumps({"text": make_text(d, i), "meta": {"pile_set_name": d}})
             for i in range(6) for d in VOCAB]
    lines[3] = lines[0]  # an exact duplicate
    lines += ["{not json",  # line 19: malformed
              json.dumps({"text": "", "meta": {"pile_set_name": "alpha"}}),  # 20: empty
              json.dumps({"text": make_text("beta", 90), "meta": "docs"})]  # 21: meta a str
    data = "\n".join(lines).encode() + b"\n"
    data += json.dumps({"text": "caf\u00e9 " * 30}).encode().replace(b"caf\\u00e9", b"caf\xe9")
    path.write_bytes(data + b"\n")  # 22: not UTF-8
    return path


def test_each_oddity_is_counted_and_located_once_per_build(tmp_path, caplog):
    src = _odd_jsonl(tmp_path / "odd.jsonl")
    with caplog.at_level(logging.INFO, logger="remoe.data"):
        prepare(tmp_path, [src], cfg={"val_fraction": 0.2, "test_fraction": 0.2})
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    want = {"odd.jsonl:19: skipping malformed record": 1,
            "skipped 1 malformed of 22 records": 1,
            'dropped 1 of 21 records whose "text" is empty': 1,
            "1 record(s) have a \"meta\" that is not an object (first: line 21, 'docs')": 1,
            "1 of 22 lines were not valid UTF-8, first line 22": 1,
            "dropped 1 exact duplicate documents": 1}
    for text, n in want.items():
        assert sum(text in ln for ln in lines) == n, (text, lines)


def test_arrow_files_point_to_parquet(tmp_path, caplog):
    from remoe.data.errors import DataError
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "data-00000-of-00001.arrow").write_bytes(b"ARROW1")
    (tmp_path / "ds" / "state.json").write_text("{}")
    with pytest.raises(DataError, match=r"\.parquet\).*to_parquet"):
        prepare(tmp_path / "a", [tmp_path / "ds" / "data-00000-of-00001.arrow"])
    with pytest.raises(DataError, match="no documents found"):
        prepare(tmp_path / "b", [tmp_path / "ds"])
    assert "/.parquet files (Hugging Face datasets' save_to_disk .arrow" in caplog.text


def test_a_spec_with_options_in_a_set_override(tmp_path):
    """DATA.md's forms: a spec with ``?`` inside the list of ``--set``, quoted or as written."""
    from remoe.configfile import config_path
    from remoe.experiment import load_config
    (tmp_path / "x.parquet").write_bytes(b"")  # (validated to exist, not read here)
    spec = f"{tmp_path}/x.parquet?text=content&domain=source"
    over = [f"data.sources=['{spec}']"]
    assert load_config(config_path(None, over), over).data.sources == [spec]
    for unquoted in (f"data.sources=[{spec}]", f"data.sources=[{spec}, builtin]"):
        over = [unquoted]  # YAML refuses it; read as the list of what is written
        got = load_config(config_path(None, over), over).data.sources
        assert got == [spec] + (["builtin"] if "builtin" in unquoted else []), got
