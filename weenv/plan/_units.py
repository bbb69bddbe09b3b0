"""Sizes ("512MiB", "1.5G") and core counts, parsed without floating-point surprises."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Written without inline flags so that the same text is a valid JSON Schema (ECMA-262) pattern.
SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([KkMmGgTt][Ii]?[Bb]?|[Bb])?\s*$"
_SIZE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[KkMmGgTt][Ii]?[Bb]?|[Bb])?\s*$")
_UNIT_BYTES = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}
_BINARY_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2GiB"``, ``"1.5G"``, ``"4096"``.

    Units are case-insensitive; ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB`` are powers
    of 1000 and ``Ki``/``KiB`` … ``Ti``/``TiB`` powers of 1024. The result must be a whole number of
    bytes. Raises ValueError naming the text.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r} (use bytes or a string such as '512MiB', '2GiB')")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r} (use bytes or a string such as '512MiB', '2GiB')")
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"not a size: {value!r} (use bytes or a string such as '512MiB', '2GiB')")
    try:
        exact = Decimal(m["number"]) * _UNIT_BYTES[(m["unit"] or "").lower()]
    except (InvalidOperation, KeyError):  # pragma: no cover - the pattern admits only these
        raise ValueError(f"not a size: {value!r}") from None
    if exact != exact.to_integral_value():
        raise ValueError(f"not a whole number of bytes: {value!r}")
    return int(exact)


def format_size(size_bytes: int) -> str | int:
    """``"2GiB"`` when a binary unit divides the size exactly, else the plain byte count."""
    for unit, factor in _BINARY_UNITS:
        if size_bytes and size_bytes % factor == 0:
            return f"{size_bytes // factor}{unit}"
    return size_bytes


def human_size(size_bytes: int) -> str:
    """A size for messages: ``"2GiB"`` or ``"123 bytes"``."""
    text = format_size(size_bytes)
    return text if isinstance(text, str) else f"{text} bytes"


def parse_cores(value: float | int | str) -> float:
    """A positive core count from ``0.5``, ``2`` or ``"0.25"``; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a number of cores: {value!r}")
    try:
        cores = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"not a number of cores: {value!r}") from None
    if not cores > 0 or cores == float("inf"):
        raise ValueError(f"a number of cores must be above 0, got {value!r}")
    return cores


def _split_range(value: str) -> tuple[str, str]:
    low, sep, high = value.partition("-")
    if not sep:
        return value, value
    return low, high


def parse_cpu_range(value: float | int | str | tuple[float, float]) -> tuple[float, float]:
    """``(min, max)`` cores from ``0.5`` / ``"0.5"`` (both bounds) or ``"0.25-2"`` / ``(0.25, 2)``."""
    if isinstance(value, tuple):
        low, high = value
    elif isinstance(value, str):
        low, high = _split_range(value.strip())
    else:
        low = high = value
    try:
        return parse_cores(low), parse_cores(high)
    except ValueError as e:
        raise ValueError(f"{e} (use cores such as 0.5, or a range such as 0.25-2)") from None


def parse_memory_range(value: int | str | tuple[int | str, int | str]) -> tuple[int, int]:
    """``(min, max)`` bytes from ``"1GiB"`` / ``1073741824`` (both bounds) or ``"512MiB-2GiB"``."""
    if isinstance(value, tuple):
        low, high = value
    elif isinstance(value, str):
        low, high = _split_range(value.strip())
    else:
        low = high = value
    try:
        return parse_size(low), parse_size(high)
    except ValueError as e:
        raise ValueError(f"{e} (use a size such as 1GiB, or a range such as 512MiB-2GiB)") from None
