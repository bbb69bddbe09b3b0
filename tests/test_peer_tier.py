"""The peer chunk tier on real envlets of this machine: three nodes (envlets with their own caches and
FUSE mounts), a real docker-registry behind one counting proxy per node, peers on 127.0.0.1 only.

A layer read on A is fetched by B from A (B asks the registry for nothing); A killed mid-transfer → B
completes from the registry; A serving flipped bytes → caught by verification, refetched, A backed
off; a request without the cluster token is refused and counted; A's bandwidth bound holds within
20 %; a drained A serves nobody; three cold nodes at once ask the registry for each byte ~once."""

from __future__ import annotations

import hashlib
import http.client
import os
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from weenv.envlet import EnvletProcess, StoreSpec
from weenv.envlet._cache import scan_pack
from weenv.envlet._tier_peer import ITEM, PeerOptions
from weenv.envlet._tier import TierConfigError
from weenv.testing import start_proxy, stop_proxy

from .fixtures_common import require_fuse
from .fixtures_envlet import mounts_under
from .layertrees import f, make_tree

TOKEN = "peer-test-cluster-token"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    def __init__(self, proc: EnvletProcess, proxy):
        self.proc, self.proxy = proc, proxy
        self.address = proc.client.stats()["peer"]["server"]["address"]
        self.path = ""

    @property
    def client(self):
        return self.proc.client

    def register(self, g) -> str:
        info = self.client.register(StoreSpec("registry", registry=self.proxy.host, insecure=True), g.layer_digest,
                                    g.layer_size, g.toc_digest, repo=g.repo, prefetch=False)
        self.path = info.path
        self.proxy.log.clear()  # count what reads cost, not the registration
        return info.path

    def blob_gets(self) -> int:
        return sum(1 for m, p, _ in self.proxy.log.entries if m == "GET" and "/blobs/" in p)

    def tier(self, name: str) -> dict:
        return self.client.stats()["tiers"][name]

    def read(self, rel: str) -> bytes:
        with open(os.path.join(self.path, rel), "rb") as fh:
            return fh.read()


@pytest.fixture
def nodes(tmp_path, registry) -> Iterator[Callable[..., Node]]:
    require_fuse()
    token_file = tmp_path / "cluster.token"
    token_file.write_text(TOKEN + "\n")
    started: list[tuple[EnvletProcess, object]] = []

    def start(name: str, *, token_file_path: str | None = None, metrics_port: int | None = None, **opts: str) -> Node:
        base = tmp_path / name
        p = EnvletProcess(str(base / "mnt"), str(base / "cache"), str(base / "ctl.sock"),
                          tiers=["memory", "disk", "peer", "registry"], deadline_s=20.0, metrics_port=metrics_port)
        options = {"peer.listen": "127.0.0.1:0", "peer.token_file": token_file_path or str(token_file), **opts}
        for k, v in options.items():
            p.args += ["--tier-option", f"{k}={v}"]
        proxy = start_proxy(registry.host)
        started.append((p, proxy))
        p.start()
        return Node(p, proxy)

    yield start
    for p, proxy in started:
        p.stop()
        p.kill()
        stop_proxy(proxy)
    for m in mounts_under(str(tmp_path)):
        subprocess.run(["umount", "-l", m], capture_output=True)
    assert not mounts_under(str(tmp_path)), "peer test left mounts behind"


def publish_layer(tmp_path, registry, tag: str, files: dict[str, bytes]):
    from weenv.registry import publish, resolve_group

    src = make_tree(tmp_path / f"src-{tag}", *(f(k, v) for k, v in files.items()))
    ref = f"{registry.host}/peer/{tag}:v1"
    publish(str(src), ref, group=tag, group_class="task")
    return resolve_group(ref)


def link(*ns: Node, layer: str) -> None:
    """Every node's peer table: all the others, holding ``layer`` (what the node reports say)."""
    for n in ns:
        n.client.set_peers({o.address: [layer] for o in ns if o is not n})


