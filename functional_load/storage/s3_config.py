"""Where an S3 store is and who we are to it: :class:`S3Config`, from the standard AWS configuration.

:meth:`S3Config.from_environment` reads what the AWS CLI and SDKs read, in their order:

* endpoint: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, else the profile's ``endpoint_url``,
  else AWS itself (``https://s3.<region>.amazonaws.com``);
* region: ``AWS_REGION``, else ``AWS_DEFAULT_REGION``, else the profile's ``region``, else ``us-east-1``;
* credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``), else the
  profile's static keys (``AWS_PROFILE``, else ``default``; ``~/.aws/credentials`` then
  ``~/.aws/config``, or ``AWS_SHARED_CREDENTIALS_FILE`` / ``AWS_CONFIG_FILE``), else the client's
  own chain (web identity token, container and instance metadata credentials);
* attempts per request: ``AWS_MAX_ATTEMPTS``, else the profile's ``max_attempts``, else 5.

Requests are path-style (``<endpoint>/<bucket>/<key>``), which AWS and S3-compatible servers
(SeaweedFS, MinIO, Ceph) all serve.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

DEFAULT_REGION = "us-east-1"
DEFAULT_ATTEMPTS = 5


@dataclass(frozen=True)
class S3Config:
    """An S3 endpoint, identity and fault policy.

    ``max_attempts``: tries per request (a retry after throttling, a 5xx, a reset connection, a
    timeout or a short body), each after an exponential backoff with full jitter: a random wait
    up to ``backoff_seconds * 2**(try - 1)``, at most ``backoff_cap_seconds``. A request fails (and
    is tried again) when its connection takes over ``connect_timeout_seconds``, its response
    stalls for ``stall_timeout_seconds`` or it takes over ``request_timeout_seconds`` in all. A
    write larger than ``upload_part_bytes`` is a multipart upload of parts that size (S3 wants at
    least 5 MiB but the last), ``upload_concurrency`` parts in flight."""

    endpoint: str | None = None
    region: str = DEFAULT_REGION
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    max_attempts: int = DEFAULT_ATTEMPTS
    backoff_seconds: float = 0.1
    backoff_cap_seconds: float = 5.0
    connect_timeout_seconds: float = 5.0
    stall_timeout_seconds: float = 30.0
    request_timeout_seconds: float = 600.0
    upload_part_bytes: int = 16 << 20
    upload_concurrency: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigError(f"S3 max_attempts must be a positive integer (AWS_MAX_ATTEMPTS), got {self.max_attempts!r}")
        for name, least in (("upload_part_bytes", 5 << 20), ("upload_concurrency", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"S3 {name} must be an integer of at least {least} (S3's smallest part is 5 MiB), got {value!r}")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                f"S3 endpoint {self.endpoint!r} needs a scheme: set AWS_ENDPOINT_URL_S3 to e.g. http://127.0.0.1:8333"
            )
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError("S3 credentials need both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (one of them is missing)")

    @property
    def endpoint_url(self) -> str:
        """The endpoint requests go to (for messages)."""
        return self.endpoint or f"https://s3.{self.region}.amazonaws.com"

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> S3Config:
        """The standard AWS configuration (see the module), then ``overrides`` (field values)."""
        env = os.environ if environ is None else environ
        profile = _profile(env)
        keys = _env_keys(env) or _profile_keys(profile)
        attempts = env.get("AWS_MAX_ATTEMPTS") or profile.get("max_attempts")
        try:
            max_attempts = int(attempts) if attempts else DEFAULT_ATTEMPTS
        except ValueError:
            raise ConfigError(f"AWS_MAX_ATTEMPTS (or the profile's max_attempts) must be an integer, got {attempts!r}") from None
        values: dict[str, object] = {
            "endpoint": env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or profile.get("endpoint_url") or None,
            "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or profile.get("region") or DEFAULT_REGION,
            "max_attempts": max_attempts,
        }
        if keys is not None:
            values.update(zip(("access_key_id", "secret_access_key", "session_token"), keys))
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def _env_keys(env: Mapping[str, str]) -> tuple[str, str, str | None] | None:
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not key and not secret:
        return None
    if not key or not secret:
        missing = "AWS_SECRET_ACCESS_KEY" if key else "AWS_ACCESS_KEY_ID"
        raise ConfigError(f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY go together; {missing} is not set")
    return key, secret, env.get("AWS_SESSION_TOKEN") or None


def _profile_keys(profile: Mapping[str, str]) -> tuple[str, str, str | None] | None:
    key, secret = profile.get("aws_access_key_id"), profile.get("aws_secret_access_key")
    return (key, secret, profile.get("aws_session_token")) if key and secret else None


def _profile(env: Mapping[str, str]) -> dict[str, str]:
    """The named profile's settings: its ``~/.aws/config`` section overlaid by its ``~/.aws/credentials`` one."""
    name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path(env.get("HOME") or Path.home())
    config_file = Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config")
    credentials_file = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials")
    settings: dict[str, str] = {}
    found = False
    for file, section in ((config_file, name if name == "default" else f"profile {name}"), (credentials_file, name)):
        parser = configparser.RawConfigParser()
        try:
            parser.read(file)
        except configparser.Error as exc:
            raise ConfigError(f"{file}: not a valid AWS configuration file ({exc})") from None
        if parser.has_section(section):
            settings.update(parser.items(section))
            found = True
    if not found and name != "default":
        raise ConfigError(f"AWS profile {name!r} (AWS_PROFILE) is in neither {config_file} nor {credentials_file}")
    return settings
