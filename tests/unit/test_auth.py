"""API keys → tenants (app/auth.py): parsing, the 401s, and the key file read again."""

from __future__ import annotations

import logging
import os
import time

import pytest

from app.auth import ApiKeys, KeyConfigError, parse_keys
from app.config import AppConfig
from app.errors import AuthenticationError

KEY_A = "a" * 16 + "-secret-of-acme"
KEY_B = "b" * 24
KEY_C = "c" * 20


@pytest.fixture
def serve_log(caplog, monkeypatch):
    """What the "ray.serve" logger writes at INFO and above (importing Ray Serve may stop
    it propagating to the root logger, where caplog listens)."""
    # Imported first: importing Ray Serve sets up that logger (its handlers, and no
    # propagation), which would undo the handler below when a test imports it later, and
    # while propagation is still on, each record would reach caplog twice. Run alone,
    # this file saw 4 lines where 2 were due, and none in the 401 test.
    import ray.serve  # noqa: F401

    caplog.set_level(logging.INFO, logger="ray.serve")
    monkeypatch.setattr(logging.getLogger("ray.serve"), "handlers", [caplog.handler])
    return caplog


def keys_from(env: str = "", path=None, monkeypatch=None, interval: float = 5.0) -> ApiKeys:
    monkeypatch.setenv("TEST_LLM_KEYS", env)
    keys = ApiKeys("TEST_LLM_KEYS", None if path is None else str(path), interval)
    keys.load()
    return keys


def test_entries_are_tenant_colon_key_separated_by_whitespace_or_commas():
    keys = parse_keys(f" acme:{KEY_A},globex:{KEY_B}\n\tacme:{KEY_C} ", "$X")
    assert sorted(keys.values()) == ["acme", "acme", "globex"]
    assert KEY_A.encode() not in b"".join(keys)  # digests only
    # In a file, '#' starts a comment (a key may hold '#' in the variable).
    assert parse_keys(f"# who\nacme:{KEY_A}  # the first\n\n", "file k", comments=True) == parse_keys(f"acme:{KEY_A}", "$X")


@pytest.mark.parametrize(
    "text, says",
    [
        (KEY_A, "entry 1: expected 'tenant:key'"),
        (f"acme:{KEY_A} :{KEY_B}", "entry 2: expected 'tenant:key'"),
        (f"ac/me:{KEY_A}", "entry 1: expected 'tenant:key'"),
        ("acme:short", "entry 1 (tenant 'acme'): a key needs at least 16 characters"),
        (f"acme:{KEY_A},globex:{KEY_A}", "entry 2: the same key is given to tenants 'acme' and 'globex'"),
    ],
)
def test_a_malformed_entry_is_named_and_its_key_never_shown(text, says):
    with pytest.raises(KeyConfigError) as e:
        parse_keys(text, "$LLM_API_KEYS")
    assert str(e.value).startswith("$LLM_API_KEYS, ") and says in str(e.value)
    assert KEY_A not in str(e.value) and "short" not in str(e.value)


def test_no_keys_means_every_request_is_the_default_tenant(monkeypatch):
    keys = keys_from("", monkeypatch=monkeypatch)
    assert not keys.enabled
    for header in (None, "", "Bearer whatever-it-is-at-all", "Basic abc"):
        assert keys.tenant(header) == "default"


def test_a_key_names_its_tenant_and_anything_else_is_401(monkeypatch):
    keys = keys_from(f"acme:{KEY_A} globex:{KEY_B}", monkeypatch=monkeypatch)
    assert keys.tenant(f"Bearer {KEY_A}") == "acme"
    assert keys.tenant(f"bearer  {KEY_B} ") == "globex"
    assert keys.tenant(f"Bearer\t{KEY_A}") == "acme"
    for header, code in [
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        ("Bearer ", "missing_api_key"),
        (f"Basic {KEY_A}", "missing_api_key"),
        (KEY_A, "missing_api_key"),
        (f"Bearer {KEY_C}", "invalid_api_key"),
        (f"Bearer {KEY_A}x", "invalid_api_key"),
    ]:
        with pytest.raises(AuthenticationError) as e:
            keys.tenant(header)
        assert (e.value.status_code, e.value.code) == (401, code), header
        assert e.value.headers["WWW-Authenticate"].startswith("Bearer")
        assert KEY_A not in e.value.message


