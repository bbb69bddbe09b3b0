"""The escape probe (escape_probe.c, next to this file) that tests/test_escape.py and
benchmarks/exec_hijack.py run as root inside an env, and the reading of its output."""

from __future__ import annotations

import os

#: C source of the probe; build it static (``gcc -static -O1 -o probe PROBE_SOURCE``).
PROBE_SOURCE = os.path.join(os.path.dirname(__file__), "escape_probe.c")


def attempts(log: str) -> dict[str, str]:
    """``attempt -> result`` from the probe's output (result "SUCCEEDED" or an strerror)."""
    out = {}
    for line in log.splitlines():
        name, sep, result = line.rpartition(": ")
        if sep and not line.startswith(("serving", "answered")):
            out[name.split(" (")[0]] = result
    return out
