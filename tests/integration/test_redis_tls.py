"""The data plane over TLS (``rediss://``) to a real redis-server with a TLS port, its
certificates made here by a CA of the test's own: the CA from ``dataplane.redis``'s
``tls_ca_certs``, a client certificate for a server that asks for one, and a server
certificate that the system's trust store does not know is refused."""

from __future__ import annotations

import datetime
import ipaddress
import socket
from pathlib import Path

import pytest

from app.config import RedisConfig
from app.local_redis import LocalRedis
from deployments.dataplane.blocks import BlockHeader, encode_block
from deployments.dataplane.redis_store import RedisStore, RedisUnavailable
from deployments.dataplane.types import SessionRecord

pytestmark = pytest.mark.integration


def _pki(tmp: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key, cert) -> None:
        (tmp / f"{stem}.key").write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        (tmp / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(cn: str, issuer_key, issuer_name, *, ca: bool = False, ip: bool = False):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(issuer_name or name(cn))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if ip:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
        return key, builder.sign(issuer_key or key, hashes.SHA256())

    ca_key, ca = issue("test CA", None, None, ca=True)
    write("ca", ca_key, ca)
    write("server", *issue("redis", ca_key, ca.subject, ip=True))
    write("client", *issue("data plane", ca_key, ca.subject))
    return {stem: str(tmp / f"{stem}.pem") for stem in ("ca", "server", "client")} | {
        "server_key": str(tmp / "server.key"), "client_key": str(tmp / "client.key"),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tls_redis(pki: dict, *, auth_clients: bool) -> tuple[LocalRedis, str]:
    port = _free_port()
    server = LocalRedis(
        extra_args=(
            "--tls-port", str(port), "--tls-cert-file", pki["server"], "--tls-key-file", pki["server_key"],
            "--tls-ca-cert-file", pki["ca"], "--tls-auth-clients", "yes" if auth_clients else "no",
        )
    )
    return server, f"rediss://127.0.0.1:{port}/0"


async def _round_trip(cfg: RedisConfig) -> None:
    store = RedisStore.from_config(cfg, kv_ttl_s=60)
    try:
        rec = SessionRecord("s-tls", "t", created=0.0, expires_at=1e12, ttl_s=60)
        assert await store.create_session(rec)
        assert (await store.get_session("t", "s-tls")).id == "s-tls"
        block = encode_block(BlockHeader("float32", (1, 2, 1, 4, 8)), b"\x07" * 256)
        await store.put_blocks("t", ["b0"], [block])  # redis-py (the raw client is plain TCP only)
        data, views = await store.get_blocks_packed("t", ["b0"])
        assert bytes(views[0]) == block
    finally:
        await store.close()


async def _refused(cfg: RedisConfig) -> str:
    """The connection's failure, lower case: an unreachable server to the store."""
    store = RedisStore.from_config(cfg, kv_ttl_s=60)
    try:
        with pytest.raises(RedisUnavailable) as refused:
            await store.get_session("t", "s-tls")
        return str(refused.value).lower()
    finally:
        await store.close()


async def test_the_data_plane_talks_tls_with_its_configured_ca(tmp_path):
    pki = _pki(tmp_path)
    server, url = _tls_redis(pki, auth_clients=False)
    with server:
        await _round_trip(RedisConfig(url=url, password_env=None, tls_ca_certs=pki["ca"]))
        # Without the CA the server's certificate is unknown: refused, as an outage.
        assert "certificate" in await _refused(RedisConfig(url=url, password_env=None))


async def test_a_server_that_asks_for_a_client_certificate_gets_the_configured_one(tmp_path):
    pki = _pki(tmp_path)
    server, url = _tls_redis(pki, auth_clients=True)
    with server:
        await _round_trip(
            RedisConfig(url=url, password_env=None, tls_ca_certs=pki["ca"], tls_certfile=pki["client"], tls_keyfile=pki["client_key"])
        )
        await _refused(RedisConfig(url=url, password_env=None, tls_ca_certs=pki["ca"]))  # no client certificate


def test_tls_settings_need_a_rediss_url_and_a_key_with_the_certificate():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="need a rediss:// url"):
        RedisConfig(url="redis://127.0.0.1:6379/0", tls_ca_certs="/ca.pem")
    with pytest.raises(ValidationError, match="go together"):
        RedisConfig(url="rediss://127.0.0.1:6379/0", tls_certfile="/c.pem")
    assert RedisConfig(url="rediss://h:1/0", tls_verify="none").tls_kwargs() == {
        "ssl_cert_reqs": "none", "ssl_check_hostname": False,
    }
