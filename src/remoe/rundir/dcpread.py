"""Reading sharded (DCP) checkpoints without running code from their files.

``torch.distributed.checkpoint`` reads ``dcp/.metadata`` with plain :mod:`pickle` and the
non-tensor values of a state dict (optimizer hyper-parameters) with torch's full unpickler
(``weights_only`` off): a crafted file runs code while it loads, and ``checksums.json`` is no
defence (whoever can write the file can recompute the manifest). Every DCP read in remoe goes
through this module instead:

* :func:`load_metadata` unpickles ``.metadata`` with an allow-list: the DCP metadata classes,
  ``torch.Size``, torch dtypes, layouts and memory-format codes, ``pathlib`` paths and plain
  containers. Anything else (``os.system``, ``builtins.eval``, a module's function) is refused
  before it is looked up; only allow-listed callables are ever called, and only instances of
  allow-listed classes (never a class itself) are ever given state.
* :class:`SafeReader` is a ``FileSystemReader`` whose ``read_metadata`` uses it and which
  refuses shard paths outside the checkpoint's ``dcp/`` directory.
* :class:`SafePlanner` is the default load planner with ``torch.load(..., weights_only=True)``
  for the non-tensor values (tensors are already read that way by torch).

A file that fails any of these checks raises :class:`UnsafeCheckpointError` (one line, naming
the file). :func:`load_model_weights` reads the model part of a sharded checkpoint into a plain
model in one process (``remoe eval``/``analyze`` on a checkpoint of a ``train.fsdp`` run).

A neutral low module (standard library, torch and :mod:`remoe.errors`).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from remoe.errors import ConfigError

DCP_DIR = "dcp"
METADATA = ".metadata"


class UnsafeCheckpointError(ConfigError):
    """A DCP file holds something other than checkpoint data (refused before it runs)."""


_DCP_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                         "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "_MEM_FORMAT_ENCODING")


def _allowed() -> dict[tuple[str, str], Any]:
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", n): getattr(md, n)
        for n in _DCP_METADATA_CLASSES if hasattr(md, n)}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    # torch pickles a layout as _get_layout("torch.strided"): a lookup among torch's layouts
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name, v in vars(torch).items():
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = v
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    return allowed


class _AllowListUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be checked
    """Unpickles only the objects :func:`_allowed` names (see the module doc)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where
        self.allowed = _allowed()
        self.classes = tuple(v for v in self.allowed.values() if isinstance(v, type))

    def refuse(self, what: str):
        raise UnsafeCheckpointError(
            f"{self.where} holds {what}, which is not checkpoint data; refusing to load it "
            "(a crafted or foreign file; nothing from it was run)")

    def find_class(self, module: str, name: str) -> Any:
        obj = self.allowed.get((module, name))
        if obj is None:
            self.refuse(f"a reference to {module}.{name}"[:160])
        return obj

    def persistent_load(self, pid: Any) -> Any:
        self.refuse("a persistent reference")

    def _callable(self, func: Any, opcode: str) -> None:
        if not (isinstance(func, type) and func in self.classes) and not (
                func is torch.serialization._get_layout):
            self.refuse(f"a call of {type(func).__name__} ({opcode})")

    def load_reduce(self) -> None:
        args = self.stack[-1]
        func = self.stack[-2]
        self._callable(func, "REDUCE")
        if not isinstance(args, tuple):
            self.refuse("a call with non-tuple arguments")
        super().load_reduce()

    def load_newobj(self) -> None:
        self._callable(self.stack[-2], "NEWOBJ")
        super().load_newobj()

    def load_newobj_ex(self) -> None:
        self._callable(self.stack[-3], "NEWOBJ_EX")
        super().load_newobj_ex()

    def load_build(self) -> None:
        inst = self.stack[-2]
        # state only for instances of allow-listed classes (never a class, a module, a function)
        if isinstance(inst, type) or not isinstance(inst, self.classes):
            self.refuse(f"state for a {type(inst).__name__}")
        super().load_build()

    def load_inst(self) -> None:
        self.refuse("an INST opcode")

    def load_obj(self) -> None:
        self.refuse("an OBJ opcode")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.INST[0]] = load_inst
    dispatch[pickle.OBJ[0]] = load_obj