def test_the_file_is_read_again_when_it_changes_and_a_bad_one_keeps_the_last_good_keys(tmp_path, monkeypatch, serve_log):
    path = tmp_path / "keys"
    path.write_text(f"acme:{KEY_A}\n")
    keys = keys_from(f"globex:{KEY_B}", path=path, monkeypatch=monkeypatch, interval=0.05)
    assert keys.tenant(f"Bearer {KEY_A}") == "acme" and keys.tenant(f"Bearer {KEY_B}") == "globex"

    def rewrite(text: str) -> None:
        path.write_text(text)
        stamp = time.time() + 1  # a new mtime even within the file system's granularity
        os.utime(path, (stamp, stamp))
        time.sleep(0.06)  # past the reload interval

    rewrite(f"initech:{KEY_C}\n")  # acme's key revoked, initech's added
    assert keys.tenant(f"Bearer {KEY_C}") == "initech"
    with pytest.raises(AuthenticationError):
        keys.tenant(f"Bearer {KEY_A}")
    assert keys.tenant(f"Bearer {KEY_B}") == "globex"  # the variable's key stays

    serve_log.clear()
    rewrite("initech:short\n")
    assert keys.tenant(f"Bearer {KEY_C}") == "initech"
    path.unlink()
    for _ in range(3):  # logged once, not at every check
        time.sleep(0.06)
        assert keys.tenant(f"Bearer {KEY_C}") == "initech"
    errors = [r.getMessage() for r in serve_log.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all("the keys read before stay" in m for m in errors), errors
    assert "short" not in " ".join(errors)


def test_a_missing_file_or_a_key_given_to_two_tenants_fails_the_start(tmp_path, monkeypatch):
    with pytest.raises(OSError):
        keys_from("", path=tmp_path / "absent", monkeypatch=monkeypatch)
    path = tmp_path / "keys"
    path.write_text(f"acme:{KEY_A}\n")
    with pytest.raises(KeyConfigError, match="'globex' and 'acme'|'acme' and 'globex'"):
        keys_from(f"globex:{KEY_A}", path=path, monkeypatch=monkeypatch)


def test_the_security_section_takes_no_key_itself():
    with pytest.raises(ValueError, match="api_keys"):
        AppConfig.model_validate({"security": {"api_keys": [KEY_A]}})
    cfg = AppConfig.model_validate({"security": {"api_keys_file": "/run/secrets/llm-keys"}})
    assert (cfg.security.api_keys_env, cfg.security.api_keys_file) == ("LLM_API_KEYS", "/run/secrets/llm-keys")


def test_refused_keys_are_counted_each_and_logged_at_most_once_an_interval(monkeypatch, serve_log):
    import collections
    from types import SimpleNamespace

    from app.ingress import AUTH_LOG_INTERVAL_S, Ingress
    from app.telemetry import Every

    counted = []
    ing = Ingress.__new__(Ingress)
    ing._keys = keys_from(f"acme:{KEY_A}", monkeypatch=monkeypatch)
    ing._m = SimpleNamespace(auth_failures=SimpleNamespace(inc=lambda tags: counted.append(tags["reason"])))
    ing._auth_refusals, ing._auth_log = collections.Counter(), Every(AUTH_LOG_INTERVAL_S)

    def request(authorization=None):
        headers = {} if authorization is None else {"authorization": authorization}
        return SimpleNamespace(headers=headers, client=SimpleNamespace(host="10.0.0.9"), method="GET",
                               url=SimpleNamespace(path="/v1/models"))

    for authorization in (None, f"Bearer {KEY_C}", f"Bearer {KEY_B}"):
        with pytest.raises(AuthenticationError):
            ing._authenticate(request(authorization))
    assert ing._authenticate(request(f"Bearer {KEY_A}")) == "acme"
    ing._auth_log.last -= AUTH_LOG_INTERVAL_S  # the interval passed
    with pytest.raises(AuthenticationError):
        ing._authenticate(request())
    assert counted == ["missing", "invalid", "invalid", "missing"]
    lines = [r.getMessage() for r in serve_log.records if r.getMessage().startswith("401:")]
    assert lines == [
        "401: 1 request(s) with a missing and 0 with an unknown API key since the last such line; "
        "the latest GET /v1/models from 10.0.0.9",
        "401: 1 request(s) with a missing and 2 with an unknown API key since the last such line; "
        "the latest GET /v1/models from 10.0.0.9",
    ]