def test_a_layer_read_on_a_is_fetched_by_b_from_a(tmp_path, registry, nodes, weenv_home):
    files = {"big": os.urandom(3_000_000), **{f"small/{i}": os.urandom(2000 + i) for i in range(40)}}
    g = publish_layer(tmp_path, registry, "ab", files)
    port = _free_port()
    a, b = nodes("a"), nodes("b", metrics_port=port)
    a.register(g)
    b.register(g)
    for k, v in files.items():
        assert a.read(k) == v
    assert a.blob_gets() > 0
    link(a, b, layer=g.layer_digest)
    for k, v in files.items():
        assert b.read(k) == v
    assert b.blob_gets() == 0, "B asked the registry for blob bytes A holds"
    sb, sa = b.client.stats(), a.client.stats()
    assert sb["tiers"]["registry"]["hit_bytes"] == 0
    assert sb["tiers"]["peer"]["hit_bytes"] == sum(map(len, files.values()))
    assert sb["peer_bytes"] >= sum(map(len, files.values())) and sb["verify_failures"] == 0
    assert sa["peer_served_bytes"] == sb["peer_bytes"] and sa["peer_refused"] == 0
    # per layer: peer vs registry, in the stats node reports read
    assert sb["layer_tiers"][g.layer_digest]["peer"]["bytes"] == sum(map(len, files.values()))
    assert "registry" not in sb["layer_tiers"][g.layer_digest]
    assert sb["peer"]["tier"]["peers"][a.address]["chunks"] > 0
    assert sum(sb["peer_latency"]["counts"]) == sb["peer_requests"] > 0
    # weenv cache stats and Prometheus say the same
    from click.testing import CliRunner

    from weenv.cli import main

    out = CliRunner().invoke(main, ["cache", "stats", "--control-socket", b.proc.control_socket]).output
    assert f"peer {a.address}" in out and f"layer {g.layer_digest[7:19]}" in out and "peers " in out, out
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    value = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert value["weenv_envlet_peer_bytes_total"] == sb["peer_bytes"]
    assert f'weenv_envlet_layer_tier_bytes_total{{layer="{g.layer_digest}",tier="peer"}}' in text
    assert "weenv_envlet_peer_fetch_seconds_count" in text


def test_a_killed_mid_transfer_b_completes_from_the_registry(tmp_path, registry, nodes, weenv_home):
    data = os.urandom(6_000_000)
    g = publish_layer(tmp_path, registry, "kill", {"big": data})
    a = nodes("a", **{"peer.serve_bandwidth": "1MiB"})  # slow: the kill lands mid-transfer
    b = nodes("b")
    a.register(g)
    b.register(g)
    assert a.read("big") == data
    link(a, b, layer=g.layer_digest)
    got: dict[str, object] = {}

    def read() -> None:
        try:
            got["data"] = b.read("big")
        except OSError as e:
            got["error"] = e

    t = threading.Thread(target=read)
    t0 = time.monotonic()
    t.start()
    deadline = time.monotonic() + 10
    while a.client.stats()["peer_served_bytes"] < 500_000 and time.monotonic() < deadline:
        time.sleep(0.05)
    a.proc.kill()
    t.join(30)
    assert not t.is_alive()
    assert got.get("data") == data, got.get("error")
    s = b.client.stats()
    assert s["peer_bytes"] > 0 and s["tiers"]["registry"]["hit_bytes"] > 0 and b.blob_gets() > 0
    assert s["peer_errors"] + s["peer_timeouts"] >= 1
    assert time.monotonic() - t0 < 20


