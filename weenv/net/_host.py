"""The kernel side of egress envs: network namespaces, veth pairs, tc, nftables. Blocking calls
(run them in worker threads).

nftables goes through libnftables (the library the ``nft`` command is built on) and links,
addresses and routes through netlink (pyroute2), both in this process: an env's wiring starts no
process. Traffic shaping (only for envs with a bandwidth) runs ``tc``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import json
import os
import socket
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


def _list_json(command: str, what: str) -> str:
    """``nft -j <command>`` ("" when the table it names does not exist)."""
    try:
        return nft(command, json_output=True, what=what)
    except NetError as e:
        if "No such file or directory" in str(e) or "does not exist" in str(e):
            return ""
        raise


def list_table(table: str) -> str:
    """``nft -j list table inet <table>`` ("" when there is no such table)."""
    return _list_json(f"list table inet {table}", "list table")


def list_counters(table: str) -> str:
    """``nft -j list counters table inet <table>``: the accounting alone ("" without the table)."""
    return _list_json(f"list counters table inet {table}", "list counters")


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


_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MNT_DETACH = 2
_ipr = None
_ipr_lock = threading.Lock()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise NetError(f"{what}: {os.strerror(err)}")


def _in_fresh_thread(fn):  # type: ignore[no-untyped-def]
    """Run ``fn`` in a thread of its own (namespaces are per thread; the thread is never reused)."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name="weenv-netns", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _host_ipr():  # type: ignore[no-untyped-def]
    """One netlink socket in the node's namespace (made by the first caller, used under a lock)."""
    global _ipr
    if _ipr is None:
        from pyroute2 import IPRoute

        _ipr = IPRoute()
    return _ipr


def create_netns(name: str) -> str:
    """A new network namespace kept by a bind mount at ``/run/netns/<name>`` (as ``ip netns add``)."""
    os.makedirs(NETNS_DIR, exist_ok=True)
    path = netns_path(name)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o444))
    except FileExistsError:
        raise NetError(f"create the network namespace: {path} already exists") from None

    def inner() -> None:
        _check(_libc.unshare(_CLONE_NEWNET), "create the network namespace: unshare")
        me = f"/proc/self/task/{threading.get_native_id()}/ns/net"
        _check(_libc.mount(me.encode(), path.encode(), None, _MS_BIND, None), f"create the network namespace: bind {path}")

    try:
        _in_fresh_thread(inner)
    except BaseException:
        os.unlink(path)
        raise
    return path


def delete_netns(name: str) -> None:
    path = netns_path(name)
    if _libc.umount2(path.encode(), _MNT_DETACH) != 0 and ctypes.get_errno() not in (22, 2):  # EINVAL, ENOENT
        _check(-1, f"delete the network namespace: umount {path}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_ushort), ("addr", ctypes.c_ubyte * 4),
                ("zero", ctypes.c_ubyte * 8)]


class _Rtentry(ctypes.Structure):  # struct rtentry of <net/route.h>
    _fields_ = [("pad1", ctypes.c_ulong), ("dst", _SockaddrIn), ("gateway", _SockaddrIn), ("genmask", _SockaddrIn),
                ("flags", ctypes.c_ushort), ("pad2", ctypes.c_short), ("pad3", ctypes.c_ulong),
                ("pad4", ctypes.c_void_p), ("metric", ctypes.c_short), ("dev", ctypes.c_char_p),
                ("mtu", ctypes.c_ulong), ("window", ctypes.c_ulong), ("irtt", ctypes.c_ushort)]


_SIOCADDRT, _SIOCSIFADDR, _SIOCSIFNETMASK, _SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x890B, 0x8916, 0x891C, 0x8913, 0x8914
_IFF_UP, _RTF_UP, _RTF_GATEWAY = 0x1, 0x1, 0x2


def _sockaddr(address: str) -> _SockaddrIn:
    import socket

    return _SockaddrIn(socket.AF_INET, 0, (ctypes.c_ubyte * 4)(*socket.inet_aton(address)))


