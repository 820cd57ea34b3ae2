"""Files the loader reads besides tensor data: strict JSON, and containment in the model directory.

Shared by every stage that opens a file (config, index, manifest, weight files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import FormatError, LoadError, SecurityError


def strict_json_loads(text: str | bytes, what: str, parse_int: Any = None) -> Any:
    """``json.loads`` that rejects duplicate keys and NaN/Infinity, which plain json silently accepts.

    ``parse_int``: an optional hook for integer literals (as ``json.loads``). Raises
    ``CheckpointError`` naming ``what`` (the file) on any problem.
    """

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) != len(items):  # find the first repeated key
            seen: set[str] = set()
            for key, _ in items:
                if key in seen:
                    raise FormatError(f"{what}: duplicate JSON key {key!r}; each key must appear once")
                seen.add(key)
        return out

    def constant(name: str) -> Any:
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
