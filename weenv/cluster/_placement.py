"""Placement: which nodes may take an env, best first. Pure functions over node reports.

Rules, in order (docs/cluster.md):

1. Only nodes that admit the env's minimums, exactly as their daemons would (weenv/provision/
   _policy.py ``admit``): the max fits in RAM minus the reserve, the sum of memory mins fits there
   too, the min fits in today's headroom, the sum of CPU mins fits in cores x overcommit. A node
   that is not accepting (daemon or envlet down, lost, draining) takes nothing. A node-local
   snapshot starts only on its home node; an env that mounts volumes only on their node (volumes
   are node-local: :func:`volume_home` finds it, and refuses volumes of two nodes).
2. The load band: only nodes whose busy share is within ``band`` (default 0.25, i.e. 25 % of
   capacity; ``$WEENV_PLACEMENT_BAND``) of the least busy admitting node compete on rules 3-4; the
   others follow, least loaded first. Cache affinity wins among comparably busy nodes but never piles
   every env on the one node that has the plan.
3. Most of the plan's bytes already on the node (envlet, layer trees, snapshot layers, layers seen),
   each held layer counted with the plan's size for it.
4. The snapshot's home node, for forks and envs from a snapshot.
5. The least loaded node.
6. The node name, so that a decision is reproducible.

A node's busy share is the larger of its committed share (its CPU-min and memory-min shares) and
the share of its CPU its envs use now; its load adds ``ENV_WEIGHT`` (1 %) per env it runs: an env
costs a node more than its minimums (its processes, mounts, the daemon's work), so among nodes that
hold a plan equally, one with ten envs of tiny minimums comes after an empty one, and a burst of
small envs spreads over them instead of piling on the first name. The env count is left out of the
band, so it never outweighs cache affinity.

A group (n envs of one request, e.g. the forks of one snapshot) fills the best node up to what
it admits, then the next: it spreads only when one node cannot take them all.

:class:`ClusterView` is built once per batch of reports (an index from layer digest to the nodes
holding it); :func:`rank` and :func:`place_group` then cost a filter over the nodes plus a sort
of the candidates: about 0.3 ms at 1,000 nodes (benchmarks/cluster.py). :func:`with_pending`
counts envs placed on a node but not yet in its report (creates in flight), so that concurrent
creates see each other.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from ..plan import Lock, Plan, plan_from_builtins
from ._errors import PlacementError, VolumeConflictError, VolumeNotFoundError
from ._report import LayerHeld, NodeReport

_EPS = 1e-9
DEFAULT_BAND = 0.25
ENV_WEIGHT = 0.01  # each env adds 1 % of a node to its load (rule 5)


def default_band() -> float:
    """The load band (rule 2): ``$WEENV_PLACEMENT_BAND`` (a share of capacity, 0..1), else 0.25."""
    text = os.environ.get("WEENV_PLACEMENT_BAND", "").strip()
    if not text:
        return DEFAULT_BAND
    try:
        band = float(text)
    except ValueError:
        band = -1.0
    if not 0.0 <= band <= 1.0:
        raise PlacementError(f"$WEENV_PLACEMENT_BAND={text!r}: give a share of capacity between 0 and 1 (e.g. 0.25)")
    return band


class PlacementRequest(msgspec.Struct, frozen=True, kw_only=True):
    layers: tuple[tuple[str, int], ...] = ()  # (digest, size): the plan's groups, then snapshot layers
    cpu_min_cores: float = 0.0
    memory_min_bytes: int = 0
    memory_max_bytes: int = 0
    snapshot: str | None = None
    snapshot_home: str | None = None  # the node that made (holds) the snapshot
    snapshot_local: bool = False  # True: not published, so only its home node can start it
    volumes: tuple[str, ...] = ()  # the volumes it mounts (ids or names): the plan's and overrides.volumes
    volume_home: str | None = None  # their node (the caller's look-up); None: found in the view's reports


class Choice(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    cached_bytes: int
    home: bool
    committed_share: float  # the larger of the CPU-min and memory-min shares
    busy: float = 0.0  # what rule 2 compares: max(committed share, CPU in use share)
    load: float = 0.0  # what rule 5 compares: busy + ENV_WEIGHT x envs
    envs: int = 0


class _Node:
    """One node's numbers, unpacked from its report once per view."""

    __slots__ = ("name", "accepting", "cpu_cap", "cpu_committed", "mem_free", "headroom", "ceiling", "share",
                 "busy", "load", "envs", "volumes")

    def __init__(self, r: NodeReport):
        c = r.capacity
        self.name = r.node
        self.accepting = r.accepting and r.healthy
        self.cpu_cap = c.cpu_cores + _EPS  # the daemon's own tolerance
        self.cpu_committed = c.cpu_committed_cores
        self.mem_free = c.memory_guaranteed_bytes - c.memory_committed_bytes
        self.headroom = c.memory_headroom_bytes
        self.ceiling = c.memory_guaranteed_bytes
        cpu_share = c.cpu_committed_cores / c.cpu_cores if c.cpu_cores > 0 else 1.0
        mem_share = c.memory_committed_bytes / c.memory_guaranteed_bytes if c.memory_guaranteed_bytes > 0 else 1.0
        self.share = max(cpu_share, mem_share)
        used_share = max(c.cpu_used_cores, 0.0) / c.cpu_cores if c.cpu_cores > 0 else 1.0
        self.envs = c.envs
        self.busy = max(self.share, used_share)
        self.load = self.busy + ENV_WEIGHT * max(c.envs, 0)
        self.volumes = len(r.volumes)


