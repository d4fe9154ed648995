"""`gpuguard certs generate`: the files, refusing to replace a CA by accident, names checked first."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.harness import REPO_ROOT
from tests.harness.manifests import Gpuguard
from webhook.certs import files as certfiles
from webhook.certs import tls


def test_certs_generate_for_a_service(gpuguard: Gpuguard, tmp_path: Path) -> None:
    run = gpuguard("certs", "generate", "--service", "gpuguard", "--namespace", "gpuguard", "--dir", "certs")
    assert run.code == 0
    assert (
        run.out
        == "wrote certs/ca.crt, certs/tls.crt and certs/tls.key (CA valid 1825 days, serving certificate 365 days)\n"
    )

    cert_dir = tmp_path / "certs"
    cert = x509.load_pem_x509_certificate((cert_dir / "tls.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((cert_dir / "ca.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns_names = set(sans.get_values_for_type(x509.DNSName))
    assert {
        "gpuguard",
        "gpuguard.gpuguard",
        "gpuguard.gpuguard.svc",
        "gpuguard.gpuguard.svc.cluster.local",
    } <= dns_names
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert stat.S_IMODE((cert_dir / "tls.key").stat().st_mode) == 0o600


def test_an_existing_ca_is_replaced_only_with_force(gpuguard: Gpuguard, tmp_path: Path) -> None:
    assert gpuguard("certs", "generate").code == 0
    ca = (tmp_path / "certs" / "ca.crt").read_bytes()
    refused = gpuguard("certs", "generate", "--san", "webhook.example.com")
    assert refused.code == 2
    assert refused.err == (
        "gpuguard: certs/ca.crt exists: a new CA would replace the one every caBundle and client trusts;"
        " pass --force to replace it, or --dir for another folder\n"
    )
    assert (tmp_path / "certs" / "ca.crt").read_bytes() == ca
    forced = gpuguard("certs", "generate", "--force", "--san", "webhook.example.com")
    assert forced.code == 0
    assert (tmp_path / "certs" / "ca.crt").read_bytes() != ca


@pytest.mark.parametrize(
    "name",
    ["https://gpuguard.example.com", "gpuguard:8443", "two words", "-leading.hyphen", "a..b", "", "x" * 64],
)
def test_a_bad_san_is_refused_before_anything_is_written(
    gpuguard: Gpuguard, tmp_path: Path, name: str
) -> None:
    run = gpuguard("certs", "generate", f"--san={name}")
    assert run.code == 2
    assert f"argument --san: {name!r} is neither an IP address nor a DNS name" in run.err
    assert not (tmp_path / "certs").exists()


@pytest.mark.parametrize(
    "name", ["gpuguard.example.com", "*.example.com", "10.0.0.7", "::1", "localhost", "A-1"]
)
def test_good_sans_pass(name: str) -> None:
    assert certfiles.check_subject_name(name) == name


def test_the_readme_gives_both_modes_lifetimes() -> None:
    readme = " ".join((REPO_ROOT / "docs" / "install.md").read_text().split())
    assert (tls.CA_VALIDITY.days, tls.LEAF_VALIDITY.days) == (5 * 365, 365)
    assert (tls.Schedule().ca_validity.days, tls.Schedule().leaf_validity.days) == (365, 90)
    assert (
        "`gpuguard certs generate` and `serve --cert-dir`: the CA lives 5 years, the serving certificate 1 year"
        in readme
    )
    assert "The CA lives a year, the serving certificate 90 days" in readme
