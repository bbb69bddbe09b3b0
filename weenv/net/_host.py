"""The kernel side of egress envs: network namespaces, veth pairs, tc, nftables. Blocking calls
(run them in worker threads).

nftables goes through libnftables (the library the ``nft`` command is built on) in this process:
one transaction per call and no process start. Links and addresses go through ``ip -batch``
(two short processes per env), traffic shaping through ``tc``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import threading
from collections.abc import Sequence

NETNS_DIR = "/run/netns"


class NetError(Exception):
    """A kernel networking step failed; the message names the step and carries the tool's words."""


# -- nftables ----------------------------------------------------------------------------------

_lib: ctypes.CDLL | None = None
_nft_lock = threading.Lock()
_NFT_CTX_OUTPUT_JSON = 1 << 4


def _nftables() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            raise NetError(f"libnftables is missing ({e}): apt-get install nftables") from None
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        _lib = lib
    return _lib


def nft(script: str, *, json_output: bool = False, what: str = "nft") -> str:
    """Run an nft script as one transaction (all or nothing); its output."""
    lib = _nftables()
    with _nft_lock:
        ctx = lib.nft_ctx_new(0)
        try:
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            if json_output:
                lib.nft_ctx_output_set_flags(ctx, _NFT_CTX_OUTPUT_JSON)
            rc = lib.nft_run_cmd_from_buffer(ctx, script.encode())
            out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
            err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
        finally:
            lib.nft_ctx_free(ctx)
    if rc != 0:
        raise NetError(f"{what}: {err.strip()[-2000:] or 'nft failed'}")
    return out


def list_table(table: str) -> str:
    """``nft -j list table inet <table>`` ("" when there is no such table)."""
    try:
        return nft(f"list table inet {table}", json_output=True, what="list table")
    except NetError as e:
        if "No such file or directory" in str(e) or "does not exist" in str(e):
            return ""
        raise


def delete_table(table: str) -> None:
    if list_table(table):
        nft(f"delete table inet {table}", what="delete table")


# -- namespaces and links ---------------------------------------------------------------------

def _run(argv: Sequence[str], what: str, stdin: str | None = None) -> str:
    p = subprocess.run(list(argv), input=stdin.encode() if stdin is not None else None, capture_output=True)
    if p.returncode != 0:
        raise NetError(f"{what}: {p.stderr.decode(errors='replace').strip()[-1000:] or f'exit {p.returncode}'}")
    return p.stdout.decode(errors="replace")


def netns_path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


def create_link(*, netns: str, veth: str, alias: str, address: str, gateway: str, prefix: int) -> None:
    """A network namespace holding ``eth0`` (``address``, default route via ``gateway``) and ``lo``,
    wired to the node by a veth whose host end is ``veth`` (``gateway``); forwarding on for it."""
    _run(["ip", "netns", "add", netns], "create the network namespace")
    _run(["ip", "-batch", "-"], "create the veth pair", stdin=(
        f"link add {veth} type veth peer name eth0 netns {netns}\n"
        f"link set {veth} alias {alias}\n"
        f"addr add {gateway}/{prefix} dev {veth}\n"
        f"link set {veth} up\n"))
    write_sysctl(f"net/ipv4/conf/{veth}/forwarding", "1")
    write_sysctl(f"net/ipv6/conf/{veth}/disable_ipv6", "1")
    _run(["ip", "-n", netns, "-batch", "-"], "configure the env's interfaces", stdin=(
        f"addr add {address}/{prefix} dev eth0\n"
        "link set eth0 up\n"
        "link set lo up\n"
        f"route add default via {gateway}\n"))


def delete_link(*, netns: str, veth: str) -> list[str]:
    """Remove the veth pair and the namespace; idempotent. Problems found (as text)."""
    problems = []
    if veth and os.path.exists(f"/sys/class/net/{veth}"):
        try:
            _run(["ip", "link", "del", veth], "delete the veth pair")
        except NetError as e:
            if os.path.exists(f"/sys/class/net/{veth}"):
                problems.append(str(e))
    if netns and os.path.exists(netns_path(netns)):
        try:
            _run(["ip", "netns", "del", netns], "delete the network namespace")
        except NetError as e:
            problems.append(str(e))
    return problems


def links_with_alias_prefix(prefix: str) -> dict[str, str]:
    """Host veths whose alias starts with ``prefix``: name → alias (what gc sweeps)."""
    out = _run(["ip", "-j", "link", "show", "type", "veth"], "list veths")
    found = {}
    for link in json.loads(out or "[]"):
        alias = link.get("ifalias", "")
        if alias.startswith(prefix):
            found[link["ifname"]] = alias
    return found


def netns_names(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def write_sysctl(path: str, value: str) -> None:
    with open(f"/proc/sys/{path}", "w") as f:
        f.write(value)


def read_sysctl(path: str) -> str:
    with open(f"/proc/sys/{path}") as f:
        return f.read().strip()


def set_bandwidth(*, netns: str, veth: str, bps: int | None) -> None:
    """A token bucket on both ends of the pair: the env's sends (eth0) and what it receives (the
    host end). None removes the limit."""
    if bps is None:
        for argv in (["tc", "qdisc", "del", "dev", veth, "root"], ["tc", "-n", netns, "qdisc", "del", "dev", "eth0", "root"]):
            subprocess.run(argv, capture_output=True)  # absent is fine
        return
    rate_bytes = bps // 8
    burst = max(rate_bytes // 100, 16 * 1024)  # 10 ms worth, at least a few full frames
    spec = ["root", "tbf", "rate", f"{bps}bit", "burst", str(burst), "latency", "50ms"]
    _run(["tc", "qdisc", "replace", "dev", veth, *spec], "limit the env's incoming bandwidth")
    _run(["tc", "-n", netns, "qdisc", "replace", "dev", "eth0", *spec], "limit the env's outgoing bandwidth")


def interface_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, CIDR) of every IPv4 address of the node (to find a range that collides)."""
    out = _run(["ip", "-j", "-4", "addr", "show"], "list addresses")
    return [(link["ifname"], f"{a['local']}/{a['prefixlen']}")
            for link in json.loads(out or "[]") for a in link.get("addr_info", []) if "local" in a]
