"""Certificates: what `certs generate` writes, what the Secret must hold, when the lifecycle acts, and that
a rotation never presents the API server a certificate it does not trust. Times are given, not read from
the clock, so every decision is checked at the instant it flips. A certificate switched under a serving
socket is tests/integration/test_serving_certificate.py's."""

from __future__ import annotations

import datetime
import ipaddress
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from webhook import cli
from webhook.certs import files, tls

T0 = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
SCHEDULE = tls.Schedule(
    rotation_delay=datetime.timedelta(minutes=5),
    ca_validity=datetime.timedelta(days=365),
    leaf_validity=datetime.timedelta(days=90),
)
SERVICE_NAMES = tuple(files.serving_names(files.dns_names_for_service("gpuguard", "gpuguard")))
SECOND = datetime.timedelta(seconds=1)


def fresh(now: datetime.datetime = T0, names: tuple[str, ...] = SERVICE_NAMES) -> tls.Material:
    return tls.create(names=names, schedule=SCHEDULE, now=now)


def common_name(cert: x509.Certificate) -> str:
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def trusted(leaf: x509.Certificate, bundle: tls.Material) -> bool:
    return any(tls.signed_by(leaf, ca) for ca in bundle.cas)


# --- certs generate ------------------------------------------------------------------------------------


def test_certs_generate_names_the_service_and_ips(tmp_path: Path) -> None:
    code = cli.main(
        [
            "certs",
            "generate",
            "--dir",
            str(tmp_path),
            "--service",
            "gpuguard",
            "--namespace",
            "gpu-system",
            "--san",
            "10.96.0.42",
            "--san",
            "webhook.example.com",
        ]
    )

    assert code == 0
    cert = x509.load_pem_x509_certificate((tmp_path / files.CERT_FILE).read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [
        "gpuguard",
        "gpuguard.gpu-system",
        "gpuguard.gpu-system.svc",
        "gpuguard.gpu-system.svc.cluster.local",
        "webhook.example.com",
        "localhost",
    ]
    # IP SANs are IP entries, not DNS names: Go's TLS client checks an IP URL only against those.
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.96.0.42"),
        ipaddress.ip_address("127.0.0.1"),
    ]
    assert common_name(cert) == "gpuguard"
    ca = x509.load_pem_x509_certificate((tmp_path / files.CA_FILE).read_bytes())
    assert tls.signed_by(cert, ca)
    assert (tmp_path / files.CA_KEY_FILE).stat().st_mode & 0o077 == 0
    assert (tmp_path / files.KEY_FILE).stat().st_mode & 0o077 == 0


def test_certificates_start_backdated_and_report_their_issuing_time() -> None:
    material = fresh()

    assert material.leaf.not_valid_before_utc == T0 - tls.BACKDATE
    assert tls.issued_at(material.leaf) == T0
    assert tls.issued_at(material.newest_ca) == T0
    assert material.leaf.not_valid_after_utc == T0 + SCHEDULE.leaf_validity
    assert tls.covers(material.leaf, ["GPUGUARD.gpuguard.svc", "127.0.0.1"])
    assert not tls.covers(material.leaf, ["gpuguard.other.svc"])


# --- what the Secret must hold -------------------------------------------------------------------------


def test_secret_data_round_trips() -> None:
    material = fresh()

    again = tls.Material.from_secret_data(material.secret_data())

    assert again == material
    assert set(material.secret_data()) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
    assert again.phase == "steady"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ca.key": b""}, "missing ca.key"),
        ({"tls.crt": b"not a certificate"}, "unreadable"),
        ({"ca.key": fresh().ca_key}, "ca.key is not the key of the newest CA"),
        ({"tls.key": fresh().key}, "tls.key is not the key of tls.crt"),
        ({"tls.crt": fresh().cert, "tls.key": fresh().key}, "not a CA"),
    ],
    ids=["missing-key", "garbage", "foreign-ca-key", "foreign-leaf-key", "leaf-as-ca"],
)
def test_unusable_secret_data_is_refused_with_the_reason(change: dict[str, bytes], message: str) -> None:
    data = fresh().secret_data() | change
    if message == "not a CA":
        # A leaf certificate where the CA bundle belongs.
        data["ca.crt"] = fresh().cert
    with pytest.raises(tls.InvalidMaterialError, match=message):
        tls.Material.from_secret_data(data)


def test_a_serving_certificate_from_an_untrusted_ca_is_refused() -> None:
    material, stranger = fresh(), fresh()
    data = material.secret_data() | {"tls.crt": stranger.cert, "tls.key": stranger.key}

    with pytest.raises(tls.InvalidMaterialError, match=r"not signed by a CA in ca\.crt"):
        tls.Material.from_secret_data(data)


def test_a_bundle_of_three_cas_is_refused() -> None:
    material = fresh()
    extra = [tls.new_ca(now=T0).certificate, tls.new_ca(now=T0).certificate]
    data = material.secret_data() | {"ca.crt": tls.bundle_pem([*extra, material.newest_ca])}

    with pytest.raises(tls.InvalidMaterialError, match="holds 3 certificates"):
        tls.Material.from_secret_data(data)


# --- when the lifecycle acts ---------------------------------------------------------------------------


def plan(
    material: tls.Material | None, now: datetime.datetime, names: tuple[str, ...] = SERVICE_NAMES
) -> tls.Plan:
    return tls.plan(material, now=now, names=names, schedule=SCHEDULE)