def load_metadata(path: str | os.PathLike):
    """The ``Metadata`` of a DCP ``.metadata`` file, read with the allow-list unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    where = str(path)
    try:
        with open(path, "rb") as f:
            md = _AllowListUnpickler(f, where).load()
    except UnsafeCheckpointError:
        raise
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, KeyError,
            AttributeError, IndexError, RecursionError) as e:
        raise UnsafeCheckpointError(f"{where} is not a readable DCP metadata file "
                                    f"({type(e).__name__})") from None
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None),
                                                      dict):
        raise UnsafeCheckpointError(f"{where} does not hold DCP metadata")
    return md


def _reader_base():
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader


def check_metadata(md, dcp_dir: str | os.PathLike) -> None:
    """Refuse metadata whose shard entries are not plain storage records of files inside
    ``dcp_dir`` (a path like ``../../x`` would read any file into a tensor)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    root = Path(dcp_dir).resolve()
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{Path(dcp_dir) / METADATA} has no shard index")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(rel, str) \
                or not (root / rel).resolve().is_relative_to(root):
            raise UnsafeCheckpointError(f"{Path(dcp_dir) / METADATA} names a shard file "
                                        f"outside its directory ({str(rel)[:80]!r})")


class SafeReader(_reader_base()):
    """A ``FileSystemReader`` that reads ``.metadata`` with :func:`load_metadata` (once: it is
    checked by :func:`check_metadata` before torch sees it) and never with plain pickle."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(str(path))
        self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        if kwargs.get("rank") is not None and self._metadata is None:
            raise FileNotFoundError("remoe writes no rank-local DCP metadata")
        if self._metadata is None:
            md = load_metadata(Path(self.path) / METADATA)
            check_metadata(md, self.path)
            self._metadata = md
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _planner_base():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    return DefaultLoadPlanner


class SafePlanner(_planner_base()):
    """The default load planner, reading non-tensor values with ``weights_only=True``."""

    def __init__(self, where: str = "dcp") -> None:
        super().__init__()
        self.where = where
        self.refused: UnsafeCheckpointError | None = None

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - UnpicklingError and what a crafted file raises
            self.refused = UnsafeCheckpointError(
                f"{self.where}: a shard holds a value for {read_item.dest_index.fqn!r} that is "
                f"not plain data ({type(e).__name__}); refusing to load it (nothing from it "
                "was run)")
            raise self.refused from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(state_dict: dict[str, Any], dcp_dir: str | os.PathLike) -> None:
    """``torch.distributed.checkpoint.load`` of ``dcp_dir`` into ``state_dict`` (collective
    under torch.distributed) through :class:`SafeReader` and :class:`SafePlanner`."""
    import torch.distributed.checkpoint as dcp

    reader, planner = SafeReader(dcp_dir), SafePlanner(str(dcp_dir))
    reader.read_metadata()  # here, so a refusal is raised as itself (torch wraps its errors)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, storage_reader=reader, planner=planner)
    except BaseException:  # torch's CheckpointException is a BaseException
        if planner.refused is not None:
            raise planner.refused from None
        raise


def is_sharded(ckpt: str | os.PathLike) -> bool:
    return (Path(ckpt) / DCP_DIR).is_dir()


def load_model_weights(model, ckpt: str | os.PathLike) -> None:
    """Fill a plain (one-process) ``model`` with the weights of the sharded checkpoint ``ckpt``
    (its ``dcp/``; the optimizer state is not read)."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         set_model_state_dict)

    sd = {"model": get_model_state_dict(model)}
    load(sd, Path(ckpt) / DCP_DIR)
    set_model_state_dict(model, sd["model"])
