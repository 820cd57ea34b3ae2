"""Checkpoints in S3 (or any S3-compatible store): ``s3://bucket/prefix`` as a model directory.

:class:`S3Storage` serves :class:`S3Path` s through obstore (Rust's ``object_store``), chosen by
measurement for many concurrent ranged GETs (docs/object-storage.md). The endpoint, region and
credentials are the standard AWS configuration (:mod:`.s3_config`); requests are path-style.

* A file's identity (:class:`~.base.ObjectStamp`) is its size and ETag (one ``HEAD``); every
  read of tensor data names it in ``If-Match``, so an object replaced during a load is an
  :class:`~functional_load.errors.IntegrityError` naming it, never bytes of two versions.
* Each request is tried up to ``max_attempts`` times when it fails for a reason that may pass
  (throttling, a 5xx, a reset or refused connection, a timeout, a body shorter than its range);
  a short or failed body is never used. Other failures (a missing bucket or object, denied
  credentials, a bad region) fail at once. Every failure is a
  :class:`~functional_load.errors.LoadError` naming the ``s3://`` URI and the fix.
* Requests, retries, bytes fetched and bytes written are counted (:meth:`S3Storage.counts`).
* Writes (a save's): a whole object by one PUT or a multipart upload, and deletes
  (:meth:`S3Storage.write_file`, :meth:`S3Storage.delete`), with the same retries and errors.
"""

from __future__ import annotations

import fnmatch
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..errors import ConfigError, IntegrityError, LoadError, MissingFileError, SecurityError
from .base import Kind, ObjectPath, ObjectStamp, Stamp, StorageError, StoredPath
from .s3_config import S3Config

if TYPE_CHECKING:
    from obstore import Bytes, GetOptions, GetResult
    from obstore.store import S3Store

T = TypeVar("T")
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "RequestTimeTooSkewed"}


class S3Path(ObjectPath):
    """``s3://bucket/key``."""

    scheme = "s3"

    @property
    def bucket(self) -> str:
        return self.parts[1] if len(self.parts) > 1 else ""

    @property
    def object_key(self) -> str:
        """The key within the bucket (``""`` for the bucket itself)."""
        return "/".join(self.parts[2:])


@dataclass(frozen=True, slots=True)
class Failure:
    """What a failed request says: its HTTP status and S3 error code where it has them."""

    status: int | None
    code: str | None
    detail: str
    permanent: bool = False  # refused before any request (a key the client cannot send, a bad setting)

    @property
    def transient(self) -> bool:
        """Whether trying again may succeed: throttling, a server error, or no answer at all
        (a connection refused or reset, a timeout, a body cut short)."""
        if self.permanent:
            return False
        if self.code in _TRANSIENT_CODES:
            return True
        return self.status is None or self.status >= 500 or self.status in (408, 429)


class _ShortBodyError(Exception):
    """A response body shorter than its range: never used, the request is tried again."""


def _whole(uri: str, result: GetResult | None, offset: int, n: int, stamp: Stamp | None) -> Bytes:
    """The body of a ranged GET of ``n`` bytes from ``offset``, checked: of the version ``stamp``
    names (when given) and of the right length (a short one is tried again)."""
    meta = result.meta if result is not None else None
    size = meta["size"] if meta is not None else stamp.size if stamp is not None else None
    if result is None or meta is None or meta["size"] < offset + n:
        raise IntegrityError(f"{uri}: ends at byte {size}, before byte {offset + n} that a read needs; it was truncated or replaced")
    if isinstance(stamp, ObjectStamp):
        now = ObjectStamp(meta["size"], meta["e_tag"] or "")
        if now.size != stamp.size or (stamp.version and now.version and now.version != stamp.version):
            raise IntegrityError(f"{uri}: replaced since it was indexed ({now.change(stamp)}); re-plan the load once it is stable")
    body = result.bytes()
    if len(body) != n:
        raise _ShortBodyError(f"a short body: {len(body)} of {n} bytes")
    return body


def classify(exc: BaseException) -> Failure:
    """A client library's exception as a :class:`Failure` (its type where it tells, else its message)."""
    from obstore import exceptions as errors

    text = str(exc)
    detail = text.splitlines()[0].removeprefix("Generic S3 error: ")[:300] if text else type(exc).__name__
    found = _CODE.search(text)
    code = found.group(1) if found else None
    if isinstance(exc, _ShortBodyError):
        return Failure(None, None, detail)
    if isinstance(exc, (errors.InvalidPathError, errors.UnknownConfigurationKeyError, errors.NotSupportedError)):
        return Failure(None, code, detail, permanent=True)
    known = {FileNotFoundError: 404, errors.PreconditionError: 412, errors.PermissionDeniedError: 403, errors.UnauthenticatedError: 401}
    for kind, status in known.items():
        if isinstance(exc, kind):
            return Failure(status, code, detail)
    match = _STATUS.search(text)
    return Failure(int(match.group(1)) if match else None, code, detail)