def test_nothing_in_the_secret_means_create() -> None:
    assert plan(None, T0).action == "create"


def test_a_fresh_certificate_waits_until_the_serving_certificate_is_due() -> None:
    material = fresh()
    leaf_due = T0 + SCHEDULE.leaf_validity * (1 - SCHEDULE.renew_fraction)

    waiting = plan(material, T0 + SECOND)

    assert waiting.action is None
    assert waiting.due == SCHEDULE.renew_at(material.leaf) == leaf_due
    assert plan(material, leaf_due - SECOND).action is None
    assert plan(material, leaf_due).action == "renew"


def test_renewal_keeps_the_ca_and_issues_from_it() -> None:
    material = fresh()
    now = SCHEDULE.renew_at(material.leaf)

    renewed = tls.advance(material, "renew", names=SERVICE_NAMES, schedule=SCHEDULE, now=now)

    assert renewed.ca_bundle == material.ca_bundle
    assert renewed.leaf != material.leaf
    assert tls.signed_by(renewed.leaf, material.newest_ca)
    assert plan(renewed, now + SECOND).action is None


def test_the_ca_is_rotated_when_a_third_of_its_life_is_left() -> None:
    material = fresh()
    ca_due = T0 + SCHEDULE.ca_validity * (1 - SCHEDULE.renew_fraction)
    # Keep the serving certificate young, so only the CA is due.
    material = tls.advance(material, "renew", names=SERVICE_NAMES, schedule=SCHEDULE, now=ca_due - SECOND)

    assert plan(material, ca_due - SECOND).action is None
    assert plan(material, ca_due).action == "begin-rotation"


def test_expired_certificates_are_replaced_at_once() -> None:
    material = fresh()

    assert plan(material, material.leaf.not_valid_after_utc).action == "renew"
    assert plan(material, material.newest_ca.not_valid_after_utc).action == "create"


def test_a_certificate_missing_a_name_is_renewed_with_old_and_new_names() -> None:
    material = fresh(names=("gpuguard", "127.0.0.1"))
    wanted = ("gpuguard", "gpuguard.gpuguard.svc")

    assert plan(material, T0 + SECOND, wanted).action == "renew"
    renewed = tls.advance(material, "renew", names=wanted, schedule=SCHEDULE, now=T0 + SECOND)

    # Replicas started with different names (a rolling upgrade) then agree instead of taking turns.
    assert tls.covers(renewed.leaf, [*wanted, "127.0.0.1"])
    assert plan(renewed, T0 + 2 * SECOND, ("gpuguard", "127.0.0.1")).action is None
    assert plan(renewed, T0 + 2 * SECOND, wanted).action is None


def rotation(start: datetime.datetime) -> Iterator[tuple[datetime.datetime, tls.Material]]:
    """Each Secret content of a rotation begun at `start`, with the instant it was written."""
    # A CA 300 days old (due: a third of 365 days is left) with a serving certificate issued just now.
    material = fresh(start - datetime.timedelta(days=300))
    material = tls.advance(material, "renew", names=SERVICE_NAMES, schedule=SCHEDULE, now=start - SECOND)
    now = start
    yield now - SECOND, material
    for expected in ("begin-rotation", "serve-new-ca", "finish-rotation"):
        step = plan(material, now)
        while step.action is None:  # jump to when the step falls due, as the replicas' timers do
            assert step.due > now
            now = step.due
            step = plan(material, now)
        assert step.action == expected
        material = tls.advance(material, step.action, names=SERVICE_NAMES, schedule=SCHEDULE, now=now)
        yield now, material


def test_a_rotation_takes_three_steps_a_delay_apart() -> None:
    start = T0 + datetime.timedelta(days=300)
    steps = list(rotation(start))

    phases = [material.phase for _, material in steps]
    assert phases == ["steady", "trusting-new-ca", "serving-new-ca", "steady"]
    times = [when for when, _ in steps[1:]]
    assert times == [start, start + SCHEDULE.rotation_delay, start + 2 * SCHEDULE.rotation_delay]
    old, new = steps[0][1], steps[-1][1]
    assert old.newest_ca not in new.cas
    assert len(new.cas) == 1
    assert tls.signed_by(new.leaf, new.newest_ca)
    assert plan(new, times[-1] + SECOND).action is None


def test_no_step_of_a_rotation_serves_a_certificate_the_previous_bundle_does_not_trust() -> None:
    # The API servers learn a bundle moments after the Secret changes, and replicas learn a certificate
    # moments after: across each step, an API server or a replica one step behind must still agree.
    steps = [material for _, material in rotation(T0 + datetime.timedelta(days=300))]
    for before, after in itertools.pairwise(steps):
        assert trusted(after.leaf, before), f"{before.phase} -> {after.phase}: new certificate untrusted"
        assert trusted(before.leaf, after), f"{before.phase} -> {after.phase}: old certificate untrusted"


def test_a_second_rotation_is_refused_while_one_is_under_way() -> None:
    material = tls.begin_rotation(fresh(), schedule=SCHEDULE, now=T0)

    with pytest.raises(tls.InvalidMaterialError, match="already in progress"):
        tls.begin_rotation(material, schedule=SCHEDULE, now=T0 + SECOND)
