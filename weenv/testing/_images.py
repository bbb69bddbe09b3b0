"""Realistic images, built reproducibly and cached outside the clone, keyed by their inputs.

Used by benchmarks and by slow integration tests. Entries live in the fixture cache
(``$WEENV_FIXTURE_CACHE``, default /var/cache/weenv-fixtures; see :mod:`._fixturecache`),
which builds each under its own name in a private directory, checks it, renames it into place, and
checks it again on every read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from ._fixturecache import cached, check_tar, check_tree

BUSYBOX = "/bin/busybox"
BUSYBOX_APPLETS = ("sh", "ls", "cat", "echo", "sleep", "mkdir", "rm", "cp", "mv", "true", "false", "env", "id",
                   "touch", "ps", "head", "tail", "wc", "grep", "sed", "dd", "stat", "ln", "chmod", "test", "[",
                   "kill", "mount", "umount", "hostname", "find", "sort", "uname", "whoami", "tee", "printf",
                   "seq", "sync", "dirname", "basename", "readlink", "date", "yes", "wget", "nc", "ping", "ip",
                   "su", "chown", "mknod", "insmod", "xargs", "tr", "cut", "od", "md5sum", "sha256sum", "df",
                   "du", "ifconfig", "vi", "timeout", "nproc", "pwd", "expr", "awk")
DEBIAN_MEMBERS = ("etc/os-release", "etc/debian_version", "usr/bin/dpkg")
INCLUDE_MEMBERS = {"python3": "usr/bin/python3"}  # what an --include must have put into the tar


def _key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def debian_tar_name(*, include: tuple[str, ...] = (), suite: str = "bookworm", variant: str = "minbase") -> str:
    inputs = {"tool": "mmdebstrap", "suite": suite, "variant": variant, "include": sorted(include)}
    return f"debian-{suite}-{variant}{'-' + '-'.join(sorted(include)) if include else ''}-{_key(inputs)}.tar"


def check_debian_tar(path: Path, include: tuple[str, ...] = ()) -> None:
    check_tar(path, DEBIAN_MEMBERS + tuple(INCLUDE_MEMBERS[p] for p in include if p in INCLUDE_MEMBERS))


def debian_tar(cache: Path | None = None, *, include: tuple[str, ...] = (), suite: str = "bookworm",
               variant: str = "minbase") -> Path:
    """A Debian rootfs tar made by mmdebstrap (about 30 s the first time).

    mmdebstrap failing (no mirror reachable) raises CalledProcessError with its stderr; output
    that is not a complete tar with the expected files raises BuildError.
    """
    name = debian_tar_name(include=include, suite=suite, variant=variant)

    def build(out: Path) -> None:
        # out ends in .tar: mmdebstrap picks the format from the suffix (else it makes a directory)
        cmd = ["mmdebstrap", f"--variant={variant}", "--quiet", "--mode=root", "--format=tar"]
        if include:
            cmd.append("--include=" + ",".join(include))
        cmd += [suite, str(out)]
        env = {**os.environ, "TMPDIR": str(out.parent)}
        p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
        if p.returncode != 0:
            raise subprocess.CalledProcessError(p.returncode, cmd, stderr=p.stderr[-2000:])

    return cached(name, build, lambda p: check_debian_tar(p, include), root=cache)


def extracted(tar: Path) -> Path:
    """The tar extracted next to it (numeric owners, devices kept: needs root)."""

    def build(out: Path) -> None:
        out.mkdir()
        subprocess.run(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-xpf", str(tar), "-C", str(out)],
                       check=True)

    return cached(tar.with_suffix(".d").name, build, lambda p: check_tree(p, ("etc/os-release",)), root=tar.parent)


def busybox_tree(root: Path, applets: tuple[str, ...] = BUSYBOX_APPLETS) -> Path:
    """A minimal rootfs: static busybox with relative applet links, passwd/group, /tmp."""
    for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "root", "home/user", "usr/bin", "var"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for a in applets:
        link = root / "bin" / a
        if not link.exists():
            link.symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n"
                                         "nobody:x:65534:65534:nobody:/:/bin/false\n")
    (root / "etc" / "group").write_text("root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n")
    os.chmod(root / "tmp", 0o1777)
    os.chown(root / "home" / "user", 1000, 1000)
    return root


def source_tree(cache: Path | None = None, min_bytes: int = 200 << 20) -> Path:
    """A real source-like tree of at least ``min_bytes``: this Python's standard library (.py, .pyc, .so, tests)."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    inputs = {"kind": "python-stdlib", "path": str(stdlib), "version": os.uname().release + " " + str(stdlib.stat().st_mtime),
              "min_bytes": min_bytes}

    def build(out: Path) -> None:
        subprocess.run(["cp", "-a", str(stdlib), str(out)], check=True)
        shutil.rmtree(out / "site-packages", ignore_errors=True)
        total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and not f.is_symlink())
        n = 0
        while total < min_bytes:  # replicate subtrees until large enough, deterministically
            src = out / "test"
            dst = out / f"test-copy{n}"
            subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
            total += sum(f.stat().st_size for f in dst.rglob("*") if f.is_file() and not f.is_symlink())
            n += 1

    return cached(f"srctree-{_key(inputs)}", build, lambda p: check_tree(p, ("os.py", "test")), root=cache)
