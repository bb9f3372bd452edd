"""TLS settings are validated up front; the secure directory is complete, owner-only and reused."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gossamer.coordinator.config import CoordinatorConfig
from gossamer.core.errors import ConfigError
from gossamer.security import certs
from gossamer.security.channel import ChannelSecurity, client_files
from gossamer.security.tls import TLSConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def secure_dir(tmp_path_factory: pytest.TempPathFactory) -> certs.SecureDir:
    return certs.init_secure_dir(tmp_path_factory.mktemp("sec") / "secure", sans=["10.9.8.7", "head.example"])


def test_secure_dir_is_complete_and_owner_only(secure_dir: certs.SecureDir) -> None:
    root = secure_dir.root
    assert secure_dir.created
    for d in (root, root / "client"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == ["ca.crt", "ca.key", "client/ca.crt", "client/client.crt", "client/client.key", "client/token",
                     "server.crt", "server.key", "token"]
    assert all(stat.S_IMODE((root / f).stat().st_mode) == 0o600 for f in files)
    assert (root / "token").read_text() == (root / "client" / "token").read_text()
    assert not {"ca.key", "server.key"} & {p.name for p in (root / "client").iterdir()}


def test_server_certificate_lists_the_given_and_local_names(secure_dir: certs.SecureDir) -> None:
    names = certs.cert_names((secure_dir.root / "server.crt").read_bytes())
    assert {"10.9.8.7", "head.example", "127.0.0.1", "localhost", "::1"} <= set(names)


def test_an_existing_secure_dir_is_kept(secure_dir: certs.SecureDir) -> None:
    before = (secure_dir.root / "ca.key").read_bytes()
    again = certs.init_secure_dir(secure_dir.root)
    assert not again.created and (secure_dir.root / "ca.key").read_bytes() == before


def test_client_files_accept_the_dir_or_its_client_copy(secure_dir: certs.SecureDir) -> None:
    for d in (secure_dir.root, secure_dir.client_dir):
        found = client_files(d)
        assert found["cert"].endswith("client/client.crt") and found["token"].endswith("client/token")
    sec = ChannelSecurity.from_flags(secure=str(secure_dir.client_dir))
    assert sec is not None and sec.tls is not None and sec.tls.cert and sec.token
    assert sec.token not in repr(sec)
    # a spawned role process gets paths, never the secret itself
    spec = sec.spec()
    assert spec["token"] is None and sec.token not in str(spec)
    assert ChannelSecurity.from_spec(spec) == sec


def test_explicit_flags_override_the_secure_dir(secure_dir: certs.SecureDir, tmp_path: Path) -> None:
    other = tmp_path / "other-token"
    other.write_text("another-token-0123456789\n")
    sec = ChannelSecurity.from_flags(secure=str(secure_dir.root), token_file=str(other))
    assert sec is not None and sec.token == "another-token-0123456789"
    assert ChannelSecurity.from_flags() is None


def test_client_files_refuse_a_dir_without_credentials(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither"):
        client_files(tmp_path)
    with pytest.raises(ConfigError, match="no such directory"):
        client_files(tmp_path / "missing")


def test_tls_config_names_the_bad_field(secure_dir: certs.SecureDir, tmp_path: Path) -> None:
    root = secure_dir.root
    with pytest.raises(ConfigError) as e:
        TLSConfig(cert=str(root / "server.crt"))
    assert e.value.field == "tls_key"
    with pytest.raises(ConfigError) as e:
        TLSConfig(ca=str(tmp_path / "nope.crt"))
    assert e.value.field == "tls_ca"
    (tmp_path / "junk.crt").write_text("not a certificate")
    with pytest.raises(ConfigError, match="not a PEM file"):
        TLSConfig(ca=str(tmp_path / "junk.crt")).channel_credentials()
    with pytest.raises(ConfigError, match="needs --tls-cert"):
        TLSConfig(ca=str(root / "ca.crt")).server_credentials()


def test_coordinator_config_validates_security_fields(secure_dir: certs.SecureDir, tmp_path: Path) -> None:
    root = secure_dir.root
    ok = CoordinatorConfig(state_dir=str(tmp_path), tls_cert=str(root / "server.crt"),
                           tls_key=str(root / "server.key"), tls_ca=str(root / "ca.crt"),
                           token_file=str(root / "token"))
    assert ok.tls is not None and ok.tls.mutual
    assert CoordinatorConfig(state_dir=str(tmp_path)).tls is None
    bad: list[tuple[dict[str, object], str]] = [
        ({"tls_ca": str(root / "ca.crt")}, "tls_ca"),
        ({"tls_cert": str(root / "server.crt")}, "tls_key"),
        ({"token_file": str(tmp_path / "missing")}, "token_file"),
        ({"max_message_bytes": 10}, "max_message_bytes"),
        ({"rate_limit": -1.0}, "rate_limit"),
        ({"rate_burst": 0}, "rate_burst"),
    ]
    for kwargs, field in bad:
        with pytest.raises(ConfigError) as e:
            CoordinatorConfig(state_dir=str(tmp_path), **kwargs)  # type: ignore[arg-type]
        assert e.value.field == field, kwargs
