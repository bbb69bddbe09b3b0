"""The escape probes (escape_probe.c and escape_probe_doors.c, next to this file) that
tests/test_escape.py and benchmarks/exec_hijack.py run as root inside an env, the reading of
their output, and the plan with shipped device nodes the suite starts its envs from."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

#: C source of the exec-channel probe; build it static (``gcc -static -O1 -o probe PROBE_SOURCE``).
PROBE_SOURCE = os.path.join(os.path.dirname(__file__), "escape_probe.c")
#: C source of the probe of every other door (host files, mounts, devices, sockets, bombs...).
DOORS_SOURCE = os.path.join(os.path.dirname(__file__), "escape_probe_doors.c")

#: Device nodes the device plan's layer ships under /opt/devices: name -> (kind, major, minor).
SHIPPED_DEVICES = {"kmsg": (stat.S_IFCHR, 1, 11), "loop0": (stat.S_IFBLK, 7, 0)}


def attempts(log: str) -> dict[str, str]:
    """``attempt -> result`` from the probe's output (result "SUCCEEDED" or an strerror)."""
    out = {}
    for line in log.splitlines():
        name, sep, result = line.rpartition(": ")
        if sep and not line.startswith(("serving", "answered")):
            out[name.split(" (")[0]] = result
    return out


def device_plan(home: str, name: str = "devices", devices: dict[str, tuple[int, int, int]] | None = None) -> str:
    """Publish a busybox os group whose layer ships 0666 device nodes (``SHIPPED_DEVICES``, under
    /opt/devices, or ``devices``) into ``home``'s embedded store; write its plan and lock; return the lock."""
    from weenv.plan import load_plan, lock_plan, write_plan
    from weenv.registry import publish, resolve_group

    from ._daemon import weenv_home
    from ._images import busybox_tree

    src = Path(home) / f"src-{name}"
    if not src.exists():
        busybox_tree(src)
        (src / "opt" / "devices").mkdir(parents=True)
        for dev, (kind, major, minor) in (SHIPPED_DEVICES if devices is None else devices).items():
            os.mknod(src / "opt" / "devices" / dev, 0o666 | kind, os.makedev(major, minor))
    with weenv_home(home):
        publish(str(src), f"busybox:{name}", group="os", group_class="os")
        plan_path = os.path.join(home, f"{name}.toml")
        with open(plan_path, "w") as f:
            f.write(f'name = "{name}"\n\n[[groups]]\nname = "os"\nref = "busybox:{name}"\nclass = "os"\n\n'
                    '[resources]\npids = 256\ndisk = "64MiB"\n\n[resources.cpu]\nmin = 0.05\nmax = 1.0\n\n'
                    '[resources.memory]\nmin = "64MiB"\nmax = "512MiB"\n')
        lock_path = os.path.join(home, f"{name}.lock.toml")
        write_plan(lock_plan(load_plan(plan_path), resolve_group), lock_path)
    shutil.rmtree(src, ignore_errors=True)
    return lock_path
