"""Kubernetes resource quantities, read as the API server reads them.

The API server stores a quantity in its canonical form, so a node's `status.capacity` says `"1k"` for
1000 devices, `"16k"` for 16000 and `"1Ki"` for 1024: a reader that only takes plain digits loses every
count that is a multiple of 1000. The grammar is apimachinery's (`resource.ParseQuantity`): a signed
decimal number, then a binary suffix (Ki..Ei), a decimal suffix (n, u, m, k, M, G, T, P, E) or a
decimal exponent (e3, E-2).
"""

from __future__ import annotations

import re
from fractions import Fraction

_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<number>[0-9]+\.?[0-9]*|\.[0-9]+)"
    r"(?:[eE](?P<exponent>[+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?)"
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# Beyond this many decimal digits (either side of the point) a quantity counts nothing real, and building
# the number would cost more than the answer is worth (an exponent can ask for 10 to the two billionth).
MAX_DIGITS = 1000


def parse_quantity(text: str) -> Fraction | None:
    """The exact value of a quantity; None for text the API server would refuse, or absurdly large."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        return None
    whole, _, fraction = match["number"].partition(".")
    significant = (whole + fraction).lstrip("0")
    if not significant:
        return Fraction(0)
    if match["exponent"] is not None:
        power = match["exponent"].lstrip("+-").lstrip("0") or "0"
        if len(power) > len(str(MAX_DIGITS)):
            return None  # far beyond MAX_DIGITS either way (and too long for int() to read)
        exponent, binary = -int(power) if match["exponent"].startswith("-") else int(power), 0
    else:
        suffix = match["suffix"] or ""
        exponent, binary = _DECIMAL.get(suffix, 0), _BINARY.get(suffix, 0)
    exponent -= len(fraction)
    # The value has about this many digits before the point (the binary suffixes at 3 digits per 10 bits).
    magnitude = len(significant) + exponent + binary * 3 // 10
    if not -MAX_DIGITS <= magnitude <= MAX_DIGITS or len(significant) > MAX_DIGITS:
        return None
    value = Fraction(int(significant) * 2**binary) * Fraction(10) ** exponent
    return -value if match["sign"] == "-" else value


def whole_count(value: object) -> int | None:
    """A device count: the quantity rounded down to whole devices; None when it is no count at all
    (not a quantity, negative, absurdly large)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if not isinstance(value, str):
        return None
    parsed = parse_quantity(value)
    if parsed is None or parsed < 0:
        return None
    return int(parsed)
