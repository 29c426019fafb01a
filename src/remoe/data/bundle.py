"""``DataBundle``: the prepared data of a cache (tokenizer, domains, token stores, documents)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tokenizers import Tokenizer

from remoe.data import tokenizer as _tok
from remoe.data.config import DEFAULT_CACHE_DIR
from remoe.data.corpus import iter_documents
from remoe.data.documents import SPLITS, Document
from remoe.data.errors import DataError, DataNotFoundError
from remoe.data.sampler import TrainBatches, eval_batches
from remoe.data.shardstore import ShardedStore
from remoe.data.shardstore import Batch

log = logging.getLogger("remoe.data")


@dataclass
class DataBundle:
    """The prepared data: tokenizer, domains, token stores and documents of each split."""

    cache_dir: Path
    tokenizer: Tokenizer = field(repr=False)
    tokenizer_path: Path
    vocab_size: int
    eos_id: int
    eos_token: str
    domains: list[str]
    manifest: dict[str, Any] = field(repr=False)
    store_root: Path  # the sharded store's directory (remoe.data.streambuild)
    seed: int = 0
    _stores: dict[str, Any] = field(default_factory=dict, repr=False)

    def split(self, name: str) -> ShardedStore:
        """The token store of ``train``, ``validation`` or ``test``."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {', '.join(SPLITS)}")
        if name not in self._stores:
            m = self.manifest
            self._stores[name] = ShardedStore(self.store_root, name, self.domains,
                                              m["tokens"]["splits"][name], m["shards"], m["dtype"],
                                              m.get("external"))
        return self._stores[name]

    def train_batches(self, seq_len: int, micro_batch: int, grad_accum: int = 1,
                      world_size: int = 1, seed: int | None = None, *,
                      require_validation: bool = True) -> TrainBatches:
        """A :class:`TrainBatches` sampler over the train split (``seed`` defaults to the
        config's).

        Training evaluates on the validation split, so by default this also checks that
        validation has at least one chunk of ``seq_len + 1`` tokens (:meth:`check_eval_split`):
        a run that cannot measure its validation loss fails here, before any model work,
        instead of writing a NaN ``val_loss`` at its end.
        """
        sampler = TrainBatches(self.split("train"), seq_len, micro_batch, grad_accum, world_size,
                               self.seed if seed is None else seed)
        if require_validation:
            self.check_eval_split("validation", seq_len)
        return sampler

    def check_eval_split(self, split: str, seq_len: int) -> None:
        """Raise :class:`DataError` if ``split`` has no chunk of ``seq_len + 1`` tokens; warn
        (with counts) about domains that have none and so are not evaluated."""
        store = self.split(split)
        table = store.chunks(seq_len)
        if len(table) == 0:
            raise DataError(
                f"the {split} split has no chunk of {seq_len + 1} tokens ({store.num_docs} "
                f"documents, {store.num_tokens} tokens, per domain "
                f"{store.tokens_per_domain() or '{}'}), so no {split} loss can be measured: use "
                f"a shorter train.seq_len, more or longer documents, or a larger "
                f"data.val_fraction")
        present = set(table.domain_ids.tolist())
        missing = [d for i, d in enumerate(store.domains) if i not in present]
        if missing:
            log.warning("the %s split has no chunk of %d tokens in %d of %d domains (%s): "
                        "they are not evaluated", split, seq_len + 1, len(missing),
                        len(store.domains), ", ".join(missing))

    @property
    def max_token_id(self) -> int:
        """The largest token id in the store: recorded when it was built; for a store of an
        earlier version, the tokenizer's largest or, above it, the in-place datasets' (read)."""
        recorded = self.manifest["tokens"].get("max_id")
        if recorded is not None:
            return int(recorded)
        import numpy as np

        hi = self.vocab_size - 1
        for e in self.manifest.get("external", {}).values():
            ids = np.memmap(e["path"], dtype=np.dtype(e["dtype"]), mode="r")
            hi = max(hi, int(ids.max())) if ids.size else hi
        return hi

    def check_vocabulary(self, vocab_size: int, what: str) -> None:
        """Refuse (one line) a store holding a token id outside ``[0, vocab_size)`` of
        ``what`` (e.g. ``"model.vocab_size"``): an embedding lookup would fail mid-run."""
        hi = self.max_token_id
        if hi >= vocab_size:
            raise DataError(f"data cache {self.cache_dir}: its tokens go up to id {hi:,}, beyond "
                            f"{what} ({vocab_size:,} ids): rebuild it with the tokenizer that "
                            "made its sources (remoe data --tokenizer PATH)")

    def eval_batches(self, split: str, seq_len: int, batch_size: int,
                     max_chunks_per_domain: int | None = None) -> Iterator[Batch]:
        """Deterministic batches of ``split`` with every domain represented."""
        return eval_batches(self.split(split), seq_len, batch_size, max_chunks_per_domain)

    def documents(self, split: str, domain: str | None = None) -> list[Document]:
        """The raw documents of ``split`` (optionally one domain), in store order."""
        return store_documents(self.store_root, split, domain)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def hf_tokenizer(self):
        """A ``transformers.PreTrainedTokenizerFast`` for this tokenizer."""
        return _tok.load_hf_tokenizer(self.tokenizer_path)

    def summary(self) -> str:
        """Documents and tokens per domain per split, as a small table."""
        splits = self.manifest["tokens"]["splits"]
        corpus = self.manifest["corpus"]["splits"]
        w = max([len(d) for d in self.domains] + [len("domain"), len("total")])
        head = f"{'domain':<{w}}  {'bytes':>11}" + "".join(
            f"  {s + ' docs':>15} {s + ' tokens':>17}" for s in SPLITS)
        lines = [
            f"data cache {self.cache_dir}: {len(self.domains)} domains, tokenizer "
            f"{self.tokenizer_path.name} (vocab {self.vocab_size}, eos {self.eos_token!r}="
            f"{self.eos_id}, {self.manifest['tokenizer']['source']})",
            head,
            "-" * len(head),
        ]
        tot_bytes = 0
        tot = {s: [0, 0] for s in SPLITS}
        for dom in self.domains + ["total"]:
            if dom == "total":
                lines.append("-" * len(head))
                nbytes = tot_bytes
                cells = [tuple(tot[s]) for s in SPLITS]
            else:
                nbytes = sum(corpus[s].get(dom, {}).get("bytes", 0) for s in SPLITS)
                tot_bytes += nbytes
                cells = []
                for s in SPLITS:
                    nd = splits[s]["docs_per_domain"].get(dom, 0)
                    nt = splits[s]["tokens_per_domain"].get(dom, 0)
                    tot[s][0] += nd
                    tot[s][1] += nt
                    cells.append((nd, nt))
            lines.append(f"{dom:<{w}}  {nbytes:>11,}" + "".join(
                f"  {nd:>15,} {nt:>17,}" for nd, nt in cells))
        return "\n".join(lines)


def store_documents(root: Path, split: str, domain: str | None = None) -> list[Document]:
    """The raw documents of ``split`` of a sharded store: held-out ones from their copy, train
    ones read again from the sources (their text is not copied), in store order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if split != "train":
        return list(iter_documents(root / "heldout" / f"{split}.jsonl", domain))
    from remoe.data.streambuild import train_documents

    return train_documents(root, domain)


def load_documents(split: str, domain: str | None = None, *,
                   cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR) -> list[Document]:
    """The raw documents of ``split`` from a prepared cache (optionally only ``domain``)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    from remoe.fileio import read_json
    from remoe.data.streambuild import STORE_DIR

    store = Path(cache_dir) / STORE_DIR
    m = read_json(store / "manifest.json")
    if not (isinstance(m, dict) and isinstance(m.get("dir"), str)):
        raise DataNotFoundError(f"no finished sharded store in {store} (run `remoe data` first)")
    return store_documents(store / m["dir"], split, domain)
