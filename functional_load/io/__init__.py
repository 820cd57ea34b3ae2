"""5. Reading: the only stage that touches tensor bytes.

:func:`reader_for` is the one reader of every consumer; :func:`execute` runs a plan into
rank-local torch tensors; :class:`ReadOptions` says how bytes are read.
"""

from .execute import LoadStats, execute
from .fill import load_param
from .options import ReadOptions
from .reader import Reader, reader_for, verify_unchanged

__all__ = ["LoadStats", "ReadOptions", "Reader", "execute", "load_param", "reader_for", "verify_unchanged"]
