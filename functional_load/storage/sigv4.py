"""AWS Signature Version 4 for one path-style S3 request, with the standard library only.

Used where a request must be signed without an S3 client library: the test server's set-up
(:mod:`functional_load.testing.seaweed` makes buckets and puts objects with it).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import urllib.parse
import urllib.request


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def sign_headers(
    method: str, url: str, body: bytes, headers: dict[str, str], access_key: str, secret_key: str, region: str,
    now: datetime.datetime | None = None,
) -> dict[str, str]:
    """``headers`` plus ``Host``, ``x-amz-date``, ``x-amz-content-sha256`` and ``Authorization``."""
    parts = urllib.parse.urlsplit(url)
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    signed = {k.lower(): v.strip() for k, v in headers.items()}
    signed.update({"host": parts.netloc, "x-amz-date": stamp, "x-amz-content-sha256": hashlib.sha256(body).hexdigest()})
    names = sorted(signed)
    query = "&".join(
        f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
        for k, v in sorted(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    )
    canonical = "\n".join([
        method, urllib.parse.quote(parts.path or "/", safe="/-_.~"), query,
        "".join(f"{n}:{signed[n]}\n" for n in names), ";".join(names), signed["x-amz-content-sha256"],
    ])
    scope = f"{stamp[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), stamp[:8]), region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    auth = f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={';'.join(names)}, Signature={signature}"
    return {**headers, "Host": parts.netloc, "x-amz-date": stamp, "x-amz-content-sha256": signed["x-amz-content-sha256"],
            "Authorization": auth}


def signed_request(
    method: str, url: str, body: bytes, headers: dict[str, str], access_key: str, secret_key: str, region: str
) -> urllib.request.Request:
    """A :class:`urllib.request.Request` signed for ``access_key`` (path-style ``url``)."""
    return urllib.request.Request(
        url, data=body if method in ("PUT", "POST") else None, method=method,
        headers=sign_headers(method, url, body, headers, access_key, secret_key, region),
    )
