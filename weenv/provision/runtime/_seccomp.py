"""The seccomp program of an env, built once per profile: crun loads it instead of building its own.

crun builds the filter with libseccomp on every create; :func:`compiled_seccomp` makes the same
program with the same library once and hands it over in the :data:`ANNOTATION_SECCOMP_BPF`
annotation (docs/architecture.md, "Start of an env", step 6).
"""

from __future__ import annotations

import base64
import ctypes
import errno
import json
import os
from collections.abc import Mapping

ANNOTATION_SECCOMP_BPF = "run.oci.seccomp_bpf_data"  # crun: load this filter, not linux.seccomp's
_SCMP_ACTIONS = {"SCMP_ACT_ALLOW": lambda errno: 0x7FFF0000, "SCMP_ACT_ERRNO": lambda errno: 0x00050000 | (errno & 0xFFFF)}
_SCMP_OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5,
             "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
_compiled: dict[str, str | None] = {}  # the profile's JSON -> its filter, base64 (None: left to crun)


class _ScmpArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def compiled_seccomp(profile: Mapping) -> str | None:
    """The BPF program crun would build from the OCI seccomp ``profile``, base64, built once per
    profile and process (None: a profile or a host this does not handle; crun then builds it).

    crun builds the filter with libseccomp on every create: 1.4 ms of a 10.7 ms create of weenv's
    spec here (40 interleaved creates with and without linux.seccomp); handed this instead, crun
    create through the daemon took 14.1 -> 13.4 and 18.3 -> 17.4 ms p50 (two runs of 60
    interleaved starts). This makes the same calls
    on the same library crun links (libcrun_generate_seccomp: seccomp_init with the default
    action, seccomp_arch_add per architecture, seccomp_rule_add_array per known syscall name,
    rules whose action is the default skipped, seccomp_export_bpf), and crun loads the result
    from the ``run.oci.seccomp_bpf_data`` annotation as it would its own. The program is the one
    crun makes, byte for byte (tests/test_runtime.py compares it with the filter of an env's init).
    """
    key = json.dumps(profile, sort_keys=True)
    if key in _compiled:
        return _compiled[key]
    _compiled[key] = result = _compile_seccomp(profile)
    return result


def _compile_seccomp(profile: Mapping) -> str | None:
    if set(profile) - {"defaultAction", "architectures", "syscalls"}:
        return None  # flags, listeners, defaultErrnoRet: crun's
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ScmpArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    try:
        default = _SCMP_ACTIONS[profile["defaultAction"]](1)
    except KeyError:
        return None
    ctx = lib.seccomp_init(default)
    if not ctx:
        return None
    try:
        for arch in profile.get("architectures", ()):
            token = lib.seccomp_arch_resolve_name(arch.removeprefix("SCMP_ARCH_").lower().encode())
            if token == 0 or lib.seccomp_arch_add(ctx, token) not in (0, -errno.EEXIST):
                return None
        for rule in profile.get("syscalls", ()):
            if set(rule) - {"names", "action", "errnoRet", "args"} or rule.get("action") not in _SCMP_ACTIONS:
                return None
            action = _SCMP_ACTIONS[rule["action"]](rule.get("errnoRet", errno.EPERM))
            if action == default:
                continue
            args = rule.get("args") or []
            if len({a["index"] for a in args}) != len(args) or len(args) > 6:
                return None  # crun splits repeated indexes into rules of their own: not done here
            cmps = (_ScmpArgCmp * max(len(args), 1))(*[
                _ScmpArgCmp(a["index"], _SCMP_OPS[a["op"]], a.get("value", 0), a.get("valueTwo", 0)) for a in args])
            for name in rule["names"]:
                number = lib.seccomp_syscall_resolve_name(name.encode())
                if number == -1:  # __NR_SCMP_ERROR: unknown here, crun skips it too
                    continue
                if lib.seccomp_rule_add_array(ctx, action, number, len(args), cmps) != 0:
                    return None
        fd = os.memfd_create("seccomp", os.MFD_CLOEXEC)
        try:
            if lib.seccomp_export_bpf(ctx, fd) != 0:
                return None
            size = os.lseek(fd, 0, os.SEEK_CUR)
            return base64.b64encode(os.pread(fd, size, 0)).decode() if size else None
        finally:
            os.close(fd)
    except (KeyError, TypeError, OSError):
        return None
    finally:
        lib.seccomp_release(ctx)