class ClusterView:
    """Reports unpacked for placement: node numbers, and which nodes hold which layer's bytes."""

    def __init__(self, reports: Iterable[NodeReport]):
        self.nodes: list[_Node] = []
        self.by_name: dict[str, int] = {}
        self.layer_index: dict[str, list[tuple[int, int]]] = {}  # digest -> [(node index, bytes)]
        self.volume_ids: dict[str, list[str]] = {}  # volume id -> the node holding it
        self.volume_names: dict[str, list[str]] = {}  # volume name -> the nodes with a volume of that name
        for r in reports:
            if r.node in self.by_name:
                raise PlacementError(f"two reports name node {r.node!r}: node names must be unique")
            i = len(self.nodes)
            self.by_name[r.node] = i
            self.nodes.append(_Node(r))
            seen: set[str] = set()
            for layer in r.layers:
                if layer.digest not in seen:
                    seen.add(layer.digest)
                    self.layer_index.setdefault(layer.digest, []).append((i, layer.size_bytes))
            for snap in r.snapshots:
                for digest, size in snap.layers:
                    if digest not in seen:
                        seen.add(digest)
                        self.layer_index.setdefault(digest, []).append((i, size))
            for vol in r.volumes:
                self.volume_ids.setdefault(vol.id, []).append(r.node)
                if vol.name and r.node not in self.volume_names.get(vol.name, ()):
                    self.volume_names.setdefault(vol.name, []).append(r.node)

        self.order = sorted(range(len(self.nodes)), key=lambda i: (self.nodes[i].load, self.nodes[i].name))

    def __len__(self) -> int:
        return len(self.nodes)


def with_pending(report: NodeReport, reqs: Sequence[PlacementRequest]) -> NodeReport:
    """``report`` as it will read once the envs of ``reqs`` are in it: envs placed on its node whose
    create is in flight, or done but not yet in a report. Their mins are committed (the memory min
    out of today's headroom too), each is one env more, and their layers are on the node ("seen"),
    so concurrent creates are placed as if they came one after the other."""
    if not reqs:
        return report
    c = report.capacity
    mem = sum(r.memory_min_bytes for r in reqs)
    cap = msgspec.structs.replace(c, cpu_committed_cores=c.cpu_committed_cores + sum(r.cpu_min_cores for r in reqs),
                                  memory_committed_bytes=c.memory_committed_bytes + mem,
                                  memory_headroom_bytes=c.memory_headroom_bytes - mem, envs=c.envs + len(reqs))
    held = {x.digest for x in report.layers}
    extra: dict[str, int] = {}
    for r in reqs:
        for digest, size in r.layers:
            if digest not in held:
                extra.setdefault(digest, size)
    layers = [*report.layers, *(LayerHeld(digest=d, size_bytes=s, where="seen") for d, s in extra.items())]
    return msgspec.structs.replace(report, capacity=cap, layers=layers)


