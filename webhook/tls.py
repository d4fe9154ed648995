"""Certificates with `cryptography`: a small CA, serving and client certificates, and the serving files.

The API server only talks to webhooks over TLS and verifies the serving certificate against the
`caBundle` of the webhook configuration, so gpuguard can mint its own CA. Keys are ECDSA P-256:
small, fast to handshake and accepted by every supported Go TLS stack.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
DEFAULT_SANS = ("localhost", "127.0.0.1")
CA_VALIDITY = datetime.timedelta(days=365 * 5)
LEAF_VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


@dataclass(frozen=True)
class ServingFiles:
    ca: Path
    cert: Path
    key: Path
    created: bool


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def subject_alternative_names(names: Sequence[str]) -> list[x509.GeneralName]:
    """IP literals become IP SANs (Go's TLS client ignores the CN and needs them), the rest DNS SANs."""
    result: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            result.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            result.append(x509.DNSName(name))
    return result


def new_ca(common_name: str = "gpuguard-ca", *, valid_for: datetime.timedelta = CA_VALIDITY) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + valid_for)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(
    ca: KeyPair,
    common_name: str,
    *,
    sans: Sequence[str] = (),
    organizations: Sequence[str] = (),
    usage: Literal["server", "client"] = "server",
    valid_for: datetime.timedelta = LEAF_VALIDITY,
) -> KeyPair:
    """Signs a leaf certificate with `ca`. Client certificates carry the user as CN and groups as O."""
    ca_cert = ca.certificate
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key must be an ECDSA key")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    eku = ExtendedKeyUsageOID.SERVER_AUTH if usage == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + valid_for, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(subject_alternative_names(sans)), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    # Write-then-rename so a server reloading the files never reads half a certificate.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    if private:
        os.chmod(tmp, 0o600)
    tmp.replace(path)


def write_serving_files(cert_dir: Path, ca: KeyPair, serving: KeyPair) -> ServingFiles:
    cert_dir.mkdir(parents=True, exist_ok=True)
    files = ServingFiles(cert_dir / CA_FILE, cert_dir / CERT_FILE, cert_dir / KEY_FILE, created=True)
    _write(files.ca, ca.cert_pem)
    _write(files.key, serving.key_pem, private=True)
    _write(files.cert, serving.cert_pem)
    return files


def generate_serving_files(cert_dir: Path, sans: Sequence[str] = ()) -> ServingFiles:
    """A new CA (its key is kept as ca.key for re-issuing) and a serving certificate for `sans`."""
    names = [*DEFAULT_SANS, *sans]
    ca = new_ca()
    serving = issue(ca, names[0], sans=names)
    files = write_serving_files(cert_dir, ca, serving)
    _write(cert_dir / "ca.key", ca.key_pem, private=True)
    return files


def ensure_serving_files(cert_dir: Path, sans: Sequence[str] = ()) -> ServingFiles:
    """Reuses the files in `cert_dir` when they exist, otherwise generates them."""
    existing = ServingFiles(cert_dir / CA_FILE, cert_dir / CERT_FILE, cert_dir / KEY_FILE, created=False)
    if existing.cert.is_file() and existing.key.is_file():
        return existing
    return generate_serving_files(cert_dir, sans)


def dns_names_for_service(service: str, namespace: str) -> list[str]:
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]
