"""One editable install of this checkout at a time.

``pip install -e`` of this checkout writes ``functional_load.egg-info`` into the checkout itself;
the oracles' environments (:mod:`.parity.env`, :mod:`.jaxstacks.env`) are built side by side in CI,
so their editable installs take this lock (``flock`` on a file beside the checkout's venvs)."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / ".venv-install.lock"


@contextmanager
def checkout_lock() -> Iterator[None]:
    """Held while this checkout is being installed (editable) into an environment."""
    with open(LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