def _admits(n: _Node, cpu: float, mem_min: int, mem_max: int) -> bool:
    return (n.accepting and mem_max <= n.ceiling and mem_min <= n.mem_free and mem_min <= n.headroom
            and n.cpu_committed + cpu <= n.cpu_cap)


def _cached(view: ClusterView, req: PlacementRequest) -> dict[int, int]:
    """The plan's bytes each node holds, counted with the plan's own layer sizes: nodes report a
    layer's size as they hold it (a layer tree's bytes on disk, the envlet's blob size), and those
    differ from node to node, so two nodes holding the same layers would not tie on rule 3."""
    cached: dict[int, int] = {}
    seen: set[str] = set()
    for digest, size in req.layers:
        if digest in seen:
            continue
        seen.add(digest)
        for i, _ in view.layer_index.get(digest, ()):
            cached[i] = cached.get(i, 0) + size
    return cached


def _ranked(view: ClusterView, req: PlacementRequest,
            band: float | None = None) -> tuple[list[int], dict[int, int], int]:
    """Indices of the admitting nodes best first, the plan bytes each holds, the home's index."""
    cpu, mem_min, mem_max = req.cpu_min_cores, req.memory_min_bytes, req.memory_max_bytes
    nodes = view.nodes
    cached = _cached(view, req)
    home = view.by_name.get(req.snapshot_home or "", -1)
    pins = {home} if req.snapshot_local else set()
    if req.volumes:  # volumes are node-local: the env starts only on their node
        pins.add(view.by_name.get(_volume_node(view, req) or "", -1))
    if pins:
        pin = pins.pop() if len(pins) == 1 else -1  # a local snapshot and volumes on two nodes: nowhere
        return ([pin] if pin >= 0 and _admits(nodes[pin], cpu, mem_min, mem_max) else []), cached, home
    # view.order is the nodes by (load, name): filtering in that order leaves only the
    # few nodes holding plan bytes (or the home) to sort ahead of the rest
    candidates = [i for i in view.order if (n := nodes[i]).accepting and mem_max <= n.ceiling
                  and mem_min <= n.mem_free and mem_min <= n.headroom and n.cpu_committed + cpu <= n.cpu_cap]
    if not candidates or (not cached and home < 0):
        return candidates, cached, home
    # the load band (rule 2), on the busy share; both parts stay in load order
    limit = min(nodes[i].busy for i in candidates) + (default_band() if band is None else band) + _EPS
    in_band, rest = [], []
    for i in candidates:
        (in_band if nodes[i].busy <= limit else rest).append(i)
    boosted = cached.keys() | {home}
    front = sorted((i for i in in_band if i in boosted),
                   key=lambda i: (-cached.get(i, 0), i != home, nodes[i].load, nodes[i].name))
    front_set = set(front)
    return front + [i for i in in_band if i not in front_set] + rest, cached, home


def _volume_node(view: ClusterView, req: PlacementRequest) -> str | None:
    if req.volume_home is not None:
        return req.volume_home
    try:
        return volume_home(volume_nodes(view, req.volumes))
    except (VolumeConflictError, VolumeNotFoundError):
        return None


def volume_nodes(view: ClusterView, refs: Iterable[str]) -> dict[str, list[str]]:
    """Each volume ref (an id, else a name on a node) -> the nodes whose reports list it."""
    return {ref: sorted(view.volume_ids.get(ref) or view.volume_names.get(ref) or ()) for ref in dict.fromkeys(refs)}


def volume_home(where: Mapping[str, Sequence[str]]) -> str:
    """The one node holding every volume of ``where`` (ref -> the nodes holding it, as
    :func:`volume_nodes` gives it). VolumeNotFoundError for a ref no node holds; VolumeConflictError
    for a name that several nodes have, or volumes of two nodes (an env starts on one node, and
    volumes are node-local)."""
    homes: dict[str, list[str]] = {}
    for ref, nodes in where.items():
        if not nodes:
            raise VolumeNotFoundError(f"volume {ref!r} not found: no node of the cluster holds it")
        if len(nodes) > 1:
            raise VolumeConflictError(f"volume {ref!r}: nodes {', '.join(nodes)} each have a volume of that name "
                                      f"(volumes are node-local): name it by its id")
        homes.setdefault(nodes[0], []).append(ref)
    if len(homes) != 1:
        if not homes:
            raise VolumeNotFoundError("no volume named")
        on = "; ".join(f"{', '.join(repr(r) for r in refs)} on node {node}" for node, refs in sorted(homes.items()))
        raise VolumeConflictError(f"the env mounts volumes of {len(homes)} nodes ({on}): volumes are node-local "
                                  f"and an env runs on one node, so it may mount only volumes of one node")
    return next(iter(homes))


