"""Process-state capture for crun envs: CRIU is probed, not used (yet).

Memory snapshots of crun envs need CRIU >= 4.1 (Debian's 3.17 fails ``criu check`` on kernels >=
6.13: vDSO layout). weenv has no CRIU checkpoint for crun envs yet, so a crun env asked for a
memory snapshot is refused with :func:`crun_memory_reason`, which says what this host's CRIU is;
gVisor envs have them (:mod:`._checkpoint`).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess

#: The first CRIU release that checkpoints runc-style containers on current kernels.
CRIU_MIN_VERSION = (4, 1)


def criu_status(timeout_s: float = 20.0) -> tuple[bool, str]:
    """(usable, reason): whether ``criu check`` passes on this host."""
    criu = shutil.which("criu")
    if criu is None:
        return False, "criu is not installed"
    try:
        r = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"criu check could not run: {e}"
    lines = (r.stderr or r.stdout).strip().splitlines()
    # criu 3.17 exits 0 from a failed check: its "Error" lines say so
    errors = [line for line in lines if line.startswith("Error")]
    if r.returncode != 0 or errors:
        return False, f"criu check failed: {(errors or lines or [str(r.returncode)])[-1]}"
    return True, "criu check passed"


def criu_version(timeout_s: float = 10.0) -> tuple[int, ...] | None:
    """CRIU's version as numbers (``criu --version``: "Version: 3.17.1"), None when it is not installed."""
    criu = shutil.which("criu")
    if criu is None:
        return None
    try:
        out = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Version:\s*(\d+(?:\.\d+)*)", out)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


@functools.lru_cache(maxsize=1)
def crun_memory_reason() -> str:
    """Why this node cannot snapshot a crun env's memory (said in the 409 of a park, commit or
    fork with memory); probed once per daemon."""
    version = criu_version()
    shown = ".".join(map(str, version)) if version else ""
    need = "memory snapshots need gVisor (runtime = \"gvisor\") or CRIU >= " + ".".join(map(str, CRIU_MIN_VERSION))
    if version is None:
        return f"{need} (CRIU is not installed)"
    ok, why = criu_status()
    if version < CRIU_MIN_VERSION:
        return f"{need} (found CRIU {shown}: {why if not ok else 'too old for this kernel'})"
    if not ok:
        return f"{need} (found CRIU {shown}, but {why})"
    return f"{need} (found CRIU {shown}, which works, but weenv does not checkpoint crun envs with it yet)"
