"""Certificates with `cryptography`: a small CA, serving and client certificates, the serving files, and
the pure decisions of the in-cluster certificate lifecycle (what the Secret must hold, when to rotate).

The API server only talks to webhooks over TLS and verifies the serving certificate against the
`caBundle` of the webhook configuration, so gpuguard can mint its own CA. Keys are ECDSA P-256:
small, fast to handshake and accepted by every supported Go TLS stack.

Rotation (`plan`, `advance`) never lets the API server meet a certificate it does not trust:
1. a new CA joins the bundle next to the old one, while the old serving certificate is still served;
2. once every API server has that bundle, a serving certificate from the new CA replaces the old one;
3. once every replica serves it, the old CA leaves the bundle.
Everything here takes the time as an argument and touches no network, so every decision is unit-tested.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from webhook.certs.files import (
    CA_FILE,
    CA_KEY_FILE,
    CERT_FILE,
    DEFAULT_ROTATION_DELAY,
    KEY_FILE,
    ServingFiles,
    serving_names,
)

# `gpuguard certs generate` and `serve --cert-dir`: files an operator manages, renewed by hand.
CA_VALIDITY = datetime.timedelta(days=365 * 5)
LEAF_VALIDITY = datetime.timedelta(days=365)
# Certificates start this long before they are issued, so a peer whose clock is a little behind still
# accepts them; `issued_at` relies on it to read the issuing time back from the certificate.
BACKDATE = datetime.timedelta(minutes=5)
# A bundle holds the CA in use and, during a rotation, the next one.
MAX_BUNDLE_CAS = 2


@dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_key(key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("expected an ECDSA private key")
    return key


def _public_der(key: ec.EllipticCurvePrivateKey | x509.Certificate) -> bytes:
    public = key.public_key()
    return public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


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


def _key_usage(*, signs_certificates: bool) -> x509.KeyUsage:
    """ECDSA keys only sign: handshakes (digital_signature) and, for a CA, certificates and CRLs."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        encipher_only=False,
        decipher_only=False,
    )