class S3Storage:
    """S3 objects as checkpoint files (see :class:`~.base.Storage`); thread-safe."""

    def __init__(self, config: S3Config | None = None) -> None:
        self.config = config or S3Config.from_environment()
        try:
            import obstore
        except ImportError:
            raise ConfigError("s3:// paths need obstore: pip install 'functional_load[s3]'") from None
        self._obstore = obstore
        self._failures = (obstore.exceptions.BaseError, OSError, _ShortBodyError)  # what a request can raise
        self._stores: dict[str, S3Store] = {}
        self._lock = threading.Lock()
        self.requests = self.retries = self.bytes_fetched = self.bytes_sent = 0

    # -- the Storage protocol

    def kind(self, path: StoredPath) -> Kind:
        uri, store, key = self._locate(path)
        if key:
            try:
                self._call(uri, "HEAD", lambda: self._obstore.head(store, key))
                return "file"
            except MissingFileError:
                pass
        first = self._call(uri, "LIST", lambda: next(iter(self._obstore.list(store, key.rstrip("/") or None, chunk_size=1)), None))
        return "directory" if first else "missing"

    def list_files(self, directory: StoredPath, pattern: str) -> list[StoredPath]:
        uri, store, key = self._locate(directory)
        listing = self._call(uri, "LIST", lambda: self._obstore.list_with_delimiter(store, key.rstrip("/") or None))
        names = sorted(meta["path"].rsplit("/", 1)[-1] for meta in listing["objects"])
        hidden = pattern.startswith(".")
        return [directory / n for n in names if n and (hidden or not n.startswith(".")) and fnmatch.fnmatchcase(n, pattern)]

    def contained(self, path: StoredPath, directory: StoredPath, what: str) -> None:
        """An object cannot lead elsewhere (no links); only a key outside the prefix could."""
        inside = isinstance(path, S3Path) and isinstance(directory, S3Path) and directory in path.parents
        if not inside or ".." in path.parts:
            raise SecurityError(f"{what} {str(path)!r} is outside the model directory {str(directory)!r}; only files under it are read")

    def stamp(self, file: StoredPath) -> Stamp:
        uri, store, key = self._locate(file)
        meta = self._call(uri, "HEAD", lambda: self._obstore.head(store, key))
        return ObjectStamp(meta["size"], meta["e_tag"] or "")

    def read(self, file: StoredPath, offset: int, size: int) -> bytes:
        if size <= 0:
            return b""
        uri, store, key = self._locate(file)

        def attempt() -> bytes:
            result = self._get(store, key, offset, offset + size, None)
            if result is None:  # the range starts at or past the end
                return b""
            body = bytes(result.bytes())
            if len(body) != min(size, result.meta["size"] - offset):
                raise _ShortBodyError(f"a short body: {len(body)} of {min(size, result.meta['size'] - offset)} bytes")
            return body

        body = self._call(uri, "GET", attempt)
        self._add(len(body))
        return body

    def read_into(self, file: StoredPath, offset: int, out: memoryview, stamp: Stamp | None) -> int:
        """One ranged GET (``If-Match`` the stamp's ETag) into ``out``: the body lands in one
        buffer of the range's size, copied into ``out`` once it is whole and of the right length."""
        n = out.nbytes
        if n == 0:
            return 0
        uri, store, key = self._locate(file)
        target = out if out.format == "B" and out.ndim == 1 else out.cast("B")
        version = stamp.version if isinstance(stamp, ObjectStamp) and stamp.version else None

        def attempt() -> None:
            body = _whole(uri, self._get(store, key, offset, offset + n, version), offset, n, stamp)
            target[:] = memoryview(body)

        self._call(uri, "GET", attempt)
        self._add(n)
        return n

    def write_file(self, file: StoredPath, data: bytes | Path) -> Stamp:
        """One PUT, or a multipart upload (parts of ``upload_part_bytes``, ``upload_concurrency`` in
        flight) when ``data`` is larger than a part; the object appears whole when it completes. A
        transient failure sends the whole upload again (a local file is read again from its start)."""
        uri, store, key = self._locate(file)
        size = data.stat().st_size if isinstance(data, Path) else len(data)
        config = self.config
        result = self._call(uri, "PUT", lambda: self._obstore.put(
            store, key, data, chunk_size=config.upload_part_bytes, max_concurrency=config.upload_concurrency))
        with self._lock:
            self.bytes_sent += size
        return ObjectStamp(size, result["e_tag"] or "")

    def delete(self, file: StoredPath) -> None:
        uri, store, key = self._locate(file)
        self._call(uri, "DELETE", lambda: self._obstore.delete(store, key))

    # -- requests

    def counts(self) -> dict[str, int]:
        """Requests sent (retries included), retries, body bytes used and bytes written (``sent``:
        each file once, whatever its retries), since this storage opened."""
        with self._lock:
            return {"requests": self.requests, "retries": self.retries, "bytes": self.bytes_fetched, "sent": self.bytes_sent}

    def _add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_fetched += nbytes

    def _get(self, store: S3Store, key: str, start: int, stop: int, version: str | None) -> GetResult | None:
        """A ranged GET; None when the range starts at or past the object's end (416)."""
        options: GetOptions = {"range": (start, stop)}
        if version:
            options["if_match"] = version
        try:
            return self._obstore.get(store, key, options=options)
        except self._failures as exc:
            if classify(exc).status == 416:
                return None
            raise

    def _call(self, uri: str, what: str, request: Callable[[], T]) -> T:
        """``request()``, tried again after a transient failure (at most ``max_attempts`` tries,
        exponential backoff with full jitter); any failure becomes a :class:`LoadError`."""
        config = self.config
        for attempt in range(1, config.max_attempts + 1):
            with self._lock:
                self.requests += 1
            try:
                return request()
            except LoadError:  # ours (an IntegrityError), some of which are OSErrors too
                raise
            except self._failures as exc:  # the client library's own exceptions: none escapes
                failure = classify(exc)
                if not failure.transient or attempt == config.max_attempts:
                    raise self._error(uri, what, failure, attempt) from None
            with self._lock:
                self.retries += 1
            time.sleep(random.uniform(0, min(config.backoff_cap_seconds, config.backoff_seconds * 2 ** (attempt - 1))))
        raise AssertionError("unreachable")

    def _error(self, uri: str, what: str, failure: Failure, attempts: int) -> LoadError:
        """The :class:`LoadError` for a failed request: what happened, where, and the fix."""
        endpoint = self.config.endpoint_url
        said = f"HTTP {failure.status}" + (f" {failure.code}" if failure.code else "") if failure.status else failure.detail
        bucket = uri.removeprefix("s3://").split("/", 1)[0]
        writing = what in ("PUT", "DELETE")
        if failure.code == "NoSuchBucket":
            return MissingFileError(f"{uri}: bucket {bucket!r} does not exist at {endpoint}; check the bucket name "
                                    "and the endpoint (AWS_ENDPOINT_URL_S3)" + (", or create the bucket" if writing else ""))
        if failure.status == 404:
            return MissingFileError(f"{uri}: no such object at {endpoint} (or no bucket {bucket!r}); check the URI")
        if failure.status == 412:
            return IntegrityError(f"{uri}: replaced since it was indexed (its ETag no longer matches: {said}); "
                                  "re-plan the load once the checkpoint is stable")
        if failure.status in (401, 403):
            return StorageError(f"{uri}: {endpoint} denied {what} ({said}); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                                f"(or AWS_PROFILE) and that this identity may {'write to' if writing else 'read'} the bucket")
        if failure.status in (301, 307, 400) and failure.code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            return StorageError(f"{uri}: the bucket is in another region ({said}); set AWS_REGION to the bucket's region")
        if failure.transient and failure.status is None:
            return StorageError(f"{uri}: {what} got no whole answer from {endpoint} in {attempts} attempt(s) ({failure.detail}); "
                                "check that the endpoint is right and reachable (set AWS_ENDPOINT_URL_S3 for an S3-compatible "
                                "server) or allow more attempts (AWS_MAX_ATTEMPTS)")
        if failure.transient:
            return StorageError(f"{uri}: {what} failed {attempts} time(s) at {endpoint} ({said}); the store is throttling or "
                                "failing: retry later or allow more attempts (AWS_MAX_ATTEMPTS)")
        return StorageError(f"{uri}: {what} refused by {endpoint} ({said}: {failure.detail}); check the URI and the S3 settings")

    # -- stores

    def _locate(self, path: StoredPath) -> tuple[str, S3Store, str]:
        """The path's URI, its bucket's store, and its key."""
        if not isinstance(path, S3Path):
            raise TypeError(f"{path} is not an s3:// path")
        if not path.bucket:
            raise ConfigError(f"{path}: an s3:// URI names a bucket: s3://bucket/prefix")
        return str(path), self._store(path.bucket), path.object_key

    def _store(self, bucket: str) -> S3Store:
        with self._lock:
            if bucket not in self._stores:
                self._stores[bucket] = self._open(bucket)
            return self._stores[bucket]

    def _open(self, bucket: str) -> S3Store:
        from obstore.store import S3Store

        c = self.config
        client = {
            "allow_http": bool(c.endpoint and c.endpoint.startswith("http://")),
            "connect_timeout": timedelta(seconds=c.connect_timeout_seconds),
            "read_timeout": timedelta(seconds=c.stall_timeout_seconds),
            "timeout": timedelta(seconds=c.request_timeout_seconds),
        }
        keys = {"access_key_id": c.access_key_id, "secret_access_key": c.secret_access_key, "session_token": c.session_token}
        try:
            return S3Store(
                bucket, region=c.region, virtual_hosted_style_request=False, client_options=client,  # type: ignore[arg-type]
                retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=c.request_timeout_seconds)},
                **({"endpoint": c.endpoint} if c.endpoint else {}), **{k: v for k, v in keys.items() if v is not None},  # type: ignore[arg-type]
            )
        except self._failures as exc:
            raise ConfigError(f"s3://{bucket}: the S3 settings are refused ({classify(exc).detail}); check AWS_ENDPOINT_URL_S3, "
                              "AWS_REGION and the credentials") from None


def open_s3() -> S3Storage:
    """The storage of ``s3://`` paths, from the standard AWS configuration (registered on import)."""
    return S3Storage()
