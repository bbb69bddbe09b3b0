"""The runtime seam: what the daemon drives to run an env, and nothing of how.

- :class:`Containers` is the small interface every runtime implements: create (the init parked),
  start, kill, delete, state, list. crun (:mod:`._runtime`) and gVisor (:mod:`._gvisor`) implement
  it side by side, neither built on the other; :class:`~._router.RuntimeRouter` forwards it to the
  runtime that holds an env.
- The processes of an env (exec, background processes and their handles) are no runtime's own:
  one :class:`~._processes.ProcessHost` runs them for every runtime, through the env's agent or,
  without one, through the runtime's own exec. A runtime hands its host out as ``process_host``;
  :class:`Runtime`, the type the daemon holds, is the containers plus that host's calls.
- What only some runtimes can do is an optional :class:`Capability`, found with
  :meth:`Containers.capability` (None where the runtime has none), never a method that raises by
  default. The first is :class:`MemorySnapshots` (checkpoint/restore of an env's processes:
  gVisor's; CRIU's for crun where a working CRIU >= 4.1 is found; docs/snapshots.md). Pause and
  resume without it are the freezer's (the env's cgroup), for every runtime alike.
"""

from __future__ import annotations

import abc
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec
import trio

from ... import _wire as wire

if TYPE_CHECKING:
    from ._processes import ProcessHost

DEFAULT_MAX_OUTPUT_BYTES = 16 << 20

OutputCallback = Callable[[str, bytes], Awaitable[None] | None]

ExecResult = wire.ExecResult
"""What one command did (one type from runtime to client: :class:`weenv._wire.ExecResult`)."""


class ContainerState(msgspec.Struct, frozen=True, kw_only=True):
    """A runtime's view of one container: status is "created", "running", "paused" or "stopped"."""

    id: str
    pid: int
    status: str
    bundle: str = ""
    created: str = ""


class ProcessStream(Protocol):
    """An attached process handle (docs/architecture.md, "Processes"): its events come in
    (:class:`weenv._wire.ProcessEvent`: output, ``dropped``, then ``end``), stdin, signals and pty
    sizes go out. Closing it detaches; the process runs on."""

    pid: int
    pty: bool
    end: wire.ProcessEnd | None

    async def receive(self) -> wire.ProcessEvent | None:
        """The next event; None after ``end``."""

    def __aiter__(self) -> AsyncIterator[wire.ProcessEvent]: ...

    async def write_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    async def signal(self, sig: int) -> None: ...

    async def resize(self, rows: int, cols: int) -> None: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> "ProcessStream": ...

    async def __aexit__(self, *exc: object) -> None: ...


class Capability(abc.ABC):
    """An optional part of a runtime, beyond :class:`Containers`. A runtime that has one also
    subclasses it; :meth:`Containers.capability` finds it for an env (None: that env's runtime
    cannot, and says so rather than doing half of it)."""


C = TypeVar("C", bound=Capability)


class MemorySnapshots(Capability):
    """Checkpoint and restore an env's processes with their memory (docs/snapshots.md, "Memory").

    A checkpoint writes the env's whole process state into ``image_dir`` (which must be empty); the
    env's files are not in it (they are the env's rootfs, sealed apart). A restore is a create from
    such an image: the init and every process come back with their pids, open files and memory, over
    the rootfs and spec given (the same plan's: a fork's copy has its own rootfs, cgroups and id)."""

    memory_runtime: str
    """What the image is for (``"gvisor"``): an image restores only under the runtime that made it."""

    @abc.abstractmethod
    async def checkpoint(self, env_id: str, image_dir: str, *, leave_running: bool = False) -> None:
        """Write the env's process state to ``image_dir``. ``leave_running`` False: the env's
        processes end once it is written (their memory is freed); True: the env runs on (restored
        from the image it just wrote, as its own copy). A checkpoint that fails leaves the env
        running as it was, or raises :class:`ContainerError` saying it did not."""

    @abc.abstractmethod
    async def restore(self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, image_dir: str,
                      cgroup_procs: Sequence[str] = ()) -> int:
        """:meth:`Containers.create` (and start) from the image in ``image_dir``; the init's host pid."""

    def image_facts(self) -> dict[str, str]:
        """What an image made here depends on (runtime version, platform), recorded with it."""
        return {"runtime": self.memory_runtime}