def place_volume(view: ClusterView, *, band: float | None = None) -> list[str]:
    """Nodes for a new volume, best first: accepting nodes within the load band (rule 2) of the least
    busy, those with the fewest volumes first (the envs that will mount a volume are pinned to its
    node, so volumes spread), then by load and name; then the rest by load."""
    nodes = [view.nodes[i] for i in view.order if view.nodes[i].accepting]
    if not nodes:
        return []
    limit = min(n.busy for n in nodes) + (default_band() if band is None else band) + _EPS
    in_band = sorted((n for n in nodes if n.busy <= limit), key=lambda n: (n.volumes, n.load, n.name))
    return [n.name for n in in_band] + [n.name for n in nodes if n.busy > limit]


def rank(view: ClusterView, req: PlacementRequest, *, limit: int | None = None,
         band: float | None = None) -> list[Choice]:
    """The nodes that admit ``req``, best first (at most ``limit``); empty when none does.
    ``band``: rule 2's load band (None: :func:`default_band`)."""
    order, cached, home = _ranked(view, req, band)
    if limit is not None:
        del order[limit:]
    nodes = view.nodes
    return [Choice(node=nodes[i].name, cached_bytes=cached.get(i, 0), home=i == home,
                   committed_share=nodes[i].share, busy=nodes[i].busy, load=nodes[i].load, envs=nodes[i].envs) for i in order]


def _fits(n: _Node, req: PlacementRequest, want: int) -> int:
    """How many envs of ``req`` the node admits one after the other (each counts against the next)."""
    if not _admits(n, req.cpu_min_cores, req.memory_min_bytes, req.memory_max_bytes):
        return 0
    k = want
    if req.memory_min_bytes > 0:
        k = min(k, n.mem_free // req.memory_min_bytes, n.headroom // req.memory_min_bytes)
    cpu = req.cpu_min_cores
    if cpu > 0:  # counted one by one, as the daemon adds them up (no division rounding to trust)
        committed, j = n.cpu_committed, 0
        while j < k and committed + cpu <= n.cpu_cap:
            committed += cpu
            j += 1
        k = j
    return max(k, 0)


def place_group(view: ClusterView, req: PlacementRequest, n: int, *, band: float | None = None) -> list[str]:
    """Nodes for ``n`` envs of ``req`` (one name per env, best node first): the best node takes as
    many as it admits, then the next. Raises PlacementError when the nodes cannot take all ``n``."""
    if n < 1:
        raise PlacementError(f"a group needs at least one env, got n={n}")
    out: list[str] = []
    for i in _ranked(view, req, band)[0]:
        node = view.nodes[i]
        out += [node.name] * _fits(node, req, n - len(out))
        if len(out) == n:
            return out
    raise PlacementError(_why(view, req, n, len(out)))


def place(reports: Sequence[NodeReport], req: PlacementRequest, *, band: float | None = None) -> list[Choice]:
    """:func:`rank` over fresh reports (build a :class:`ClusterView` once to place many envs)."""
    return rank(ClusterView(reports), req, band=band)


def _why(view: ClusterView, req: PlacementRequest, n: int, got: int) -> str:
    """Why no (or not enough) room: counts of nodes by their first unmet rule."""
    reasons: dict[str, int] = {}
    vnode = _volume_node(view, req) if req.volumes else None
    for node in view.nodes:
        if req.volumes and node.name != vnode:
            r = "not the volumes' node"
        elif not node.accepting:
            r = "not accepting (down, lost or draining)"
        elif req.memory_max_bytes > node.ceiling:
            r = "memory max above what the node can give one env"
        elif req.memory_min_bytes > node.mem_free:
            r = "memory mins already guaranteed"
        elif req.memory_min_bytes > node.headroom:
            r = "no memory headroom now"
        elif node.cpu_committed + req.cpu_min_cores > node.cpu_cap:
            r = "cpu mins already guaranteed"
        else:
            r = "room for fewer"
        reasons[r] = reasons.get(r, 0) + 1
    what = (f"cpu min {req.cpu_min_cores:g} cores, memory min {req.memory_min_bytes >> 20} MiB, "
            f"max {req.memory_max_bytes >> 20} MiB")
    where = ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items())) or "no nodes"
    if req.snapshot_local:
        where = (f"snapshot {req.snapshot} is local to node {req.snapshot_home} (publish it to start it "
                 f"elsewhere); {where}")
    if req.volumes:
        vols = ", ".join(repr(v) for v in req.volumes)
        if vnode is None:
            where = f"the env mounts volumes {vols}, which no one node holds; {where}"
        else:
            state = "" if vnode in view.by_name else f" (node {vnode} is not usable: lost, unhealthy or draining)"
            where = (f"the env mounts volume{'s' if len(req.volumes) > 1 else ''} {vols} of node {vnode}, where "
                     f"alone it can start (volumes are node-local){state}; {where}")
    head = f"no node can take {n} env{'s' if n != 1 else ''} ({what})" if got == 0 else \
        f"the nodes can take only {got} of {n} envs ({what})"
    return f"{head}; {len(view.nodes)} nodes: {where}"


