"""resource.Quantity as kubeloop needs it: parse a quantity into an integer number of units (as
Quantity.Value() rounds), and write a byte count the way the API server canonicalises it."""

from __future__ import annotations

import functools
import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation

_SUFFIXES: dict[str, Decimal] = {
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?)$")


@functools.lru_cache(maxsize=1024)
def _parse_quantity_text(text: str) -> int:
    m = _QUANTITY.match(text.strip())
    if not m:
        return 0
    number, exponent, suffix = m.groups()
    try:
        value = Decimal(number)
        value *= Decimal(f"1{exponent}") if exponent else _SUFFIXES[suffix or ""]
    except InvalidOperation:
        return 0
    return int(value.to_integral_value(ROUND_CEILING))


def parse_quantity(text: str | int | float | None) -> int:
    """A resource.Quantity as an integer number of units, rounded up as Quantity.Value() does.
    An empty or malformed quantity counts as 0 (the apiserver never stores one)."""
    if text is None:
        return 0
    if isinstance(text, int | float):
        return int(Decimal(str(text)).to_integral_value(ROUND_CEILING))
    # Every cached volume and claim says "1Gi" or the like: parse each distinct text once.
    return _parse_quantity_text(text)


def format_quantity(n: int) -> str:
    """Bytes as a binary-SI Quantity string, as the API server would canonicalise it."""
    for suffix, shift in (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)
