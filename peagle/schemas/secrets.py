"""Secrets stay in the process: the one redaction every written or printed config goes through
(docs/reliability.md, "What peagle trusts").

A team's ``--config`` file or the environment may hand peagle a credential: an MLflow tracking URI
``http://user:pass@host:5000``, a ``?token=...`` in a URL, ``HF_TOKEN`` or ``WANDB_API_KEY``. peagle
uses them (:func:`split_credentials` gives a client its URI without them, and them apart) but writes
and prints none: run files, checkpoints' config, tracker parameters and artifacts, TensorBoard text,
``trackers.json``, exports, eval reports and error lines all pass through :func:`redact` (or
:func:`redact_text`), which replaces

* the user-info of a URL: ``user:pass@`` becomes ``user:***@``, a lone ``token@`` becomes ``***@``;
* the value of a query parameter whose name says it is secret (``token``, ``api_key``,
  ``X-Amz-Signature``, ...): ``?token=***``;
* the value of any environment variable whose name says it is secret (``*_TOKEN``, ``*_API_KEY``,
  ``*_SECRET*``, ``*_PASSWORD``, ...) wherever it appears, when it is at least
  :data:`MIN_SECRET_CHARS` long (shorter values are words, not keys).

Pure string work, standard library only; it sits at the bottom layer so every layer can use it.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

MARK = "***"
"""What a secret is replaced by."""
MIN_SECRET_CHARS = 8
"""Environment values shorter than this are not searched for (``true``, ``1``, ``auto``)."""
SECRET_WORDS = frozenset({"token", "key", "apikey", "secret", "password", "passwd", "pwd", "pass", "sig",
                          "signature", "auth", "authorization", "credential", "credentials"})
"""A name (query parameter or environment variable) that has one of these as a word is secret."""
NOT_SECRET_SUFFIXES = ("_FILE", "_PATH", "_DIR", "_SOCK", "_URL", "_HOST", "_PORT", "_USER", "_USERNAME",
                       "_MODE", "_TYPE", "_NAME", "_PARALLELISM")
"""Environment names that end so hold where a secret is, not the secret (``SSH_AUTH_SOCK``)."""
NOT_SECRET_ENV = frozenset({"PWD", "OLDPWD"})
"""The shell's working directories: "pwd" is a password's word in a query (``?pwd=``), but these
environment variables hold a path, and taking them for secrets redacted every path under the
directory a command was started from (a run started in /data saved its store as ``***/store``,
then refused its own resume)."""

_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s/?#@\"'<>]+)@")
_QUERY = re.compile(r"(?P<sep>[?&;])(?P<name>[A-Za-z0-9_.\-]+)=(?P<value>[^&#\s\"'<>]*)")
_WORD_SPLIT = re.compile(r"[_\-.]+")

T = TypeVar("T")


def is_secret_name(name: str) -> bool:
    """Whether a query parameter or environment variable of this name holds a secret: one of its
    words (split at ``_``, ``-``, ``.``) is in :data:`SECRET_WORDS`, or it ends in ``token``/``key``/
    ``secret`` (``accesstoken``, ``apikey``)."""
    lower = name.lower()
    words = [w for w in _WORD_SPLIT.split(lower) if w]
    return any(w in SECRET_WORDS for w in words) or lower.endswith(("token", "apikey", "secret", "password"))


def secret_env_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the secret-named environment variables (longest first, so one that contains
    another is replaced whole)."""
    environ = os.environ if environ is None else environ
    values = {value for name, value in environ.items()
              if len(value) >= MIN_SECRET_CHARS and is_secret_name(name)
              and not name.upper().endswith(NOT_SECRET_SUFFIXES) and name.upper() not in NOT_SECRET_ENV}
    return sorted(values, key=len, reverse=True)


def _userinfo(match: re.Match) -> str:
    user, colon, _ = match.group("userinfo").partition(":")
    return f"{match.group('scheme')}{user}:{MARK}@" if colon else f"{match.group('scheme')}{MARK}@"


def _query(match: re.Match) -> str:
    if not is_secret_name(match.group("name")) or not match.group("value"):
        return match.group(0)
    return f"{match.group('sep')}{match.group('name')}={MARK}"


def redact_text(text: str, environ: Mapping[str, str] | None = None) -> str:
    """``text`` with every credential it holds replaced by :data:`MARK` (module docstring)."""
    if not text:
        return text
    out = _QUERY.sub(_query, _USERINFO.sub(_userinfo, text))
    for value in secret_env_values(environ):
        if value in out:
            out = out.replace(value, MARK)
    return out


def redact(value: T, environ: Mapping[str, str] | None = None) -> T:
    """A copy of ``value`` (a config, a report, a record: dicts, lists, tuples and scalars) with every
    string in it redacted (:func:`redact_text`); keys are kept, other values returned as they are."""
    if isinstance(value, str):
        return redact_text(value, environ)  # type: ignore[return-value]
    if isinstance(value, Mapping):
        return {k: redact(v, environ) for k, v in value.items()}  # type: ignore[return-value]
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, environ) for v in value)  # type: ignore[return-value]
    return value


@dataclass(frozen=True)
class Credentials:
    """A URI without its credentials, and the credentials it held (each None where it held none)."""

    uri: str
    username: str | None = None
    password: str | None = None
    token: str | None = None
    """The value of a secret query parameter (``?token=...``), for a client that takes a bearer token."""


def split_credentials(uri: str) -> Credentials:
    """``http://alice:s3cret@host:5000/?token=t`` -> ``Credentials("http://host:5000/", "alice",
    "s3cret", "t")``: the URI to hand a client, and what to hand it apart (percent-decoded)."""
    parts = urllib.parse.urlsplit(uri)
    username = password = token = None
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, colon, secret = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
    query = parts.query
    if query:
        kept = []
        for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
            if is_secret_name(name) and value:
                token = token or value
            else:
                kept.append((name, value))
        query = urllib.parse.urlencode(kept)
    if netloc == parts.netloc and query == parts.query:
        return Credentials(uri)
    clean = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    if not parts.netloc and uri.startswith(f"{parts.scheme}:") and not uri.startswith(f"{parts.scheme}://"):
        clean = clean.replace(f"{parts.scheme}://", f"{parts.scheme}:", 1)  # file:PATH stays file:PATH
    return Credentials(clean, username, password, token)