def request_for(lock: Plan | Mapping[str, Any], *, snapshot_layers: Sequence[tuple[str, int]] = (),
                snapshot: str | None = None, snapshot_home: str | None = None,
                snapshot_local: bool = False, source: str = "the plan lock") -> PlacementRequest:
    """A placement request from a plan lock as the plan codec reads it: a :class:`weenv.plan.Lock`,
    or a lock's builtins (``plan_to_builtins``, a JSON body, a parsed TOML file: sizes as bytes or
    ``"256MiB"``), which are decoded with ``plan_from_builtins`` first, so every form places alike.
    A plan that is not a lock places by its minimums only (its tags pin no layers).

    Raises :class:`weenv.plan.PlanError` (naming ``source`` and the field) for builtins the codec
    refuses: they would not start on any node either."""
    if isinstance(lock, Mapping):
        lock = plan_from_builtins(dict(lock), Lock if "lock_version" in lock else Plan, source=source)
    elif not isinstance(lock, Plan):
        raise TypeError(f"request_for takes a plan lock (weenv.plan.Lock or its builtins), not {type(lock).__name__}")
    layers = tuple((g.layer_digest, g.layer_size) for g in lock.groups) if isinstance(lock, Lock) else ()
    res = lock.resources
    return PlacementRequest(layers=layers + tuple(snapshot_layers), cpu_min_cores=res.cpu.min,
                            memory_min_bytes=res.memory.min, memory_max_bytes=res.memory.max,
                            snapshot=snapshot, snapshot_home=snapshot_home, snapshot_local=snapshot_local,
                            volumes=tuple(dict.fromkeys(v.name for v in lock.volumes)))


def with_overrides(req: PlacementRequest, overrides: Mapping[str, Any] | None) -> PlacementRequest:
    """``req`` with a create's ``cpu`` / ``memory`` overrides (what the node admits the env with) and
    the volumes its ``volumes`` override mounts; ValueError naming the value when one is not a size or range."""
    from ..plan._units import parse_cpu_range, parse_memory_range

    if not overrides:
        return req
    try:
        if overrides.get("cpu") is not None:
            req = msgspec.structs.replace(req, cpu_min_cores=parse_cpu_range(overrides["cpu"])[0])
        if overrides.get("memory") is not None:
            low, high = parse_memory_range(overrides["memory"])
            req = msgspec.structs.replace(req, memory_min_bytes=low, memory_max_bytes=high)
        extra = overrides.get("volumes")
        if extra is not None:
            if not isinstance(extra, list) or not all(isinstance(v, Mapping) and isinstance(v.get("name"), str)
                                                      for v in extra):
                raise ValueError("volumes: a list of [[volumes]] tables, each with a name")
            req = msgspec.structs.replace(req, volumes=tuple(dict.fromkeys([*req.volumes, *(v["name"] for v in extra)])))
    except (ValueError, TypeError) as e:
        raise ValueError(f"overrides: {e}") from None
    return req
