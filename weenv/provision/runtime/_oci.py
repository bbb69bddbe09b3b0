"""What crun and runsc share as OCI runtimes, as parts each of them holds (neither is built on the other).

- :class:`OciCli`: one call of the runtime's binary (its global flags first) and its failure
  mapped: no such container is :class:`ContainerNotFoundError`, anything else
  :class:`ContainerError` with the runtime's stderr.
- :class:`EnvTable`: what a runtime knows of each env it holds, for the process host: the init's
  pid and OCI process, whether it was started, its agent. Filled by create and start, emptied by
  delete, and rebuilt from the runtime's own state on a miss (after a daemon restart the env runs
  on).
- :func:`write_config`, :func:`log_tail`, :func:`create_failure`: the bundle's ``config.json`` as
  create writes it, and the logs a failed create is told from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence

import trio

from .._errors import ContainerError, ContainerNotFoundError
from ._ns import TRAMPOLINE_FAILED
from ._ocispec import ANNOTATION_AGENT_SOCKET, ANNOTATION_EXEC_USER, User
from ._processes import OwnExec, ProcessTarget
from ._seam import ContainerState


class OciCli:
    """The command line of one OCI runtime: ``base`` (the binary and its global flags), and the
    words its stderr has when the container does not exist."""

    def __init__(self, name: str, base: Sequence[str], no_container: Sequence[bytes]):
        self.name = name
        self.base = list(base)
        self._no_container = tuple(no_container)

    async def run(self, *args: str, env_id: str | None = None) -> bytes:
        """``base + args``, to its end; its stdout."""
        proc = await trio.run_process([*self.base, *args], capture_stdout=True, capture_stderr=True, check=False)
        if proc.returncode != 0:
            detail = proc.stderr.decode(errors="replace")
            if env_id is not None and any(m in proc.stderr for m in self._no_container):
                raise ContainerNotFoundError("no such container", env_id=env_id, detail=detail)
            raise ContainerError(f"{self.name} {args[0]} failed with exit status {proc.returncode}", env_id=env_id,
                                 detail=detail)
        return proc.stdout


class EnvTable:
    """The envs one runtime holds, as its process host needs them. ``state`` is the runtime's;
    ``spec_path(env_id, state)`` names the config the runtime keeps of a container (read back on
    a miss; ``missing`` says what is wrong when it is not there). ``agents``: whether the envs of
    this runtime can have the agent (its socket is in the spec's annotations)."""

    def __init__(self, state: Callable[[str], Awaitable[ContainerState]], spec_path: Callable[[str, ContainerState], str],
                 missing: str, *, agents: bool):
        self._state = state
        self._spec_path = spec_path
        self._missing = missing
        self._agents_ok = agents
        # env id -> (init pid, the container's process spec); rebuilt from the runtime's state on miss.
        self._known: dict[str, tuple[int, dict]] = {}
        # Env ids started here (or found running): crun would exec into a container that is still
        # parked before start, where the root is not yet nodev; we do not.
        self._started: set[str] = set()
        # env id -> (agent socket on the host, default exec user) for envs whose init is weenv-agent
        self._agents: dict[str, tuple[str, User]] = {}

    def __contains__(self, env_id: str) -> bool:
        return env_id in self._known

    def created(self, env_id: str, init_pid: int, spec: Mapping) -> None:
        self._known[env_id] = (init_pid, spec.get("process", {}))
        self._note_agent(env_id, spec)
        self._started.discard(env_id)

    def has_agent(self, env_id: str) -> bool:
        return env_id in self._agents

    def started(self, env_id: str) -> None:
        self._started.add(env_id)

    def forget(self, env_id: str) -> int:
        """Drop the env; its init's pid as last known (0: not known)."""
        known = self._known.pop(env_id, None)
        self._agents.pop(env_id, None)
        self._started.discard(env_id)
        return known[0] if known else 0

    async def lookup(self, env_id: str) -> tuple[int, dict]:
        """(init pid, the init's OCI process); raises ContainerNotFoundError."""
        known = self._known.get(env_id)
        if known is not None:
            return known
        st = await self._state(env_id)
        try:
            with open(self._spec_path(env_id, st), "rb") as f:
                spec = json.loads(f.read())
        except OSError as exc:
            raise ContainerNotFoundError(self._missing, env_id=env_id) from exc
        known = (st.pid, spec.get("process", {}))
        self._note_agent(env_id, spec)
        if st.pid > 0:
            self._known[env_id] = known
        if st.status in ("running", "paused"):
            self._started.add(env_id)
        return known

    async def target(self, env_id: str, runtime: OwnExec) -> ProcessTarget:
        _pid, process = await self.lookup(env_id)
        return ProcessTarget(process=process, started=env_id in self._started, agent=self._agents.get(env_id),
                             runtime=runtime)

    def _note_agent(self, env_id: str, spec: Mapping) -> None:
        notes = spec.get("annotations", {})
        sock = notes.get(ANNOTATION_AGENT_SOCKET) if self._agents_ok else None
        if not sock:
            self._agents.pop(env_id, None)
            return
        uid, gid, gids, home = json.loads(notes.get(ANNOTATION_EXEC_USER, "[0, 0, [], \"/root\"]"))
        self._agents[env_id] = (sock, User(uid=uid, gid=gid, additional_gids=tuple(gids), home=home or "/"))


def write_config(bundle_dir: str, spec: Mapping, *stale: str) -> None:
    """``spec`` as the bundle's config.json; the files a previous create left (``stale``: its pid
    file, its logs) removed. A few KiB to the page cache: not worth a thread hop on the start path."""
    with open(os.path.join(bundle_dir, "config.json"), "wb") as f:
        f.write(json.dumps(spec).encode())
    for path in stale:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def log_tail(path: str, start: int = 0) -> str:
    """The last 4000 bytes of the log at ``path`` from offset ``start`` on ("" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read()[-4000:].decode(errors="replace")
    except OSError:
        return ""


def create_failure(returncode: int, detail: str, cgroup_procs: Sequence[str]) -> str:
    """What a create that exited ``returncode`` with the logs' ``detail`` says: the trampoline's
    failure has no log of its own."""
    if returncode == TRAMPOLINE_FAILED and not detail:
        return f"could not write the new process into {', '.join(cgroup_procs)}"
    return detail
