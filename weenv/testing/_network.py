"""The "outside world" of egress tests and benchmarks, entirely on this machine.

:class:`Outside` makes a network namespace ``wtest-out-<pid>`` holding A = 198.18.X.1 and
B = 198.18.X.3 (198.18.0.0/15 is reserved for benchmarking; the /24 is chosen by this process's pid,
so two test runs on one machine do not install competing routes) behind a veth whose host end
(198.18.X.2) is the test daemon's only ``--egress-interface``. HTTP servers listen on A:8000,
A:8001 and B:8000, each serving ``/id`` (its own address and port) and ``/big`` (a few MiB); a
DNS server on A:53 answers ``svc.test`` → A, ``other.test`` → B and ``meta.test`` → 169.254.169.254
(a name rebound to the metadata address: a resolver must not hand it to an env).
Every denied target of a test is one of these, so a policy bug cannot send a packet off the
machine. :meth:`Outside.close` stops the servers (by PID) and removes the namespace and veth.
"""


from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ._daemon import DaemonHandle, busybox_plan, teardown_private_daemon
from ._host import require_fuse, require_tool

_BLOCK = os.getpid() % 512
_NET = f"198.{18 + _BLOCK // 256}.{_BLOCK % 256}"
OUTSIDE_A, OUTSIDE_HOST, OUTSIDE_B = f"{_NET}.1", f"{_NET}.2", f"{_NET}.3"
OUTSIDE_PORT, OUTSIDE_OTHER_PORT = 8000, 8001
OUTSIDE_BIG_BYTES = 6 << 20
OUTSIDE_NAMES = {"svc.test": OUTSIDE_A, "other.test": OUTSIDE_B, "meta.test": "169.254.169.254"}

_DNS_SERVER = r"""
import socket, sys
import dns.message, dns.rrset, dns.rcode
names = dict(a.split('=') for a in sys.argv[2:])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 53))
while True:
    data, peer = s.recvfrom(4096)
    q = dns.message.from_wire(data); r = dns.message.make_response(q)
    name = q.question[0].name.to_text(omit_final_dot=True)
    if name in names:
        r.answer.append(dns.rrset.from_text(q.question[0].name, 5, 'IN', 'A', names[name]))
    else:
        r.set_rcode(dns.rcode.NXDOMAIN)
    s.sendto(r.to_wire(), peer)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, check=check)


class Outside:
    """The outside world of egress tests: :meth:`open` it, :meth:`close` it (see the module docstring)."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.netns = f"wtest-out-{pid}"
        self.iface = f"wto{pid}"[:15]
        self.procs: list[subprocess.Popen] = []
        self.dirs: list[str] = []
        self.egress_range = f"10.{200 + pid % 50}.{(pid // 50 % 16) * 16}.0/20"
        self.table = f"wt{pid}"

    def open(self) -> "Outside":
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.iface, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        _ip("addr", "add", f"{OUTSIDE_HOST}/24", "dev", self.iface)
        _ip("link", "set", self.iface, "up")
        for a in (OUTSIDE_A, OUTSIDE_B):
            _ip("-n", self.netns, "addr", "add", f"{a}/24", "dev", "eth0")
        _ip("-n", self.netns, "link", "set", "eth0", "up")
        _ip("-n", self.netns, "link", "set", "lo", "up")
        for addr, port in ((OUTSIDE_A, OUTSIDE_PORT), (OUTSIDE_A, OUTSIDE_OTHER_PORT), (OUTSIDE_B, OUTSIDE_PORT)):
            d = tempfile.mkdtemp(prefix="wtest-www-")
            self.dirs.append(d)
            with open(os.path.join(d, "id"), "w") as f:
                f.write(f"{addr}:{port}\n")
            with open(os.path.join(d, "big"), "wb") as f:
                f.write(os.urandom(OUTSIDE_BIG_BYTES))
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", self.netns, sys.executable, "-m", "http.server", str(port), "--bind", addr,
                 "--directory", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.procs.append(subprocess.Popen(
            ["ip", "netns", "exec", self.netns, sys.executable, "-c", _DNS_SERVER, OUTSIDE_A,
             *(f"{k}={v}" for k, v in OUTSIDE_NAMES.items())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait_ready()
        return self

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for addr, port in ((OUTSIDE_A, OUTSIDE_PORT), (OUTSIDE_A, OUTSIDE_OTHER_PORT), (OUTSIDE_B, OUTSIDE_PORT)):
            while True:
                p = subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-c",
                                    f"import socket; socket.create_connection(('{addr}', {port}), 1).close()"],
                                   capture_output=True)
                if p.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"outside server {addr}:{port} did not come up")
                time.sleep(0.1)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        _ip("link", "del", self.iface, check=False)
        _ip("netns", "del", self.netns, check=False)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)


class EgressDaemon(DaemonHandle):
    """A private daemon whose egress leaves only by the outside world's veth."""

    world: Outside
    left: list[str]
    dns_server: str = OUTSIDE_A
    """The resolver the daemon's egress DNS asks (the outside world's, unless a test runs its own)."""

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "ab")
        w = self.world
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weenv", "daemon", "--cgroup-root", self.cgroup_root,
             "--egress-interface", w.iface, "--egress-range", w.egress_range, "--egress-table", w.table,
             "--egress-dns", self.dns_server],
            env=self.env_vars(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.wait_ready(timeout_s)


@contextmanager
def egress_daemon(world: Outside, name: str = "bb") -> Iterator[EgressDaemon]:
    """A private daemon (busybox plan) egressing through ``world``; ``.left`` lists what it left."""
    require_fuse()
    require_tool("crun")
    home = tempfile.mkdtemp(prefix="weenv-egress-")
    plan, lock = busybox_plan(home, name)
    d = EgressDaemon(home, os.path.join(home, "run", "weenv.sock"), f"weenv-net-{os.getpid()}", lock, plan,
                     os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.world = world
    d.left = []
    d.start()
    try:
        yield d
    finally:
        d.left = teardown_private_daemon(d) + weenv_links(world.table)


def weenv_links(table: str) -> list[str]:
    """Veths, namespaces and addresses a daemon with nft table ``table`` still holds."""
    import json

    left = []
    links = json.loads(_ip("-j", "link", "show", "type", "veth").stdout or b"[]")
    left += [f"veth {x['ifname']}" for x in links if x.get("ifalias", "").startswith(f"{table}:")]
    try:
        left += [f"netns {n}" for n in os.listdir("/run/netns") if n.startswith(f"{table}-")]
    except FileNotFoundError:
        pass
    return left
