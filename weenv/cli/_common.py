"""Helpers shared by CLI modules: JSON output, errors as clean messages, sizes."""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console

F = TypeVar("F", bound=Callable[..., Any])

stderr = Console(stderr=True, highlight=False, soft_wrap=True)
stdout = Console(highlight=False, soft_wrap=True)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "mi": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
          "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4}


def parse_size(text: str | int) -> int:
    """Bytes from ``123``, ``"512MiB"``, ``"2GiB"``, ``"1.5G"``; ValueError naming the text otherwise."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    m = _SIZE.match(str(text))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or a unit such as 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


class SizeParam(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


SIZE = SizeParam()


def print_json(data: Any) -> None:
    """``data`` (builtins, or the client's ``_wire`` Structs) as indented JSON on stdout."""
    import msgspec

    sys.stdout.write(json.dumps(msgspec.to_builtins(data, enc_hook=str), indent=2, sort_keys=False, default=str) + "\n")


def unsqueezed(table: Any, console: Console | None = None) -> Any:
    """``table`` at the width its cells need, however narrow the terminal or pipe: rich would
    otherwise cut ids with an ellipsis and wrap sizes to fit (the terminal wraps long lines instead)."""
    from rich.measure import Measurement

    c = console or stdout
    table.width = Measurement.get(c, c.options.update_width(1 << 16), table).maximum
    return table


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def errors_to_exit(*error_types: type[BaseException]) -> Callable[[F], F]:
    """Turn the listed expected errors into ``weenv: error: …`` and exit status 1."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except error_types as e:
                raise click.ClickException(str(e)) from None

        return wrapper  # type: ignore[return-value]

    return deco
