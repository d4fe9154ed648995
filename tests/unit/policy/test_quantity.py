"""webhook.policy.quantity: resource quantities read as apimachinery's ParseQuantity reads them."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from webhook.policy.quantity import MAX_DIGITS, parse_quantity, whole_count


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8", 8),
        ("1k", 1000),
        ("16k", 16000),
        ("1Ki", 1024),
        ("2Mi", 2 * 2**20),
        ("1e3", 1000),
        ("1E3", 1000),
        ("1.5k", 1500),
        ("100m", Fraction(1, 10)),
        ("1500m", Fraction(3, 2)),
        ("5u", Fraction(5, 10**6)),
        ("1E", 10**18),  # the exa suffix, not an exponent
        ("1.", 1),
        (".5", Fraction(1, 2)),
        ("+5", 5),
        ("-1", -1),
        ("0", 0),
        ("0e99999999999", 0),
        ("9223372036854775808", 2**63),
        ("1e100", 10**100),
    ],
)
def test_every_form_the_api_server_accepts(text: str, value: Fraction | int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    "text", ["", "abc", "1 ", " 1", "1e", "1.5.3", "1Kb", "k", "1ki", "0x10", "1e9999999999"]
)
def test_what_is_no_quantity_or_beyond_any_count(text: str) -> None:
    assert parse_quantity(text) is None


@pytest.mark.parametrize(
    ("value", "count"),
    [
        ("1k", 1000),
        ("1.5", 1),
        ("999m", 0),
        ("100m", 0),
        (7, 7),
        ("-3", None),
        (-3, None),
        (True, None),
        (None, None),
    ],
)
def test_a_count_is_whole_devices_rounded_down(value: object, count: int | None) -> None:
    assert whole_count(value) == count


@given(st.integers(min_value=0, max_value=10**40))
def test_canonical_decimal_forms_read_back_as_the_number(number: int) -> None:
    """The API server writes a multiple of 1000 with a suffix: 1000 as "1k", 16000 as "16k"."""
    suffixes = ["", "k", "M", "G", "T", "P", "E"]
    exponent = 0
    mantissa = number
    while mantissa and mantissa % 1000 == 0 and exponent < len(suffixes) - 1:
        mantissa //= 1000
        exponent += 1
    assert whole_count(f"{mantissa}{suffixes[exponent]}") == number
    assert whole_count(f"{number}e0") == number


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]))
def test_binary_suffixes_are_powers_of_1024(mantissa: int, suffix: str) -> None:
    power = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"].index(suffix) + 1
    assert whole_count(f"{mantissa}{suffix}") == mantissa * 1024**power


@given(st.decimals(min_value=0, max_value=10**12, places=3, allow_nan=False, allow_infinity=False))
def test_decimals_round_down_to_whole_devices(number: object) -> None:
    text = str(number)
    assert whole_count(text) == int(Fraction(text))


@given(st.text(max_size=30))
def test_any_text_is_a_count_or_none_never_an_error(text: str) -> None:
    count = whole_count(text)
    assert count is None or count >= 0


def test_a_huge_exponent_costs_nothing_and_counts_nothing() -> None:
    assert parse_quantity(f"1e{MAX_DIGITS + 1}") is None
    assert parse_quantity("1e" + "9" * 5000) is None
    assert parse_quantity("1" * 5000) is None
    assert parse_quantity("1e-" + "0" * 5000 + "3") == Fraction(1, 1000)
    assert parse_quantity(f"1e{MAX_DIGITS - 1}") == 10 ** (MAX_DIGITS - 1)
