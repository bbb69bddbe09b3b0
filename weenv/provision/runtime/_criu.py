"""Process-state capture: only the filesystem is captured by commit/fork; CRIU is probed, not used.

On this project's reference host CRIU 3.17 fails ``criu check`` (vDSO layout), so checkpointing
the process tree is not offered. :func:`criu_status` tells whether a host could support it.
"""

from __future__ import annotations

import shutil
import subprocess


def criu_status(timeout_s: float = 20.0) -> tuple[bool, str]:
    """(usable, reason): whether ``criu check`` passes on this host."""
    criu = shutil.which("criu")
    if criu is None:
        return False, "criu is not installed"
    try:
        r = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"criu check could not run: {e}"
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return False, f"criu check failed: {lines[-1] if lines else r.returncode}"
    return True, "criu check passed"