class Containers(abc.ABC):
    """The containers of one runtime. Every method is async and never blocks the trio loop."""

    name: str
    """What a plan calls this runtime (``runtime = "crun"``)."""
    supports_agent: bool = True
    """Whether weenv-agent can be the init of its envs (process handles need it)."""

    @abc.abstractmethod
    async def create(
        self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, cgroup_procs: Sequence[str] = (),
        *, listen_fd: int | None = None,
    ) -> int:
        """Set the container up with its init parked before exec; returns the init's host pid.
        ``listen_fd`` is handed to the init as descriptor 3 (the in-env agent's listening socket).
        The caller may attach it to more cgroups or adjust limits, then :meth:`start` it."""

    @abc.abstractmethod
    async def start(self, env_id: str) -> None:
        """Let the init run."""

    @abc.abstractmethod
    async def kill(self, env_id: str, sig: int = signal.SIGKILL) -> None:
        """Signal the env's init (SIGKILL ends every process of the env: it is pid 1)."""

    @abc.abstractmethod
    async def delete(self, env_id: str, force: bool = True) -> None:
        """Remove the container (killing it if ``force``); a no-op when it is already gone.
        Returns once the init has exited."""

    @abc.abstractmethod
    async def state(self, env_id: str) -> ContainerState:
        """Raises :class:`ContainerNotFoundError` for an unknown env id."""

    @abc.abstractmethod
    async def list(self) -> list[ContainerState]:
        """Every container in this runtime's state directory (to re-adopt after a restart)."""

    async def capability(self, env_id: str, kind: type[C]) -> C | None:
        """The runtime of ``env_id`` as a ``kind`` (a :class:`Capability`), None when it has none."""
        await trio.lowlevel.checkpoint()
        return self if isinstance(self, kind) else None


class Runtime(Containers):
    """What the daemon holds: the containers and the processes in them. The processes are the
    runtime's ``process_host`` (:class:`~._processes.ProcessHost`, one implementation for crun,
    gVisor and the router alike; see it for what each call does); the calls below are its, by env
    id. A runtime that keeps processes of its own (:class:`weenv.testing.FakeRuntime`, in memory)
    overrides them instead."""

    process_host: ProcessHost

    async def exec(self, env_id: str, argv: Sequence[str], **options) -> ExecResult:
        """Run ``argv`` in the env and collect its output (:meth:`~._processes.ProcessHost.exec`)."""
        return await self.process_host.exec(env_id, argv, **options)

    async def start_process(self, env_id: str, argv: Sequence[str], **options) -> ProcessStream:
        """Start ``argv`` as a background process, attached (:meth:`~._processes.ProcessHost.start_process`)."""
        return await self.process_host.start_process(env_id, argv, **options)

    async def connect_process(self, env_id: str, pid: int) -> ProcessStream:
        return await self.process_host.connect_process(env_id, pid)

    async def list_processes(self, env_id: str) -> list[wire.ProcessInfo]:
        return await self.process_host.list_processes(env_id)

    async def send_stdin(self, env_id: str, pid: int, data: bytes, *, close: bool = False) -> None:
        await self.process_host.send_stdin(env_id, pid, data, close=close)

    async def signal_process(self, env_id: str, pid: int, sig: int) -> None:
        await self.process_host.signal_process(env_id, pid, sig)

    async def resize_process(self, env_id: str, pid: int, rows: int, cols: int) -> None:
        await self.process_host.resize_process(env_id, pid, rows, cols)

    async def wait_process(self, env_id: str, pid: int, timeout_s: float | None = None) -> wire.ProcessEnd | None:
        return await self.process_host.wait_process(env_id, pid, timeout_s)