def new_ca(
    common_name: str = "gpuguard-ca",
    *,
    valid_for: datetime.timedelta = CA_VALIDITY,
    now: datetime.datetime | None = None,
) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    now = now or _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + valid_for)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs_certificates=True), critical=True)
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
    now: datetime.datetime | None = None,
) -> KeyPair:
    """Signs a leaf certificate with `ca`. Client certificates carry the user as CN and groups as O."""
    ca_cert = ca.certificate
    ca_key = load_key(ca.key_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    now = now or _now()
    eku = ExtendedKeyUsageOID.SERVER_AUTH if usage == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(now + valid_for, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
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


def write_serving_files(cert_dir: Path, ca_pem: bytes, serving: KeyPair) -> ServingFiles:
    """Writes the CA bundle (one or more PEM certificates), the serving certificate and its key."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    files = ServingFiles.in_dir(cert_dir, created=True)
    _write(files.ca, ca_pem)
    _write(files.key, serving.key_pem, private=True)
    _write(files.cert, serving.cert_pem)
    return files


def generate_serving_files(cert_dir: Path, sans: Sequence[str] = ()) -> ServingFiles:
    """A new CA (its key is kept as ca.key for re-issuing) and a serving certificate for `sans`."""
    names = serving_names(sans)
    ca = new_ca()
    serving = issue(ca, names[0], sans=names)
    files = write_serving_files(cert_dir, ca.cert_pem, serving)
    _write(cert_dir / CA_KEY_FILE, ca.key_pem, private=True)
    return files


# --- the in-cluster lifecycle: pure decisions over what the Secret holds --------------------------------


class InvalidMaterialError(ValueError):
    """The Secret's content is not a usable CA bundle, CA key and serving pair; the message says why."""


def parse_bundle(pem: bytes) -> list[x509.Certificate]:
    """The certificates of a PEM bundle, in order; raises ValueError when there are none."""
    return x509.load_pem_x509_certificates(pem)


def bundle_pem(certificates: Sequence[x509.Certificate]) -> bytes:
    return b"".join(cert.public_bytes(serialization.Encoding.PEM) for cert in certificates)


def names_of(cert: x509.Certificate) -> list[str]:
    """The certificate's DNS and IP subject alternative names, as strings."""
    try:
        extension = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    dns: list[str] = extension.get_values_for_type(x509.DNSName)
    ips = [str(ip) for ip in extension.get_values_for_type(x509.IPAddress)]
    return [*dns, *ips]


def covers(cert: x509.Certificate, names: Sequence[str]) -> bool:
    """True when the certificate is valid for every name (IP literals compared as addresses)."""
    have = {_canonical_name(name) for name in names_of(cert)}
    return all(_canonical_name(name) in have for name in names)


def _canonical_name(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name.lower()


def issued_at(cert: x509.Certificate) -> datetime.datetime:
    """When a certificate made by this module was issued (its start, minus the backdating)."""
    return cert.not_valid_before_utc + BACKDATE


def is_current(cert: x509.Certificate, now: datetime.datetime) -> bool:
    return cert.not_valid_before_utc <= now < cert.not_valid_after_utc


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


@dataclass(frozen=True)
class Schedule:
    """Lifetimes and the pace of a rotation. `rotation_delay` separates the three steps: long enough for
    every API server to see a patched caBundle, and every replica a changed Secret (both watch-driven,
    normally within a second)."""

    rotation_delay: datetime.timedelta = DEFAULT_ROTATION_DELAY
    ca_validity: datetime.timedelta = datetime.timedelta(days=365)
    leaf_validity: datetime.timedelta = datetime.timedelta(days=90)
    # A certificate is replaced once less than this share of its lifetime is left: months ahead, so a
    # cluster that was off for weeks still comes back to a valid certificate.
    renew_fraction: float = 1 / 3

    def renew_at(self, cert: x509.Certificate) -> datetime.datetime:
        start, end = issued_at(cert), cert.not_valid_after_utc
        return end - (end - start) * self.renew_fraction


Phase = Literal["steady", "trusting-new-ca", "serving-new-ca"]


@dataclass(frozen=True)
class Material:
    """What the Secret holds, checked: every replica serves `cert`, the API servers trust `ca_bundle`.

    Invariants (`check`): the bundle holds one or two CAs, oldest first; `ca_key` is the key of the newest,
    which signs new serving certificates; `cert` is signed by a CA of the bundle and matches `key`.
    """

    ca_bundle: bytes
    ca_key: bytes
    cert: bytes
    key: bytes

    SECRET_KEYS = (CA_FILE, CA_KEY_FILE, CERT_FILE, KEY_FILE)

    @classmethod
    def from_secret_data(cls, data: dict[str, bytes]) -> Material:
        """The Secret's decoded `data`; raises InvalidMaterialError naming what is missing or wrong."""
        missing = [key for key in cls.SECRET_KEYS if not data.get(key)]
        if missing:
            raise InvalidMaterialError(f"missing {', '.join(missing)}")
        material = cls(data[CA_FILE], data[CA_KEY_FILE], data[CERT_FILE], data[KEY_FILE])
        material.check()
        return material

    def secret_data(self) -> dict[str, bytes]:
        return dict(zip(self.SECRET_KEYS, (self.ca_bundle, self.ca_key, self.cert, self.key), strict=True))

    @cached_property
    def cas(self) -> list[x509.Certificate]:
        return parse_bundle(self.ca_bundle)

    @cached_property
    def leaf(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert)

    @property
    def newest_ca(self) -> x509.Certificate:
        return self.cas[-1]

    @property
    def signer(self) -> KeyPair:
        """The newest CA with its key: what issues the next serving certificate."""
        return KeyPair(self.newest_ca.public_bytes(serialization.Encoding.PEM), self.ca_key)

    @property
    def serving(self) -> KeyPair:
        return KeyPair(self.cert, self.key)

    @property
    def phase(self) -> Phase:
        if len(self.cas) == 1:
            return "steady"
        return "serving-new-ca" if signed_by(self.leaf, self.newest_ca) else "trusting-new-ca"

    def check(self) -> None:
        try:
            cas, leaf = self.cas, self.leaf
            ca_key, key = load_key(self.ca_key), load_key(self.key)
        except ValueError as exc:
            raise InvalidMaterialError(f"unreadable: {exc}") from exc
        if not 1 <= len(cas) <= MAX_BUNDLE_CAS:
            raise InvalidMaterialError(
                f"ca.crt holds {len(cas)} certificates, expected 1 to {MAX_BUNDLE_CAS}"
            )
        for ca in cas:
            try:
                is_ca = ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
            except x509.ExtensionNotFound:
                is_ca = False
            if not is_ca:
                raise InvalidMaterialError(f"ca.crt holds {ca.subject.rfc4514_string()}, which is not a CA")
        if _public_der(ca_key) != _public_der(cas[-1]):
            raise InvalidMaterialError("ca.key is not the key of the newest CA in ca.crt")
        if _public_der(key) != _public_der(leaf):
            raise InvalidMaterialError("tls.key is not the key of tls.crt")
        if not any(signed_by(leaf, ca) for ca in cas):
            raise InvalidMaterialError("tls.crt is not signed by a CA in ca.crt")


Action = Literal["create", "renew", "begin-rotation", "serve-new-ca", "finish-rotation"]


@dataclass(frozen=True)
class Plan:
    """What to do with the Secret now (`action`), or nothing until `due`; `reason` is for the log."""

    action: Action | None
    reason: str
    due: datetime.datetime


def plan(
    material: Material | None, *, now: datetime.datetime, names: Sequence[str], schedule: Schedule
) -> Plan:
    """The next step of the lifecycle. Deterministic, so replicas looking at the same Secret agree, and
    the one whose write lands first (optimistic concurrency) does it for all."""
    if material is None:
        return Plan("create", "no valid certificate yet", now)
    ca, leaf = material.newest_ca, material.leaf
    if now >= ca.not_valid_after_utc:
        # Nothing it signed can be trusted any more: an overlap would protect nothing, start over.
        return Plan("create", f"the CA expired at {ca.not_valid_after_utc}", now)
    if now >= leaf.not_valid_after_utc:
        return Plan("renew", f"the serving certificate expired at {leaf.not_valid_after_utc}", now)
    phase = material.phase
    if phase == "trusting-new-ca":
        due = issued_at(ca) + schedule.rotation_delay
        return Plan("serve-new-ca" if now >= due else None, "rotation: the API servers learn the new CA", due)
    if phase == "serving-new-ca":
        due = issued_at(leaf) + schedule.rotation_delay
        return Plan(
            "finish-rotation" if now >= due else None, "rotation: replicas load the new certificate", due
        )
    if now >= schedule.renew_at(ca):
        return Plan("begin-rotation", f"the CA expires at {ca.not_valid_after_utc}", now)
    if now >= schedule.renew_at(leaf):
        return Plan("renew", f"the serving certificate expires at {leaf.not_valid_after_utc}", now)
    if not covers(leaf, names):
        return Plan("renew", f"the serving certificate does not name all of {', '.join(names)}", now)
    due = min(schedule.renew_at(ca), schedule.renew_at(leaf))
    return Plan(None, f"valid until {leaf.not_valid_after_utc}", due)


def _ca_name(now: datetime.datetime) -> str:
    # The issuing time in the subject tells CAs apart in `openssl x509 -subject` during a rotation.
    return f"gpuguard-ca-{now:%Y%m%dT%H%M%SZ}"


def create(*, names: Sequence[str], schedule: Schedule, now: datetime.datetime) -> Material:
    """A fresh CA and serving certificate, nothing carried over."""
    ca = new_ca(_ca_name(now), valid_for=schedule.ca_validity, now=now)
    serving = issue(ca, names[0], sans=names, valid_for=schedule.leaf_validity, now=now)
    return Material(ca.cert_pem, ca.key_pem, serving.cert_pem, serving.key_pem)


def begin_rotation(material: Material, *, schedule: Schedule, now: datetime.datetime) -> Material:
    """Step 1: a new CA joins the bundle and signs from now on; the serving certificate stays."""
    if material.phase != "steady":
        raise InvalidMaterialError(f"a rotation is already in progress ({material.phase})")
    ca = new_ca(_ca_name(now), valid_for=schedule.ca_validity, now=now)
    bundle = bundle_pem([*material.cas, ca.certificate])
    return Material(bundle, ca.key_pem, material.cert, material.key)


def renew(
    material: Material, *, names: Sequence[str], schedule: Schedule, now: datetime.datetime
) -> Material:
    """A new serving certificate from the newest CA (step 2 of a rotation, or a plain renewal). Its names
    are the old certificate's plus `names`: replicas started with different names never undo each other."""
    all_names = list(dict.fromkeys([*names, *names_of(material.leaf)]))
    serving = issue(material.signer, all_names[0], sans=all_names, valid_for=schedule.leaf_validity, now=now)
    return Material(material.ca_bundle, material.ca_key, serving.cert_pem, serving.key_pem)


def finish_rotation(material: Material) -> Material:
    """Step 3: only the newest CA stays trusted."""
    return Material(bundle_pem([material.newest_ca]), material.ca_key, material.cert, material.key)


def advance(
    material: Material | None,
    action: Action,
    *,
    names: Sequence[str],
    schedule: Schedule,
    now: datetime.datetime,
) -> Material:
    """The Secret's next content for `action` (from `plan`)."""
    if material is None or action == "create":
        return create(names=names, schedule=schedule, now=now)
    if action == "begin-rotation":
        return begin_rotation(material, schedule=schedule, now=now)
    if action in ("renew", "serve-new-ca"):
        return renew(material, names=names, schedule=schedule, now=now)
    return finish_rotation(material)