def _configure_inside(address: str, gateway: str, prefix: int) -> None:
    """In the env's namespace (the calling thread is in it): lo and eth0 up, eth0's address, the
    default route. The four classic ioctls take microseconds and hold no lock across the loop; a
    netlink library here costs milliseconds per step, on every env start."""
    import fcntl
    import ipaddress
    import socket
    import struct

    mask = str(ipaddress.IPv4Network(f"0.0.0.0/{prefix}").netmask)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # made in the env's namespace
        fd = sock.fileno()
        fcntl.ioctl(fd, _SIOCSIFADDR, struct.pack("16s", b"eth0") + bytes(_sockaddr(address)) + bytes(8))
        fcntl.ioctl(fd, _SIOCSIFNETMASK, struct.pack("16s", b"eth0") + bytes(_sockaddr(mask)) + bytes(8))
        for name in (b"lo", b"eth0"):
            flags = struct.unpack("16sH22x", fcntl.ioctl(fd, _SIOCGIFFLAGS, struct.pack("16sH22x", name, 0)))[1]
            fcntl.ioctl(fd, _SIOCSIFFLAGS, struct.pack("16sH22x", name, flags | _IFF_UP))
        route = _Rtentry(dst=_sockaddr("0.0.0.0"), gateway=_sockaddr(gateway), genmask=_sockaddr("0.0.0.0"),
                         flags=_RTF_UP | _RTF_GATEWAY)
        fcntl.ioctl(fd, _SIOCADDRT, bytes(route))


def create_link(*, netns: str, veth: str, alias: str, address: str, gateway: str, prefix: int) -> None:
    """A network namespace holding ``eth0`` (``address``, default route via ``gateway``) and ``lo``,
    wired to the node by a veth whose host end is ``veth`` (``gateway``); forwarding on for it.
    No process is started: netlink (pyroute2) on the node's side, ioctls inside."""
    from pyroute2.netlink.exceptions import NetlinkError

    path = create_netns(netns)
    try:
        with _ipr_lock:
            ipr = _host_ipr()
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                ipr.link("add", ifname=veth, kind="veth", state="up", peer={"ifname": "eth0", "net_ns_fd": fd})
            finally:
                os.close(fd)
            with open(f"/sys/class/net/{veth}/ifindex") as f:
                idx = int(f.read())
            ipr.link("set", index=idx, ifalias=alias)
            ipr.addr("add", index=idx, address=gateway, prefixlen=prefix)
        write_sysctl(f"net/ipv4/conf/{veth}/forwarding", "1")
        write_sysctl(f"net/ipv6/conf/{veth}/disable_ipv6", "1")
    except NetlinkError as e:
        raise NetError(f"wire the env's network: {e}") from None

    def inside() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(_libc.setns(fd, _CLONE_NEWNET), "enter the env's network namespace")
        finally:
            os.close(fd)
        try:
            _configure_inside(address, gateway, prefix)
        except OSError as e:
            raise NetError(f"configure the env's interfaces: {e}") from None

    _in_fresh_thread(inside)


def delete_link(*, netns: str, veth: str) -> list[str]:
    """Remove the veth pair and the namespace; idempotent. Problems found (as text)."""
    from pyroute2.netlink.exceptions import NetlinkError

    problems = []
    if veth and os.path.exists(f"/sys/class/net/{veth}"):
        try:
            with _ipr_lock:
                ipr = _host_ipr()
                idx = ipr.link_lookup(ifname=veth)
                if idx:
                    ipr.link("del", index=idx[0])
        except NetlinkError as e:
            if os.path.exists(f"/sys/class/net/{veth}"):
                problems.append(f"delete the veth pair {veth}: {e}")
    if netns and os.path.lexists(netns_path(netns)):
        try:
            delete_netns(netns)
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


def node_addresses() -> frozenset[ipaddress.IPv4Address]:
    """Every IPv4 address of the node's interfaces, now (one netlink dump, about 1 ms): what a
    tenant env may never be pinned to."""
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        with _ipr_lock:
            msgs = list(_host_ipr().get_addr(family=socket.AF_INET))
    except NetlinkError as e:
        raise NetError(f"list the node's addresses: {e}") from None
    return frozenset(ipaddress.IPv4Address(a) for m in msgs
                     if (a := m.get_attr("IFA_LOCAL") or m.get_attr("IFA_ADDRESS")))
