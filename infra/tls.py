"""Certificates for the local secure infrastructure (`sluice infra up --secure`).

One private certificate authority signs a server certificate for 127.0.0.1
and localhost (the Kafka broker and PostgreSQL present it; the broker also
uses it as its own client certificate between its listeners) and a client
certificate for mutual TLS. Made with `cryptography`, as PEM files in the
state directory, once; later starts reuse them. Keys are readable by their
owner only.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

VALID_DAYS = 825
BROKER_CN = "sluice-broker"  # the broker's principal between its own listeners
CLIENT_CN = "sluice-client"  # the principal of the mutual-TLS client certificate


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files under `<state>/tls/`."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server.key"

    @property
    def client_cert(self) -> Path:
        return self.root / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.root / "client.key"

    def complete(self) -> bool:
        return all(p.is_file() for p in (self.ca_cert, self.ca_key, self.server_cert,
                                          self.server_key, self.client_cert, self.client_key))


def ensure_tls(state_dir: Path) -> TlsFiles:
    """The local CA and its certificates, made on first use."""
    files = TlsFiles(state_dir / "tls")
    if files.complete():
        return files
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    files.root.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sluice local CA")])
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key, server_cert = _leaf(ca_key, ca_cert, BROKER_CN, now, server=True)
    client_key, client_cert = _leaf(ca_key, ca_cert, CLIENT_CN, now, server=False)
    _write(files.ca_key, _key_pem(ca_key), secret=True)
    _write(files.server_key, _key_pem(server_key), secret=True)
    _write(files.client_key, _key_pem(client_key), secret=True)
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    _write(files.server_cert, server_cert.public_bytes(serialization.Encoding.PEM) + ca_pem)
    _write(files.client_cert, client_cert.public_bytes(serialization.Encoding.PEM) + ca_pem)
    _write(files.ca_cert, ca_pem)  # last: its presence says the set is complete
    return files


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str,
          now: dt.datetime, *, server: bool
          ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    # The broker's certificate also identifies it as a client between its own listeners.
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server \
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"),
        ]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    # PKCS#8, unencrypted: what Kafka's PEM key store and PostgreSQL both read.
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, secret: bool = False) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    tmp.replace(path)