def _flip_packs(cache_dir: str) -> int:
    flipped = 0
    packs = os.path.join(cache_dir, "l2", "packs")
    for name in sorted(os.listdir(packs)):
        with open(os.path.join(packs, name), "r+b") as fh:
            for _, offset, length, _ in list(scan_pack(fh.fileno())):
                if length:
                    fh.seek(offset + length // 2)
                    b = fh.read(1)
                    fh.seek(offset + length // 2)
                    fh.write(bytes([b[0] ^ 0xFF]))
                    flipped += 1
    return flipped


def test_a_serving_corrupt_bytes_is_caught_refetched_and_penalised(tmp_path, registry, nodes, weenv_home):
    files = {"big": os.urandom(2_000_000), "x": os.urandom(50_000)}
    g = publish_layer(tmp_path, registry, "corrupt", files)
    a, b = nodes("a"), nodes("b")
    a.register(g)
    b.register(g)
    for k, v in files.items():
        assert a.read(k) == v
    time.sleep(0.3)  # A's write-back into its disk cache runs in the background
    assert _flip_packs(a.proc.cache_dir) > 0
    link(a, b, layer=g.layer_digest)
    for k, v in files.items():
        assert b.read(k) == v  # never the flipped bytes
    s = b.client.stats()
    assert s["peer_corrupt"] >= 1 and s["verify_failures"] >= 1
    assert s["tiers"]["peer"]["rejected"] >= 1 and s["tiers"]["registry"]["hit_bytes"] > 0
    peer = s["peer"]["tier"]["peers"][a.address]
    assert peer["corrupt"] >= 1 and peer["backoff_s"] > 30  # not asked again for a while


def _post(address: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        c.request("POST", "/v1/chunks", body=body, headers=headers)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_a_peer_without_the_token_is_refused_and_counted(tmp_path, registry, nodes, weenv_home):
    files = {"big": os.urandom(500_000)}
    g = publish_layer(tmp_path, registry, "auth", files)
    a = nodes("a")
    a.register(g)
    assert a.read("big") == files["big"]
    body = ITEM.pack(b"\0" * 32, 0, 1, 1, 0, 0)
    assert _post(a.address, {}, body)[0] == 401
    assert _post(a.address, {"Authorization": "Bearer wrong"}, body)[0] == 401
    assert _post(a.address, {"Authorization": f"Bearer {TOKEN}"}, body)[0] == 200
    # a node with another token: refused by A, its reads come from the registry
    other = tmp_path / "other.token"
    other.write_text("not-the-cluster-token")
    c = nodes("c", token_file_path=str(other))
    c.register(g)
    link(a, c, layer=g.layer_digest)
    assert c.read("big") == files["big"]
    s = c.client.stats()
    assert s["peer_bytes"] == 0 and s["peer_errors"] >= 1 and s["tiers"]["registry"]["hit_bytes"] > 0
    assert a.client.stats()["peer_refused"] >= 3


def test_the_bandwidth_bound_holds_within_20_percent(tmp_path, registry, nodes, weenv_home):
    rate = 4 << 20
    data = os.urandom(12 << 20)
    g = publish_layer(tmp_path, registry, "bw", {"big": data})
    a = nodes("a", **{"peer.serve_bandwidth": str(rate)})
    b = nodes("b")
    a.register(g)
    b.register(g)
    assert a.read("big") == data
    link(a, b, layer=g.layer_digest)
    t0 = time.monotonic()
    assert b.read("big") == data
    elapsed = time.monotonic() - t0
    served = a.client.stats()["peer_served_bytes"]
    assert served >= len(data) and b.blob_gets() == 0
    measured = served / elapsed
    print(f"peer serving: {measured / 2**20:.2f} MiB/s against a bound of {rate / 2**20:.0f} MiB/s")
    assert 0.8 * rate <= measured <= 1.2 * rate, f"{measured / 2**20:.2f} MiB/s served, bound {rate / 2**20:.0f}"


def test_a_drained_node_stops_serving(tmp_path, registry, nodes, weenv_home):
    files = {"big": os.urandom(1_000_000)}
    g = publish_layer(tmp_path, registry, "drain", files)
    a, b = nodes("a"), nodes("b")
    a.register(g)
    b.register(g)
    assert a.read("big") == files["big"]
    link(a, b, layer=g.layer_digest)
    assert a.client.set_peer_serving(False)["serving"] is False
    assert b.read("big") == files["big"]
    assert a.client.stats()["peer_drained"] >= 1 and a.client.stats()["peer_served_bytes"] == 0
    assert b.client.stats()["tiers"]["registry"]["hit_bytes"] > 0


def test_three_cold_nodes_at_once_ask_the_registry_for_each_byte_about_once(tmp_path, registry, nodes, weenv_home):
    files = {f"f{i}": os.urandom(1_500_000) for i in range(6)}
    total = sum(map(len, files.values()))
    g = publish_layer(tmp_path, registry, "cold", files)
    ns = [nodes(n) for n in "abc"]
    for n in ns:
        n.register(g)
    link(*ns, layer=g.layer_digest)
    errors: list[BaseException] = []

    def read_all(n: Node) -> None:
        try:
            for k, v in files.items():
                assert n.read(k) == v
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=read_all, args=(n,)) for n in ns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    registry_bytes = sum(n.tier("registry")["hit_bytes"] for n in ns)
    print(f"3 cold nodes: the registry answered {registry_bytes / total:.2f}x the bytes read")
    assert registry_bytes <= 1.3 * total, f"registry answered {registry_bytes / total:.2f}x the bytes read"


def test_peer_options_are_checked_by_name():
    with pytest.raises(TierConfigError, match="token"):
        PeerOptions.from_options({})
    with pytest.raises(TierConfigError, match="peer.k"):
        PeerOptions.from_options({"peer.token": "t", "peer.k": "0"})
    with pytest.raises(TierConfigError, match="peer.listen"):
        PeerOptions.from_options({"peer.token": "t", "peer.listen": "nowhere"})
    with pytest.raises(TierConfigError, match="no such peer option"):
        PeerOptions.from_options({"peer.token": "t", "peer.bandwith": "1"})
    o = PeerOptions.from_options({"peer.token": "t", "peer.serve_bandwidth": "50MiB", "peer.hedge_ms": "80"})
    assert o.serve_bandwidth == 50 << 20 and o.hedge_s == 0.08 and o.k == 2


def test_the_rendezvous_order_agrees_across_nodes():
    """Every node ranks the same owner first for a region (so one fetches it for all), none asks itself."""
    from weenv.envlet import Metrics
    from weenv.envlet._tier_peer import PeerTier
    from weenv.layerfmt import Chunk

    layer = "sha256:" + "ab" * 32
    addrs = [f"127.0.0.1:{7000 + i}" for i in range(4)]
    tiers = []
    for me in addrs:
        t = PeerTier(Metrics(), PeerOptions(token="t", k=8))
        t.self_address = me
        t.set_peers({a: [layer] for a in addrs})
        tiers.append(t)
    owners = set()
    for region in range(20):
        c = Chunk(region * (4 << 20), 10, 0, 10, b"\1" * 32)
        firsts = set()
        for me, t in zip(addrs, tiers):
            order = t.order(layer, c)
            assert me not in [a for a, _ in order] and len(order) == 3
            fetchers = [a for a, fetch in order if fetch]
            firsts.add(fetchers[0] if fetchers else me)
        assert len(firsts) == 1
        owners |= firsts
    assert len(owners) > 1  # regions spread over the nodes


def test_a_kept_alive_connection_the_peer_closed_is_not_held_against_it(tmp_path):
    """A pooled connection the peer closed meanwhile (idle timeout, restart) is retried once on a new one."""
    import socket

    from weenv.envlet import Metrics
    from weenv.envlet._tier_peer import _Conn

    from .test_chunk_tiers import _layer_blob, _peer_harness

    blob, lay = _layer_blob()
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    m = Metrics()
    h = _peer_harness(tmp_path, m, blob, lay, digest)
    try:
        items = h.chunks()
        h.hold(items)
        (addr,) = h.tier.peers
        with socket.socket() as listener:  # a connection whose far end is already closed
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            stale = socket.create_connection(listener.getsockname())
            far, _ = listener.accept()
            far.close()
        h.tier._idle[addr] = [_Conn(stale)]
        assert h.get([items[0][0]]) == [items[0][1]]
        assert m.counters["peer_errors"] == 0 and h.tier.stats()["peers"][addr]["backoff_s"] == 0
    finally:
        for close in h.closers:
            close()


def test_a_group_the_tier_splits_off_resolves_without_waiting_for_the_others():
    """Two nodes, each waiting on the other's owner fetch, must not deadlock: a chunk of a region this
    node fetches itself resolves while another region's request (to its owner) still waits. Before
    the fetcher walked split groups on their own, one tier call held every claim of the read, and
    two envlets could each hold the claim the other's peer fetch waited for (2 s stalls at K = 4)."""
    import trio

    from weenv.envlet import Metrics
    from weenv.envlet._fetch import Fetcher, LayerSource
    from weenv.envlet._tier import ChunkTier
    from weenv.layerfmt import Chunk

    own, other = os.urandom(1000), os.urandom(1000)
    c_own = Chunk(0, 1000, 0, 1000, hashlib.sha256(own).digest())
    c_other = Chunk(4 << 20, 1000, 0, 1000, hashlib.sha256(other).digest())
    own_resolved = threading.Event()

    class Split(ChunkTier):
        name, blocking, verified = "split", True, False

        def has(self, chunk):
            return None

        def split(self, src, chunks):
            return [[c] for c in chunks]

        def get(self, src, chunks):
            if any(c is c_other for c in chunks):  # the owner of this region waits for our claim on the other chunk
                assert own_resolved.wait(5), "the chunk of our own region never resolved"
            return [own if c is c_own else other for c in chunks]

        def put(self, items):
            return None

    fetcher = Fetcher([Split()], Metrics(), deadline_s=10)
    src = LayerSource("t", None, "sha256:" + "ab" * 32)  # type: ignore[arg-type]

    async def main() -> None:
        async with trio.open_nursery() as n:
            fetcher.attach(n)
            got: list = []

            async def read_both() -> None:
                got.extend(await fetcher.get(src, [c_own, c_other], "both"))

            async def peer_waits_for_own() -> None:  # what a peer's fetch-for-peer does: coalesce on the claim
                await trio.sleep(0.05)
                assert await fetcher.get(src, [c_own], "for a peer") == [own]
                own_resolved.set()

            with trio.fail_after(8):
                n.start_soon(read_both)
                n.start_soon(peer_waits_for_own)
                while len(got) < 2:
                    await trio.sleep(0.01)
            assert got == [own, other]
            n.cancel_scope.cancel()

    trio.run(main)


def test_serving_a_peer_flood_yields_to_the_nodes_own_reads(tmp_path, registry, nodes, weenv_home):
    """A serves a flood of peer requests at its concurrency bound (bandwidth unbounded, so only the
    priority rule holds serving back) while its own reads fetch a cold layer: serving drops below 50 %
    of what A serves with no reads of its own (it yields, and still goes on), and A's reads keep
    their time within 2x (+0.5 s) of the same reads without the flood."""
    big = {f"big{i}": os.urandom(4 << 20) for i in range(3)}
    served_layer = publish_layer(tmp_path, registry, "flood", big)
    cold = {f"d{j}/f{i}": os.urandom(60_000 + i) for j in range(2) for i in range(60)}
    own_a = publish_layer(tmp_path, registry, "own-a", cold)
    cold_b = {k: os.urandom(len(v)) for k, v in cold.items()}
    own_b = publish_layer(tmp_path, registry, "own-b", cold_b)
    a = nodes("a", **{"peer.serve_bandwidth": "0", "peer.serve_concurrency": "4"})
    a.register(served_layer)
    for k, v in big.items():
        assert a.read(k) == v
    time.sleep(0.5)  # the write-back into A's disk cache (served with sendfile from the packs)
    chunks = [c for k in big for c in _chunks_of(registry, served_layer, k)]
    body = b"".join(ITEM.pack(c.digest, c.offset, c.length, c.ulength, 0, 0) for c in chunks)

    def read_all(layer, files) -> float:
        path = a.register(layer)
        t0 = time.monotonic()
        for k, v in files.items():
            with open(os.path.join(path, k), "rb") as fh:
                assert fh.read() == v
        return time.monotonic() - t0

    quiet = read_all(own_a, cold)
    stop = threading.Event()
    flood_bytes = [0]

    def flood() -> None:
        end = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < end:
            status, data = _post(a.address, {"Authorization": f"Bearer {TOKEN}"}, body)
            assert status == 200
            flood_bytes[0] += len(data)

    flooders = [threading.Thread(target=flood) for _ in range(4)]
    for t in flooders:
        t.start()
    try:
        time.sleep(0.5)  # the flood under way
        t0, s0 = time.monotonic(), a.client.stats()["peer_served_bytes"]
        time.sleep(1.0)
        t1, before = time.monotonic(), a.client.stats()["peer_served_bytes"]
        idle_rate = (before - s0) / (t1 - t0)  # what A serves with no reads of its own
        busy = read_all(own_b, cold_b)
        during = a.client.stats()["peer_served_bytes"] - before
    finally:
        stop.set()
        for t in flooders:
            t.join(30)
    rate = during / busy
    print(f"A's own reads: {quiet:.2f} s quiet, {busy:.2f} s while serving peers at {rate / 2**20:.0f} MiB/s "
          f"({idle_rate / 2**20:.0f} MiB/s with no reads of its own)")
    assert during > 0 and flood_bytes[0] > 0, "the flood was not served while A read (serving must yield, not stop)"
    # yielding held serving to 0.33x of its idle rate at load 10 and 0.30x on a CI run at load ~8 (its reads
    # 1.8x slower); serving that does not yield only loses the CPU A's reads take: 0.5 tells them apart
    assert rate <= 0.5 * idle_rate, "serving did not yield to A's own reads"
    # the share above is the rule; this bound only catches reads starved outright (generous: the
    # flood's four clients share this process and the machine's two cores with A)
    assert busy <= 2.0 * quiet + 0.5, f"A's own reads took {busy:.2f} s under a peer flood, {quiet:.2f} s without"


def _chunks_of(registry, layer, rel: str):
    """The chunks of file ``rel`` of a published layer, from its TOC (as a peer knows them)."""
    from weenv.layerfmt import Layer
    from weenv.registry import BlobReader, RemoteStore

    store = RemoteStore(registry.host, insecure=True, credentials=None)
    try:
        return list(Layer.open(BlobReader(store, layer.repo, layer.layer_digest, layer.layer_size)).entry(rel).chunks)
    finally:
        store.close()
