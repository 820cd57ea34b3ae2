"""Files the loader reads besides tensor data: strict JSON, and containment in the model directory.

Shared by every stage that opens a file (config, index, manifest, weight files).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeAlias

from .errors import FormatError, LoadError, SecurityError

# Parsed JSON (config.json, indexes, manifests, plans): objects whose values are whatever JSON
# holds. Code that reads a value checks its type where it matters; the aliases name the intent.
JsonObject: TypeAlias = "Mapping[str, Any]"
JsonDict: TypeAlias = "dict[str, Any]"


def strict_json_loads(text: str | bytes, what: str, parse_int: Callable[[str], object] | None = None) -> Any:
    """``json.loads`` that rejects duplicate keys and NaN/Infinity, which plain json silently accepts.

    ``parse_int``: an optional hook for integer literals (as ``json.loads``). Raises
    ``CheckpointError`` naming ``what`` (the file) on any problem.
    """
    if parse_int is None:
        fast = _plain_json(text)
        if fast is not _UNSURE:
            return fast

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        out = dict(items)
        if len(out) != len(items):  # find the first repeated key
            seen: set[str] = set()
            for key, _ in items:
                if key in seen:
                    raise FormatError(f"{what}: duplicate JSON key {key!r}; each key must appear once")
                seen.add(key)
        return out

    def constant(name: str) -> NoReturn:
        raise FormatError(f"{what}: JSON constant {name} is not allowed (strict JSON only)")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_int=parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{what}: invalid JSON ({exc})") from exc
    except RecursionError:
        raise FormatError(f"{what}: JSON nested too deeply to be a checkpoint description") from None
    except LoadError:
        raise
    except ValueError as exc:  # an integer literal past Python's int-conversion digit limit
        raise FormatError(f"{what}: invalid JSON ({exc})") from None


_UNSURE = object()


def _plain_json(text: str | bytes) -> Any:
    """The value of an ordinary JSON text parsed without the strict hooks (a 92,000-entry index
    map in a third of the time), or ``_UNSURE``: then the strict parse decides and names the
    problem. Sound because what the hooks catch is ruled out: NaN/Infinity are absent from the
    text, and with no escapes every ``:`` of the text is a key's or one inside a string verbatim,
    so the text has exactly as many as the parsed value accounts for only when no key repeats."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            return _UNSURE
    if "\\" in text or "NaN" in text or "Infinity" in text:
        return _UNSURE
    try:
        value = json.loads(text)
        return value if _colons(value) == text.count(":") else _UNSURE
    except (ValueError, RecursionError):
        return _UNSURE


def _colons(value: object) -> int:
    """The ``:`` an escape-free JSON text of ``value`` holds: one per key, and those in its strings."""
    if isinstance(value, str):
        return value.count(":")
    if isinstance(value, dict):
        strings = [v for v in value.values() if type(v) is str]
        nested = [v for v in value.values() if type(v) is not str]
        return len(value) + "".join(value).count(":") + "".join(strings).count(":") + sum(map(_colons, nested))
    if isinstance(value, list):
        return sum(map(_colons, value))
    return 0


def allowed_root(directory: Path) -> Path:
    """Where a weight file may really live: the model directory, or, for a Hugging Face cache
    snapshot (``<repo>/snapshots/<revision>``, whose files link to ``<repo>/blobs``), the repo."""
    real = directory.resolve()
    return real.parent.parent if real.parent.name == "snapshots" else real


def check_contained(path: Path, directory: Path, what: str = "Weight file") -> None:
    """A weight file (or the config, index or manifest: ``what``), after following symlinks, must
    stay inside :func:`allowed_root`."""
    root, real = allowed_root(directory), path.resolve()
    if real != root and root not in real.parents:
        raise SecurityError(
            f"{what} {str(path)!r} resolves to {str(real)!r}, outside the model directory {str(root)!r}; "
            "a checkpoint must not read files elsewhere on the machine. Copy the file into the directory"
        )
