"""Keys of the sharded store's manifest (:mod:`remoe.data.streambuild`) and the name of its
tokenizer file."""

from __future__ import annotations

import json
from typing import Any

from remoe.data._io import sha256_bytes

TOKENIZER_FILE = "tokenizer.json"


def stage_key(obj: Any) -> str:
    """A build key: the sha256 of the canonical JSON of what the build depends on."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8"))
