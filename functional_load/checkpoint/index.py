"""Safetensors headers -> :class:`TensorInfo`, validated, without reading any tensor data.

Headers are read through the file's storage (:mod:`functional_load.storage`; ``os.pread``
locally), never mmap, never the safetensors library: the first 64 KiB of the file (the 8-byte
length and, for most checkpoints, the whole header: one ranged GET from object storage), then
the rest of a longer header in one more read. Indexing a multi-terabyte checkpoint costs tens of
kilobytes of I/O per shard, and every offset a reader will later read has been checked against
the file size here, once.
"""

from __future__ import annotations

import json
import math
from typing import cast

from ..dtypes import SAFETENSORS_DTYPES, itemsize
from ..errors import CheckpointError, FormatError, IntegrityError, SecurityError
from ..paths import strict_json_loads
from ..storage import FileStamp, Stamp, StoredPath, as_path, storage_for
from . import Checkpoint, FileSpan, TensorInfo, paused_gc, span_info
from .discover import WeightFiles
from .lazy import MAX_NAME_LENGTH, Header, LazyTensors, tiles
from .mistral import MISTRAL_NAMES
from .pickles import index_pickles

MAX_HEADER_BYTES = 100 * 1024 * 1024  # same cap as the safetensors library
HEADER_PROBE_BYTES = 64 * 1024  # the first read of a file: one request from object storage for most headers
MAX_TENSORS = 1_000_000  # a header this large is a denial of service, not a model
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGITS = b"0" * 20  # a run of 20 digits: an integer literal that may not fit in 64 bits
_ITEMSIZE = {code: itemsize(code) for code in SAFETENSORS_DTYPES}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(path: StoredPath, name: str, entry: object, data_start: int, file_size: int, stamp: Stamp) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise FormatError(f"{where}: expected an object with dtype/shape/data_offsets, found {entry!r:.200}")
    unknown = set(entry) - {"dtype", "shape", "data_offsets"}
    if unknown:
        raise FormatError(f"{where}: unknown fields {sorted(unknown)}; a tensor entry has only dtype, shape, data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise FormatError(f"{where}: dtype {dtype!r} is not one of {sorted(SAFETENSORS_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FormatError(f"{where}: shape must be a list of non-negative integers, found {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise FormatError(f"{where}: data_offsets must be [begin, end] integers, found {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise FormatError(f"{where}: data_offsets [{begin}, {end}] must satisfy 0 <= begin <= end")
    expected = math.prod(shape) * itemsize(dtype)
    if end - begin != expected:
        raise FormatError(
            f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes but {dtype} shape {shape} "
            f"needs {expected} bytes"
        )
    if data_start + end > file_size:
        raise IntegrityError(
            f"{where}: data ends at byte {data_start + end} but the file has only {file_size} bytes "
            "(truncated file? re-download it)"
        )
    return TensorInfo(name, dtype, tuple(shape), FileSpan(path, data_start + begin, end - begin, stamp))


def _fast_entry(path: StoredPath, name: str, entry: object, data_start: int, file_size: int, stamp: Stamp) -> TensorInfo | None:
    """The entry of a well-formed header, or None: then :func:`_parse_entry` checks it in full
    (and names the problem). Accepts exactly what ``_parse_entry`` accepts."""
    if type(entry) is not dict or len(entry) != 3:
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    size = _ITEMSIZE.get(dtype) if type(dtype) is str else None
    if size is None or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
        return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end or data_start + end > file_size:
        return None
    for d in shape:
        if type(d) is not int or d < 0:
            return None
    if end - begin != math.prod(shape) * size:
        return None
    return span_info(name, cast(str, dtype), tuple(shape), path, data_start + begin, end - begin, stamp)


def _offset_and_name(info: TensorInfo) -> tuple[int, str]:
    return span_offset(info), info.name


def span_offset(info: TensorInfo) -> int:
    return _span(info).offset


def _span(info: TensorInfo) -> FileSpan:
    """A safetensors tensor's byte range (every tensor a header indexes has one)."""
    if not isinstance(info.location, FileSpan):
        raise TypeError(f"{info.name} is no range of a safetensors file: {info.location!r}")
    return info.location


def _raw_header(path: StoredPath) -> tuple[bytes, str, int, Stamp]:
    """A safetensors file's header bytes and text, where its data starts, and its stamp."""
    storage = storage_for(path)
    stamp = storage.stamp(path)
    file_size = stamp.size
    prefix = storage.read(path, 0, min(file_size, HEADER_PROBE_BYTES))  # the length and, usually, the whole header
    if len(prefix) < 8:
        raise FormatError(f"{path}: expected an 8-byte header length, but the file has {file_size} bytes")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{path}: header length {n} exceeds the cap of {MAX_HEADER_BYTES} bytes")
    if 8 + n > file_size:
        raise FormatError(
            f"{path}: header length {n} needs {8 + n} bytes but the file has {file_size} "
            "(not a safetensors file, or truncated)"
        )
    raw = prefix[8 : 8 + n]
    if len(raw) < n and len(prefix) == HEADER_PROBE_BYTES:  # a longer header: one more read, of the rest
        raw += storage.read(path, HEADER_PROBE_BYTES, 8 + n - HEADER_PROBE_BYTES)
    if len(raw) != n:  # the file shrank while we read it
        raise IntegrityError(f"{path}: expected {n} header bytes, read {len(raw)}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: header is not valid UTF-8 ({exc})") from exc
    return raw, text, 8 + n, stamp


def read_header(path: StoredPath) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, in data-offset order, validated against the file size."""
    path = as_path(path)
    raw, text, data_start, stamp = _raw_header(path)
    return _validated(path, raw, text, data_start, stamp)


def _validated(path: StoredPath, raw: bytes, text: str, data_start: int, stamp: Stamp) -> dict[str, TensorInfo]:
    file_size = stamp.size
    infos = _fast_header(path, raw, text, data_start, file_size, stamp)
    if infos is None:  # anything unusual: the strict parse decides, and names the problem
        infos = _strict_header(path, text, data_start, file_size, stamp)
    infos.sort(key=_offset_and_name)
    if _contiguous(infos, data_start, file_size):
        return {info.name: info for info in infos}
    previous: FileSpan | None = None
    previous_name = ""
    for info in infos:
        span = _span(info)
        if span.nbytes == 0:  # an empty range overlaps nothing
            continue
        if previous is not None and span.offset < previous.offset + previous.nbytes:
            raise FormatError(
                f"{path}: tensor {info.name!r} data [{span.offset - data_start}, "
                f"{span.offset - data_start + span.nbytes}] overlaps tensor {previous_name!r} data "
                f"[{previous.offset - data_start}, {previous.offset - data_start + previous.nbytes}]"
            )
        if (previous is None and span.offset != data_start) or (previous is not None and span.offset != previous.offset + previous.nbytes):
            at = span.offset - data_start
            after = 0 if previous is None else previous.offset - data_start + previous.nbytes
            raise FormatError(
                f"{path}: tensor {info.name!r} data starts at {at}, leaving a hole after byte {after}; safetensors data "
                f"must be contiguous from 0 (a file with gaps can hide other content)"
            )
        previous, previous_name = span, info.name
    end = previous.offset + previous.nbytes if previous is not None else data_start
    if end != file_size:
        raise (IntegrityError if end > file_size else FormatError)(
            f"{path}: tensor data ends at byte {end} but the file has {file_size} bytes; the file is not fully covered "
            f"by its header (appended data or a truncated download)"
        )
    return {info.name: info for info in infos}


def _strict_header(path: StoredPath, text: str, data_start: int, file_size: int, stamp: Stamp) -> list[TensorInfo]:
    header = strict_json_loads(text, f"{path}: header", parse_int=_header_int)
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header must be a JSON object, found {type(header).__name__}")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise FormatError(f"{path}: __metadata__ must be an object of string values, found {metadata!r:.200}")
    if len(header) > MAX_TENSORS:
        raise FormatError(f"{path}: the header declares {len(header)} tensors, more than the cap of {MAX_TENSORS}")
    for name in header:
        _check_name(path, name)
    return [
        _fast_entry(path, name, entry, data_start, file_size, stamp) or _parse_entry(path, name, entry, data_start, file_size, stamp)
        for name, entry in header.items()
    ]


def _fast_json(raw: bytes, text: str) -> tuple[dict[str, object], int] | None:
    """The tensor entries of a well-formed header and the number of ``:`` its keys account for
    (less 3 per entry), parsed without the strict parser's hooks; None when anything is unusual
    (then :func:`_strict_header` decides). What the hooks would catch is ruled out first:
    escapes, NaN/Infinity, ``-0`` and integers of 20 digits or more are absent from the text, and
    duplicate keys are absent when the text has exactly one ``:`` per key the parsed header holds
    (plus those inside its strings, which escape-free strings hold verbatim)."""
    if "\\" in text or "NaN" in text or "Infinity" in text or "-0" in text or _LONG_DIGITS in raw.translate(_DIGITS_TO_ZERO):
        return None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if type(header) is not dict or len(header) > MAX_TENSORS + 1:
        return None
    colons = len(header) + "".join(header).count(":")
    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
            return None
        colons += len(metadata) + "".join(metadata).count(":") + "".join(metadata.values()).count(":")
    if len(header) > MAX_TENSORS:
        return None
    return header, colons


def _fast_header(path: StoredPath, raw: bytes, text: str, data_start: int, file_size: int, stamp: Stamp) -> list[TensorInfo] | None:
    """The tensors of a well-formed header (:func:`_fast_json`), each entry checked as
    :func:`_parse_entry` checks it; None when anything is unusual."""
    parsed = _fast_json(raw, text)
    if parsed is None:
        return None
    header, colons = parsed
    infos = []
    for name, entry in header.items():
        info = _fast_entry(path, name, entry, data_start, file_size, stamp)  # 3 keys, no strings with ":"
        if info is None or not name or len(name) > MAX_NAME_LENGTH or not name.isprintable():
            return None
        infos.append(info)
    return infos if colons + 3 * len(infos) == text.count(":") else None


def lazy_header(path: StoredPath) -> Header | dict[str, TensorInfo]:
    """One file's header for a :class:`~.lazy.LazyTensors`: its entries, checked as a whole
    (:func:`~.lazy.tiles`), or, when the fast checks cannot vouch for it, every tensor read by
    :func:`read_header`'s strict path."""
    path = as_path(path)
    raw, text, data_start, stamp = _raw_header(path)
    parsed = _fast_json(raw, text)
    if parsed is not None:
        header, colons = parsed
        order = tiles(header, stamp.size - data_start) if colons + 3 * len(header) == text.count(":") else None
        if order is not None:
            entries = header if order == list(header) else dict(zip(order, map(header.__getitem__, order)))
            return Header(path, entries, data_start, stamp.size, stamp)
    return _validated(path, raw, text, data_start, stamp)


def _build(header: Header, name: str) -> TensorInfo:
    """A tensor of a lazily indexed file, its entry checked as :func:`read_header` checks it."""
    entry = header.entries[name]
    args = (header.path, name, entry, header.data_start, header.file_size, header.stamp)
    return _fast_entry(*args) or _parse_entry(*args)


def _contiguous(infos: list[TensorInfo], data_start: int, file_size: int) -> bool:
    """Whether the sorted spans tile ``[data_start, file_size)`` exactly (the usual case)."""
    at = data_start
    for info in infos:
        span = _span(info)
        if span.nbytes:
            if span.offset != at:
                return False
            at += span.nbytes
    return at == file_size


def _header_int(literal: str) -> int | float:
    """Integers as the reference parser (serde, u64) reads them: it takes ``-0`` and integers past
    2**64 - 1 as floats, so they become floats here too, which every entry check refuses."""
    value = int(literal)
    return float(literal) if literal.startswith("-0") or value >= 1 << 64 else value


def _check_name(path: StoredPath, name: str) -> None:
    """Tensor names end up in error messages, logs and dict keys: keep them printable and bounded."""
    if not name or len(name) > MAX_NAME_LENGTH or not name.isprintable():
        raise FormatError(
            f"{path}: tensor name {name[:80]!r}{'...' if len(name) > 80 else ''} is empty, longer than "
            f"{MAX_NAME_LENGTH} characters or holds control characters; rename the tensor"
        )


def index_checkpoint(files: WeightFiles, *, allow_pickle: bool = False) -> Checkpoint:
    """All tensors of the discovered files, from headers only; the safetensors index decides
    duplicates. Pickle files are indexed only with ``allow_pickle=True`` (see :mod:`.pickles`)."""
    if files.kind != "safetensors":
        names = ", ".join(p.name for p in files.files[:3])
        if not allow_pickle:
            raise SecurityError(
                f"{files.directory}: the weights are pickle files ({names}), which can run code when unpickled; "
                f"convert them to safetensors (transformers save_pretrained(..., safe_serialization=True)), or pass "
                f"allow_pickle=True (CLI: --allow-pickle) to load them with torch.load(weights_only=True)"
            )
        return Checkpoint(files.directory, files.load_format, files.files, index_pickles(files.files), None)
    with paused_gc():
        return _index_safetensors(files)


def _index_safetensors(files: WeightFiles) -> Checkpoint:
    """The tensors of every file, indexed lazily (:mod:`.lazy`); the index decides duplicates."""
    headers = {path.name: lazy_header(path) for path in files.files}
    where: dict[str, Header] = {}
    built: dict[str, TensorInfo] = {}
    listed = files.weight_map.get if files.weight_map is not None else None
    for path in files.files:
        header = headers[path.name]
        names = header.entries if isinstance(header, Header) else header
        if listed is not None:
            shard = path.name
            listed_in = list(map(listed, names))
            keep = list(names) if listed_in.count(shard) == len(listed_in) else [n for n, s in zip(names, listed_in) if s == shard]
        else:
            keep = list(names)
            for name in keep:
                if name in where:
                    raise CheckpointError(
                        f"Tensor {name!r} appears in both {str(where[name].path)!r} and {str(path)!r} "
                        "and there is no index file to choose; remove the duplicate file or add an index."
                    )
        if isinstance(header, Header):
            where.update(dict.fromkeys(keep, header))
        else:  # read in full: its infos are built already
            stub = Header(path, {}, 0, 0, FileStamp(0, 0, 0, 0))
            where.update(dict.fromkeys(keep, stub))
            built.update({name: header[name] for name in keep})
    if files.weight_map is not None and len(where) != len(files.weight_map):  # a listed tensor is not in its shard
        for name, shard in files.weight_map.items():
            header = headers[shard]
            if name not in (header.entries if isinstance(header, Header) else header):
                raise CheckpointError(
                    f"Tensor {name!r} is listed in index {str(files.index_file)!r} under shard {shard!r}, "
                    f"but {shard!r} has no such tensor. Fix the index or re-download the shard."
                )
    renames = (MISTRAL_NAMES,) if files.load_format == "mistral" else ()
    tensors = LazyTensors(where, _build, built)
    return Checkpoint(files.directory, files.load_format, files.files, tensors, files.index_file, renames=renames)
