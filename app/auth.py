"""API keys → tenants (``security`` in the config).

A request to ``/v1/...`` names its key in ``Authorization: Bearer <key>`` (what the
``openai`` client and curl's ``-H`` send); the key decides its tenant, and the tenant
scopes everything the request touches: its sessions (a session of another tenant is a
404, the same answer as an absent one) and its KV blocks (the block hashes cover the
tenant, and vLLM's own prefix cache is salted with it), so one tenant can neither read nor
detect another's conversations or prompts. ``/health``, ``/ready`` and ``/metrics`` take
no key (probes and scrapers), as with vLLM's ``--api-key``.

The keys never live in the YAML: they come from an environment variable
(``security.api_keys_env``, default ``LLM_API_KEYS``) and/or a file
(``security.api_keys_file``, e.g. a mounted Kubernetes Secret), as entries
``tenant:key`` separated by whitespace, commas or new lines (``#`` starts a comment in the
file). No entry anywhere: keys are off and every request is tenant ``default``, as on a
laptop. The file is read again when it changes (checked at most every
``security.reload_interval_s``): a key added or revoked there takes effect without a
restart, and a file that turns unreadable or malformed keeps the last good keys (one
ERROR line). Only SHA-256 digests of the keys are kept in memory, and a presented key is
looked up by its digest, so no comparison runs over the key's own characters.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from app.errors import AuthenticationError

logger = logging.getLogger("ray.serve")

DEFAULT_TENANT = "default"
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MIN_KEY_LENGTH = 16
_SEPARATORS = re.compile(r"[\s,]+")


class KeyConfigError(ValueError):
    """A malformed key entry; the message names where it is, never the key itself."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, source: str, comments: bool = False) -> dict[bytes, str]:
    """``{sha256(key): tenant}`` of the ``tenant:key`` entries in ``text`` (``source``
    names it in errors: the variable or the file; ``comments``: '#' starts one, as in the
    file)."""
    keys: dict[bytes, str] = {}
    lines = [line.split("#", 1)[0] if comments else line for line in text.splitlines()]
    entries = [e for e in _SEPARATORS.split(" ".join(lines)) if e]
    for number, entry in enumerate(entries, 1):
        tenant, sep, key = entry.partition(":")
        where = f"{source}, entry {number}"
        if not sep or not TENANT_RE.match(tenant):
            raise KeyConfigError(
                f"{where}: expected 'tenant:key' with a tenant of letters, digits, '_', '.' "
                "or '-' (at most 64, starting with a letter or digit)"
            )
        if len(key) < MIN_KEY_LENGTH:
            raise KeyConfigError(f"{where} (tenant {tenant!r}): a key needs at least {MIN_KEY_LENGTH} characters")
        _assign(keys, _digest(key), tenant, f"{where}: ")
    return keys


def _assign(keys: dict[bytes, str], digest: bytes, tenant: str, where: str = "") -> None:
    """``keys[digest] = tenant``, unless that key is another tenant's already."""
    if keys.get(digest, tenant) != tenant:
        raise KeyConfigError(f"{where}the same key is given to tenants {keys[digest]!r} and {tenant!r}")
    keys[digest] = tenant


def _merge(parts: list[dict[bytes, str]]) -> dict[bytes, str]:
    merged: dict[bytes, str] = {}
    for part in parts:
        for d, tenant in part.items():
            _assign(merged, d, tenant)
    return merged


@dataclass
class ApiKeys:
    """The keys an ingress replica checks requests against (see the module's text)."""

    env_var: Optional[str] = "LLM_API_KEYS"
    path: Optional[str] = None
    reload_interval_s: float = 5.0
    # What was read (key digest → tenant), and when and what of the file.
    _from_env: dict[bytes, str] = field(default_factory=dict, init=False)
    _from_file: dict[bytes, str] = field(default_factory=dict, init=False)
    _keys: dict[bytes, str] = field(default_factory=dict, init=False)
    _file_stamp: Optional[tuple] = field(default=None, init=False)
    _checked_at: float = field(default=0.0, init=False)
    _file_error: Optional[str] = field(default=None, init=False)

    @classmethod
    def from_config(cls, security) -> "ApiKeys":
        keys = cls(security.api_keys_env, security.api_keys_file, security.reload_interval_s)
        keys.load()
        return keys

    def load(self) -> None:
        """Read the variable and the file; raises ``KeyConfigError`` (naming the entry)
        or ``OSError`` (the file) so that a replica with bad keys fails to start."""
        text = os.environ.get(self.env_var, "") if self.env_var else ""
        self._from_env = parse_keys(text, f"${self.env_var}")
        if self.path:
            self._read_file()
        self._keys = _merge([self._from_env, self._from_file])
        self._checked_at = time.monotonic()
        tenants = sorted(set(self._keys.values()))
        if self._keys:
            logger.info("API keys: %d for %d tenant(s) %s", len(self._keys), len(tenants), ", ".join(tenants))
        else:
            logger.info("API keys: none configured; every request is tenant %r", DEFAULT_TENANT)

    def _stamp(self) -> tuple:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _read_file(self) -> None:
        stamp = self._stamp()
        self._from_file = parse_keys(Path(self.path).read_text(encoding="utf-8"), f"file {self.path}", comments=True)
        self._file_stamp = stamp

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if not self.path or now - self._checked_at < self.reload_interval_s:
            return
        self._checked_at = now
        try:
            if self._stamp() == self._file_stamp:
                return
            before = set(self._keys)
            self._read_file()
            self._keys = _merge([self._from_env, self._from_file])
        except (OSError, UnicodeDecodeError, KeyConfigError) as e:
            # The last good keys stay: a half-written or removed file must not open the
            # server, nor lock every client out. Read again at each check; logged once
            # per distinct problem.
            self._file_stamp = None
            if str(e) != self._file_error:
                self._file_error = str(e)
                logger.error("API keys: %s could not be read again (%s); the keys read before stay", self.path, e)
            return
        self._file_error = None
        now_keys = set(self._keys)
        logger.info(
            "API keys: %s changed: %d added, %d revoked, %d in all",
            self.path, len(now_keys - before), len(before - now_keys), len(now_keys),
        )

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: Optional[str]) -> str:
        """The tenant of a request whose ``Authorization`` header is ``authorization``;
        ``AuthenticationError`` (401) when keys are on and it names none of them."""
        self._maybe_reload()
        if not self._keys:
            return DEFAULT_TENANT
        scheme, key = ((authorization or "").split(None, 1) + ["", ""])[:2]
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError(
                "No API key given: send it in an 'Authorization: Bearer <key>' header.",
                code="missing_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        tenant = self._keys.get(_digest(key.strip()))
        if tenant is None:
            raise AuthenticationError(
                "Incorrect API key provided.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        return tenant
