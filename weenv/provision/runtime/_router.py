"""One runtime over several, and what the daemon asks of the node's runtimes for a plan.

:class:`RuntimeRouter` lets one daemon hold crun envs and gVisor envs side by side: it forwards the
containers interface to the runtime that holds each env and hands out one process host for all of
them (each env's :class:`~._processes.ProcessTarget` comes from its runtime's host).
:func:`node_runtime` is the daemon's router; :func:`plan_runtime` and :func:`start_cpu_hint` say
what a plan's ``runtime`` means for its spec and its first CPU quota.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping

from .._errors import ContainerNotFoundError, HostError
from ._gvisor import GVISOR_START_CPU_CORES, GvisorRuntime
from ._hostcheck import HostFacts, detect_host
from ._processes import ProcessHost, ProcessTarget
from ._runtime import CrunRuntime
from ._seam import C, ContainerState, MemorySnapshots, Runtime

RUNTIMES = ("crun", "gvisor")
#: The annotation that names the runtime of an env (set by the daemon; read by :class:`RuntimeRouter`).
ANNOTATION_RUNTIME = "org.weenv.runtime"


class RuntimeRouter(Runtime):
    """One :class:`Runtime` over several: ``create`` picks the runtime named by the spec's
    :data:`ANNOTATION_RUNTIME` (default ``default``); every other call goes to the runtime that
    holds the env (remembered, or found by asking each). Runtimes are built on first use, so a node
    without runsc runs crun envs and refuses only gVisor ones. The processes of every env are one
    :class:`~._processes.ProcessHost` (``process_host``), told about each env by its runtime's."""

    def __init__(self, factories: Mapping[str, object], default: str):
        if default not in factories:
            raise HostError(f"unknown runtime {default!r} (this node has {', '.join(factories)})")
        self._factories = dict(factories)
        self._runtimes: dict[str, Runtime] = {}
        self.default = default
        self._owner: dict[str, str] = {}
        self.host = self.get(default).host if hasattr(self.get(default), "host") else None
        self.process_host = ProcessHost(self._target)

    def get(self, name: str) -> Runtime:
        """The runtime called ``name``, built now if it was not (raises :class:`HostError` when it cannot run here)."""
        rt = self._runtimes.get(name)
        if rt is None:
            factory = self._factories.get(name)
            if factory is None:
                raise HostError(f"unknown runtime {name!r} (this node has {', '.join(self._factories)})")
            rt = factory() if callable(factory) else factory  # type: ignore[assignment]
            self._runtimes[name] = rt  # type: ignore[assignment]
        return rt  # type: ignore[return-value]

    async def _of(self, env_id: str) -> Runtime:
        name = self._owner.get(env_id)
        if name is not None:
            return self._runtimes[name]
        for name in self._factories:
            try:
                rt = self.get(name)
                await rt.state(env_id)
            except HostError:
                continue
            except ContainerNotFoundError:
                continue
            self._owner[env_id] = name
            return rt
        raise ContainerNotFoundError("no such container", env_id=env_id)

    async def _target(self, env_id: str) -> ProcessTarget:
        return await (await self._of(env_id)).process_host.target(env_id)

    async def create(self, env_id, bundle_dir, rootfs, spec, cgroup_procs=(), **kw) -> int:
        name = spec.get("annotations", {}).get(ANNOTATION_RUNTIME) or self.default
        rt = self.get(name)
        pid = await rt.create(env_id, bundle_dir, rootfs, spec, cgroup_procs, **kw)
        self._owner[env_id] = name
        return pid

    async def start(self, env_id):
        return await (await self._of(env_id)).start(env_id)

    async def kill(self, env_id, sig=signal.SIGKILL):
        return await (await self._of(env_id)).kill(env_id, sig)

    async def delete(self, env_id, force=True):
        try:
            rt = await self._of(env_id)
        except ContainerNotFoundError:
            return
        await rt.delete(env_id, force)
        self._owner.pop(env_id, None)

    async def state(self, env_id):
        return await (await self._of(env_id)).state(env_id)

    async def list(self):
        out: list[ContainerState] = []
        for name in list(self._factories):
            try:
                rt = self.get(name)
            except HostError:
                continue
            for st in await rt.list():
                self._owner.setdefault(st.id, name)
                out.append(st)
        return out

    async def capability(self, env_id: str, kind: type[C]) -> C | None:
        return await (await self._of(env_id)).capability(env_id, kind)


def memory_runtime(runtime: Runtime, name: str | None) -> MemorySnapshots | None:
    """The runtime called ``name`` (None: the default) as a :class:`MemorySnapshots` (to restore
    a new env from an image), None when it cannot checkpoint."""
    rt = runtime.get(name or runtime.default) if isinstance(runtime, RuntimeRouter) else runtime
    return rt if isinstance(rt, MemorySnapshots) else None


def plan_runtime(runtime: Runtime, requested: str | None) -> tuple[dict[str, str], bool]:
    """For a plan's ``runtime`` (None: the node's default): the spec annotations that route the
    env to it, and whether the in-env agent can be its init. Raises :class:`HostError` naming the
    runtime when this daemon cannot run it."""
    if isinstance(runtime, RuntimeRouter):
        name = requested or runtime.default
        return {ANNOTATION_RUNTIME: name}, runtime.get(name).supports_agent
    own = getattr(runtime, "name", "crun")
    if requested is not None and requested != own:
        raise HostError(f'runtime = "{requested}": this daemon runs only {own} envs')
    return {}, runtime.supports_agent


def node_runtime(run_dir: str, default: str = "crun", *, host: HostFacts | None = None) -> RuntimeRouter:
    """The daemon's runtime: crun and gVisor envs side by side, ``default`` for plans that name none."""
    if default not in RUNTIMES:
        raise HostError(f"unknown runtime {default!r} (weenv has {', '.join(RUNTIMES)})")
    host = host if host is not None else detect_host()
    return RuntimeRouter({"crun": lambda: CrunRuntime(run_dir, host=host),
                          "gvisor": lambda: GvisorRuntime(run_dir, host=host)}, default=default)


def start_cpu_hint(routing: Mapping[str, str], start_cpu_cores: float | None) -> float | None:
    """The CPU quota an env starts at (see :data:`~._gvisor.GVISOR_START_CPU_CORES`); crun envs keep theirs."""
    if routing.get(ANNOTATION_RUNTIME) != "gvisor":
        return start_cpu_cores
    return max(start_cpu_cores or 0.0, GVISOR_START_CPU_CORES)
