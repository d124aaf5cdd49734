"""S3 credentials and region, from the standard AWS variables and files, resolved once at start.

The order is the AWS SDKs' for static keys:

1. ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (+ ``AWS_SESSION_TOKEN``);
2. the shared credentials file (``AWS_SHARED_CREDENTIALS_FILE``, default
   ``~/.aws/credentials``), profile ``AWS_PROFILE`` (or the configured
   one, or ``default``); its region from the config file (``AWS_CONFIG_FILE``,
   default ``~/.aws/config``, section ``profile NAME`` or ``default``);
3. none of those: nothing is passed and obstore's own chain applies — web
   identity (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``: EKS IRSA),
   ECS/EKS container credentials, then the instance metadata service.

A profile that names a role or SSO instead of keys is not expanded here:
use the variables, IRSA, or an instance role for those.

The environment is a mapping passed in (the daemon passes its own at start;
tests pass a dict): nothing deep in the code reads ``os.environ``. Secrets
never appear in a repr, a log line or an error message; a message names the
file and profile, never a key.
"""

from __future__ import annotations

import configparser
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import InvalidArgument


@dataclass(frozen=True)
class StaticCredentials:
    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str = field(default="", repr=False)
    source: str = ""  # where they came from, for messages: "environment", "~/.aws/credentials [default]"

    def obstore_config(self) -> dict[str, str]:
        out = {"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}
        if self.session_token:
            out["session_token"] = self.session_token
        return out


@dataclass(frozen=True)
class Resolved:
    credentials: StaticCredentials | None  # None: obstore's chain (web identity, container, instance)
    region: str


DEFAULT_REGION = "us-east-1"


def resolve(environ: Mapping[str, str], *, region: str = "", profile: str = "", home: Path | None = None) -> Resolved:
    """Credentials and region for the object tier; ``region``/``profile`` as configured ("" = not set)."""
    home = home if home is not None else Path(environ.get("HOME", "~")).expanduser()
    profile = profile or environ.get("AWS_PROFILE", "") or "default"
    region = region or environ.get("AWS_REGION", "") or environ.get("AWS_DEFAULT_REGION", "")
    creds = _from_environment(environ)
    if creds is None:
        creds = _from_file(Path(environ.get("AWS_SHARED_CREDENTIALS_FILE", home / ".aws" / "credentials")), profile)
    if not region:
        region = _region_from_config(Path(environ.get("AWS_CONFIG_FILE", home / ".aws" / "config")), profile)
    return Resolved(creds, region or DEFAULT_REGION)


def _from_environment(environ: Mapping[str, str]) -> StaticCredentials | None:
    key, secret = environ.get("AWS_ACCESS_KEY_ID", ""), environ.get("AWS_SECRET_ACCESS_KEY", "")
    if not key and not secret:
        return None
    if not (key and secret):
        raise InvalidArgument(
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together (one of them is empty): "
            "set both, or neither to use the credentials file or the instance's role"
        )
    token = environ.get("AWS_SESSION_TOKEN", "") or environ.get("AWS_SECURITY_TOKEN", "")
    return StaticCredentials(key, secret, token, "environment")


def _read(path: Path) -> configparser.RawConfigParser | None:
    parser = configparser.RawConfigParser()
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, configparser.Error) as err:
        raise InvalidArgument(f"AWS file {path} cannot be read ({type(err).__name__}): fix or remove it") from None
    return parser


def _from_file(path: Path, profile: str) -> StaticCredentials | None:
    parser = _read(path)
    if parser is None or not parser.has_section(profile):
        return None
    section = parser[profile]
    key, secret = section.get("aws_access_key_id", "").strip(), section.get("aws_secret_access_key", "").strip()
    if not key and not secret:
        return None  # a profile without keys (a role, SSO): left to obstore's chain
    if not (key and secret):
        raise InvalidArgument(
            f"profile [{profile}] in {path} has only one of aws_access_key_id and aws_secret_access_key: give both"
        )
    return StaticCredentials(key, secret, section.get("aws_session_token", "").strip(), f"{path} [{profile}]")


def _region_from_config(path: Path, profile: str) -> str:
    parser = _read(path)
    if parser is None:
        return ""
    for name in (f"profile {profile}", profile):
        if parser.has_section(name):
            return parser[name].get("region", "").strip()
    return ""
