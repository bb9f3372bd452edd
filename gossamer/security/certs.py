"""Certificate authority, server and client certificates, and the one-directory secure set-up."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from gossamer.core.errors import ConfigError
from gossamer.security.token import generate_token

# One secure directory, as `gossamer security init DIR` writes it. The coordinator reads the
# top level; DIR/client/ is what every worker machine and user gets a copy of (no CA key and
# no server key in it).
CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_CERT, SERVER_KEY = "server.crt", "server.key"
CLIENT_CERT, CLIENT_KEY = "client.crt", "client.key"
TOKEN = "token"
CLIENT_DIR = "client"


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM private key (unencrypted)."""

    cert_pem: bytes
    key_pem: bytes


def _new_key():  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    return bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))


def issue_ca(common_name: str = "gossamer CA", days: int = 3650) -> KeyPair:
    """A self-signed certificate authority."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_cert(ca: KeyPair, common_name: str, *, server: bool, sans: list[str] | tuple[str, ...] = (),
               days: int = 825) -> KeyPair:
    """A leaf certificate signed by `ca`.

    Args:
        ca: the issuing authority.
        common_name: subject CN (informational; names are checked against the SANs).
        server: True for a TLS server certificate, False for a client certificate (mTLS).
        sans: DNS names and IP addresses the server is reached at.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    key = _new_key()
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
                       critical=False)
    )
    names: list[x509.GeneralName] = []
    for san in dict.fromkeys(s for s in sans if s):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(san))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def cert_names(cert_pem: bytes) -> list[str]:
    """The DNS names and IP addresses a certificate is valid for."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*san.get_values_for_type(x509.DNSName), *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))]


def local_names() -> list[str]:
    """Names this machine is likely reached at: loopback, hostname, FQDN, its addresses."""
    names = ["localhost", "127.0.0.1", "::1"]
    for name in (socket.gethostname(), socket.getfqdn()):
        names.append(name)
        try:
            names += [str(info[4][0]) for info in socket.getaddrinfo(name, None)]
        except OSError:
            pass
    try:  # the address of the default route (connecting a UDP socket sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 9))
            names.append(str(s.getsockname()[0]))
    except OSError:
        pass
    return list(dict.fromkeys(n.split("%")[0] for n in names if n))


def write_private(path: Path, data: bytes) -> None:
    """Create `path` readable by its owner only (0600) from the first byte on."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class SecureDir:
    """What `init_secure_dir` left in a directory, and whether it created it just now."""

    root: Path
    created: bool
    server_names: list[str]

    @property
    def client_dir(self) -> Path:
        return self.root / CLIENT_DIR


def init_secure_dir(directory: str | os.PathLike[str], sans: list[str] | tuple[str, ...] = ()) -> SecureDir:
    """Create a CA, a server certificate, a client certificate and a join token in `directory`.

    Everything is written owner-only (files 0600, directories 0700). An existing complete set
    is kept as it is (a restarted coordinator keeps its keys), so this is safe to call on
    every start. A new set is issued only into an empty or missing directory.

    Args:
        directory: created if missing.
        sans: extra names or IP addresses the coordinator is reached at (the machine's own
            names and addresses are always included).

    Returns:
        The directory's layout; `client_dir` is what to copy to workers and users.

    Raises:
        ConfigError: `directory` holds some files but not the complete set (named).
    """
    root = Path(directory).expanduser().resolve()
    client = root / CLIENT_DIR
    wanted = [root / f for f in (CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY, TOKEN)] + \
             [client / f for f in (CA_CERT, CLIENT_CERT, CLIENT_KEY, TOKEN)]
    if all(p.is_file() for p in wanted):
        return SecureDir(root, False, cert_names((root / SERVER_CERT).read_bytes()))
    if root.exists() and any(root.iterdir()):
        # A new CA and token would lock out every worker holding the old ones: never silently.
        missing = [str(p) for p in wanted if not p.is_file()]
        raise ConfigError("secure", f"{root} holds part of a secure set-up but lacks {', '.join(missing)}; "
                                    "restore the missing file(s) from a backup, or move the directory away to "
                                    "issue a new CA and token (every worker then needs the new client files)")
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    client.mkdir(exist_ok=True, mode=0o700)
    os.chmod(root, 0o700)
    os.chmod(client, 0o700)
    names = list(dict.fromkeys([*sans, *local_names()]))
    ca = issue_ca()
    srv = issue_cert(ca, "gossamer coordinator", server=True, sans=names)
    cli = issue_cert(ca, "gossamer client", server=False)
    token = (generate_token() + "\n").encode()
    for path, data in [
        (root / CA_CERT, ca.cert_pem), (root / CA_KEY, ca.key_pem),
        (root / SERVER_CERT, srv.cert_pem), (root / SERVER_KEY, srv.key_pem), (root / TOKEN, token),
        (client / CA_CERT, ca.cert_pem), (client / CLIENT_CERT, cli.cert_pem), (client / CLIENT_KEY, cli.key_pem),
        (client / TOKEN, token),
    ]:
        write_private(path, data)
    return SecureDir(root, True, names)
