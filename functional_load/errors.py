"""Errors raised for bad input. Every one is a :class:`LoadError`.

Messages name the file and tensor, what was expected and what was found, and the fix.
``LoadError`` subclasses ``ValueError`` so callers that already catch ``ValueError`` keep working.
"""

from __future__ import annotations

from collections.abc import Iterable


class LoadError(ValueError):
    """Base class of every error raised for a bad checkpoint, config, parallel setting or layout."""


class CheckpointError(LoadError):
    """The checkpoint files themselves: missing, unreadable, malformed headers, truncated data."""


class MissingFileError(CheckpointError, FileNotFoundError):
    """A weight file that must exist does not (also a ``FileNotFoundError``)."""


class FormatError(CheckpointError):
    """A file is not what its format says: malformed header, JSON, index or pickle archive."""


class IntegrityError(CheckpointError):
    """A file does not match what was recorded: truncated, changed during the load, wrong size or hash."""


class SecurityError(CheckpointError):
    """The input would make the loader run code or read outside the model directory: pickles without
    ``allow_pickle=True``, paths that escape, special files."""


class ConfigError(LoadError):
    """``config.json`` or an architecture spec is missing, malformed or unsupported."""


class ShardingError(LoadError):
    """A size does not divide over the requested tensor-parallel size, or a shard id is invalid."""


class PlanError(LoadError):
    """Validation of a load plan found problems; all of them are listed, one per line."""

    def __init__(self, problems: Iterable[str]):
        self.problems = tuple(problems)
        count = len(self.problems)
        head = f"{count} problem{'s' if count != 1 else ''} found while planning the load:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))
