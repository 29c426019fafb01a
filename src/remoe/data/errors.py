"""Errors of the data pipeline: one line each, naming the source, file or cache at fault.

Both are :class:`remoe.errors.ConfigError` (a ``ValueError``), so the ``remoe`` command prints
them as one line and exits with status 2: the input decides them, not a bug.
"""

from __future__ import annotations

from remoe.errors import ConfigError


class DataError(ConfigError):
    """The data cannot be used as given (corrupt or binary file, empty split, read-only cache)."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A source is missing or no source yielded a single document (also a
    ``FileNotFoundError``, as it used to be)."""
