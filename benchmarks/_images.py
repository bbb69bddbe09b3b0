"""Realistic images, built reproducibly and cached outside the clone, keyed by their inputs.

Used by benchmarks (cache /var/cache/weenv-bench) and by slow integration tests
(cache /var/cache/weenv-test).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

BENCH_CACHE = Path(os.environ.get("WEENV_BENCH_CACHE", "/var/cache/weenv-bench"))
TEST_CACHE = Path(os.environ.get("WEENV_TEST_CACHE", "/var/cache/weenv-test"))
BUSYBOX = "/bin/busybox"
BUSYBOX_APPLETS = ("sh", "ls", "cat", "echo", "sleep", "mkdir", "rm", "cp", "mv", "true", "false", "env", "id",
                   "touch", "ps", "head", "tail", "wc", "grep", "sed", "dd", "stat", "ln", "chmod", "test", "[",
                   "kill", "mount", "umount", "hostname", "find", "sort", "uname", "whoami", "tee", "printf",
                   "seq", "sync", "dirname", "basename", "readlink", "date", "yes", "wget", "nc", "ping", "ip",
                   "su", "chown", "mknod", "insmod", "xargs", "tr", "cut", "od", "md5sum", "sha256sum", "df",
                   "du", "ifconfig", "vi", "timeout", "nproc", "pwd", "expr", "awk")


def _key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _locked_build(path: Path, build) -> Path:  # type: ignore[no-untyped-def]
    """Build ``path`` once across processes: flock, then temp + rename."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".build-"))
        try:
            out = build(tmp)
            os.replace(out, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def debian_tar(cache: Path = BENCH_CACHE, *, include: tuple[str, ...] = (), suite: str = "bookworm",
               variant: str = "minbase") -> Path:
    """A Debian rootfs tar made by mmdebstrap (about 26 s the first time)."""
    inputs = {"tool": "mmdebstrap", "suite": suite, "variant": variant, "include": sorted(include)}
    path = cache / f"debian-{suite}-{variant}{'-' + '-'.join(sorted(include)) if include else ''}-{_key(inputs)}.tar"

    def build(tmp: Path) -> Path:
        out = tmp / "rootfs.tar"
        cmd = ["mmdebstrap", f"--variant={variant}", "--quiet", "--mode=root", "--format=tar"]
        if include:
            cmd.append("--include=" + ",".join(include))
        cmd += [suite, str(out)]
        env = {**os.environ, "TMPDIR": str(tmp)}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        return out

    return _locked_build(path, build)


def extracted(tar: Path) -> Path:
    """The tar extracted next to it (numeric owners, devices kept: needs root)."""
    path = tar.with_suffix(".d")

    def build(tmp: Path) -> Path:
        out = tmp / "root"
        out.mkdir()
        subprocess.run(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-xpf", str(tar), "-C", str(out)],
                       check=True)
        return out

    return _locked_build(path, build)


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


def source_tree(cache: Path = BENCH_CACHE, min_bytes: int = 200 << 20) -> Path:
    """A real source-like tree of at least ``min_bytes``: this Python's standard library (.py, .pyc, .so, tests)."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    inputs = {"kind": "python-stdlib", "path": str(stdlib), "version": os.uname().release + " " + str(stdlib.stat().st_mtime)}
    path = cache / f"srctree-{_key(inputs)}"

    def build(tmp: Path) -> Path:
        out = tmp / "tree"
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
        return out

    return _locked_build(path, build)
