"""gVisor (``runsc``) as the runtime of envs that run code nobody trusts: :class:`GvisorRuntime`, the
containers interface over runsc, beside crun's (:mod:`._runtime`), not built on it; its commands
are the shared process host's (:mod:`._processes`), what is runsc's in them is :class:`_RunscExec`.

Under gVisor the env's processes never make a system call to the host kernel: the sandbox's own
kernel (the Sentry, a user-space Go program) serves them, and a separate gofer process opens the
rootfs files for it. What is unchanged from crun, and why it still works:

- rootfs: the same host overlay over envlet lowers; the gofer serves it to the Sentry. The root
  and every other mount use ``--file-access=shared``, so a file the daemon writes into the rootfs
  from the host (``weenv cp``, the files API) is seen at once inside, and a commit that reads the
  upper from the host sees what the env wrote. gVisor would mount a tmpfs on an empty ``/tmp``;
  the runtime binds the rootfs's own ``/tmp`` there, so /tmp is committed like every other path.
- cgroups: ``--ignore-cgroups``; as with crun, the ``runsc run`` process is written into the
  env's groups before it execs (the same shell trampoline), so the gofer and the sandbox (and so
  every process of the env, and the Sentry's memory) are born there. Limits, the elastic monitor
  and the freezer (pause/resume and commit freeze the sandbox whole) act on them unchanged.
- exec: ``runsc exec --process`` with the full OCI process, as ``crun exec``. There is no in-env
  agent: this runsc release cannot hand a listening socket to the init (no ``--preserve-fds``), and
  the exit status of ``runsc exec`` comes from the Sentry over its control socket on the host,
  which nothing in the env can reach or answer for. A timeout kills the command's in-sandbox
  process tree (``runsc ps`` + ``runsc kill --pid``).
- network: ``--network=none``: the sandbox has its own network stack with only a loopback
  device and no way to the host's. ``egress`` and ``host`` are refused.
- paths: runsc's gofer opens the rootfs and the bind sources as the env's root (the range's root,
  in the env's user namespace), and runsc takes absolute paths only, so every directory above
  them would have to let that uid through, ``$WEENV_HOME``'s parents too (``/root``, a ``mktemp
  -d``: 0700). ``runsc run`` is therefore spawned in a mount namespace of its own where a small
  tmpfs on :data:`~._runsc.RUNSC_VIEW_DIR` holds the env's rootfs and bundle, bound in, and the spec names
  them there (:func:`~._runsc.runsc_view_spec`). Nothing of it is on the host, and nothing is left to
  clean up: the namespace goes with ``runsc run``, once gofer and sandbox hold their own mounts.
  Plan mounts keep their own paths; one the env's root cannot reach is named in the error.

The platform (how the Sentry intercepts system calls) is probed, never assumed: ``kvm`` when
``/dev/kvm`` runs a probe container within a few seconds, else ``ptrace``
(:func:`~._runsc.probe_platform`). The answer is cached per runsc version and kernel in the
runtime's state directory. What runsc is asked apart from running envs is :mod:`._runsc`'s.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence

import msgspec
import trio

from .._errors import ContainerError, ContainerExistsError, ContainerNotFoundError, HostError
from ._hostcheck import HostFacts, detect_host
from ._ns import _CgroupFds, _empty_stdin, in_fresh_thread
from ._oci import EnvTable, OciCli, create_failure, log_tail, write_config
from ._processes import ExecCall, ProcessHost, ProcessTarget
from ._runsc import (
    PLATFORMS,
    RUNSC_VIEW_DIR,
    PlatformProbe,
    ensure_view_dir,
    enter_runsc_view,
    gvisor_spec,
    probe_platform,
    ps_table,
    range_root,
    runsc_view_spec,
    sandbox_alive,
    unreachable_message,
    unreachable_sources,
)
from ._checkpoint import RunscCheckpoints
from ._seam import DEFAULT_MAX_OUTPUT_BYTES, ContainerState, ExecResult, Runtime

log = logging.getLogger("weenv.runtime")

_NO_CONTAINER = (b"file does not exist", b"does not exist")
# runsc exec's words (exit status 128) when the command could not be started in the sandbox.
_EXEC_FAILED = b"executing processes for container"
# ... and when the sandbox went away while it waited for the command.
_SANDBOX_GONE = re.compile(rb'^waiting on pid \d+: .*in sandbox .*(EOF|connection refused|connection reset)', re.M)

#: A gVisor env starts with this CPU quota (clamped to its plan's range), not at its min: the
#: sandbox's kernel finishes booting and loads the first command's binary on the env's CPU, and at
#: a 0.05-core min the first exec took ~280 ms instead of ~50 ms. The monitor halves it when idle.
GVISOR_START_CPU_CORES = 1.0


HOST_CACHE_DIR = "/var/cache/weenv"
"""Machine-wide facts every daemon on a machine shares (the gVisor platform probe: runsc version and kernel)."""


def _writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


class GvisorRuntime(Runtime, RunscCheckpoints):
    """Runs runsc for real. ``run_dir`` is weenv's; runsc's state goes to ``run_dir/runsc``.
    ``platform`` None: probed (and cached in the state directory).

    One difference from the seam: :meth:`create` already lets the init run (``runsc run
    --detach``, ~40 ms less than create + start), so the env is "running" before :meth:`start`;
    exec still waits for start. Nothing weenv does between the two needs the init parked."""

    name = "gvisor"
    supports_agent = False
    no_process_handles = (
        "process handles (background processes, attach, stdin, signals, pty) are not available under gVisor: "
        "they live in the in-env agent, which gVisor envs do not run; use exec, or runtime = \"crun\"")

    def __init__(
        self,
        run_dir: str,
        *,
        host: HostFacts | None = None,
        platform: str | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        drain_grace_s: float = 0.1,
        kill_grace_s: float = 5.0,
        view_dir: str = RUNSC_VIEW_DIR,
    ):
        self.host = host if host is not None else detect_host()
        self.runsc = self.host.require_runsc()
        self.state_dir = os.path.join(run_dir, "runsc")
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self.view_dir = view_dir
        ensure_view_dir(view_dir)
        if platform is not None and platform not in PLATFORMS:
            raise HostError(f"unknown gVisor platform {platform!r} (this runsc knows {', '.join(PLATFORMS)})")
        self.platform = platform  # None until the first create probes it (off the daemon's start)
        self.platform_probe: PlatformProbe | None = None
        self._probe_lock = trio.Lock()
        self.max_output_bytes = max_output_bytes
        self.drain_grace_s = drain_grace_s
        self.kill_grace_s = kill_grace_s
        # The platform is the sandbox's: only create takes it; exec, kill, state talk to the sandbox.
        # runsc with --ignore-cgroups does not mind a hybrid host (no private mount namespace, as crun's).
        self._cli = OciCli("runsc", [
            self.runsc, "--root", self.state_dir, "--network=none", "--ignore-cgroups", "--overlay2=none",
            "--file-access=shared", "--file-access-mounts=shared", "--oci-seccomp",
            # more runsc flags for debugging, e.g. "--debug --debug-log=/tmp/runsc/" or "--strace"
            *shlex.split(os.environ.get("WEENV_RUNSC_FLAGS", ""))], _NO_CONTAINER)
        self._deleting: set[str] = set()  # killed, runsc delete still polling for the reap
        # env id -> what its create was given (bundle, rootfs, spec, cgroups): a checkpoint that
        # leaves the env running restores it over the same (this daemon's creates only)
        self._boots: dict[str, tuple[str, str, dict, tuple[str, ...]]] = {}
        self._envs = EnvTable(self.state, lambda _env_id, st: os.path.join(st.bundle, "config.json"),
                              "runsc's bundle has no config for this container", agents=False)
        self.process_host = ProcessHost(self.process_target)

    async def ensure_platform(self) -> str:
        """The platform, probed (in a worker thread, once, however many envs start at once) unless
        given or cached: ~1 s on a new runsc or kernel, plus the kvm probe's 5 s bound where kvm
        hangs. The answer is the machine's, kept for every daemon on it (:data:`HOST_CACHE_DIR`,
        where it can be written; else this daemon's run dir). The daemon probes at start
        (``EnvManager.run``), so no env waits for it: a parked env moved here restored in 5.9 s
        instead of 0.5 s on a node that had not run a gVisor env yet."""
        async with self._probe_lock:
            if self.platform is None:
                cache = HOST_CACHE_DIR if _writable_dir(HOST_CACHE_DIR) else self.state_dir
                found = await trio.to_thread.run_sync(
                    lambda: probe_platform(self.runsc, self.host.require_init(), cache_dir=cache))
                self.platform_probe = found
                self.platform = found.platform
                log.info("gVisor envs run on the %s platform (%s)", found.platform,
                         ", ".join(f"{k}: {v}" for k, v in found.results.items()))
        return self.platform

    async def process_target(self, env_id: str) -> ProcessTarget:
        return await self._envs.target(env_id, self)

    def exec_call(self, env_id: str, process_path: str) -> ExecCall:
        return _RunscExec(self, env_id, process_path)

    # -- Containers ------------------------------------------------------------------------------

    async def create(
        self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, cgroup_procs: Sequence[str] = (),
        *, listen_fd: int | None = None,
    ) -> int:
        if listen_fd is not None:
            raise ContainerError("gVisor envs have no in-env agent (runsc cannot pass it a socket)", env_id=env_id)
        await self.wait_deleted(env_id)  # a new boot of an env just stopped (pause memory=false, resume)
        # runsc itself, given an id it already has, fails and takes the existing container's state
        # with it (its sandbox left running with nothing to find it by): refuse before it runs.
        if env_id in self._envs or env_id in self._deleting or os.path.exists(self._state_file(env_id)):
            raise ContainerExistsError("a container with this id already exists", env_id=env_id)
        init_pid = await self._launch(env_id, bundle_dir, rootfs, spec, cgroup_procs, ["run", "--detach"])
        self._boots[env_id] = (os.path.abspath(bundle_dir), rootfs, dict(spec), tuple(cgroup_procs))
        return init_pid

    async def _launch(self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, cgroup_procs: Sequence[str],
                      verb: Sequence[str]) -> int:
        """``runsc <verb>`` (``run --detach``, or ``restore --detach --image-path ...``) of the env in
        its view and cgroups; the init's host pid. A failure undoes what runsc left."""
        spec = gvisor_spec(spec, rootfs)
        platform = await self.ensure_platform()
        bundle_dir = os.path.abspath(bundle_dir)
        gid = range_root(spec)[1]
        spec = runsc_view_spec(spec, rootfs, bundle_dir, self.view_dir)
        pid_file = os.path.join(bundle_dir, "init.pid")
        log_path = os.path.join(bundle_dir, "runsc.log")
        write_config(bundle_dir, spec, pid_file, log_path)
        # The init's stdout/stderr go to a log in the bundle (runsc hands its own stdio to the
        # sandbox, so a pipe would never see EOF); runsc's own errors land there too.
        init_log_path = os.path.join(bundle_dir, "init.log")
        init_log = os.open(init_log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        log_start = os.fstat(init_log).st_size
        try:
            with _CgroupFds(cgroup_procs) as cg:
                argv = cg.wrap([*self._cli.base, f"--platform={platform}", *verb, "--bundle", bundle_dir,
                                "--pid-file", pid_file, "--user-log", log_path, env_id])
                returncode = await self._run_in_view(env_id, argv, os.path.abspath(rootfs), bundle_dir, gid, init_log,
                                                     cg.fds)
        except OSError as exc:
            raise ContainerError("could not open the env's cgroups", env_id=env_id, detail=str(exc)) from exc
        finally:
            os.close(init_log)
        if returncode != 0:
            detail = create_failure(returncode, log_tail(init_log_path, log_start) + log_tail(log_path), cgroup_procs)
            if "already exists" in detail or "address already in use" in detail:
                # the latter: a sandbox of this id holds its control socket, here or under another
                # runsc root (the socket is in the host-wide abstract namespace); never delete it
                raise ContainerExistsError("a container with this id already exists (gVisor sandbox ids are host-wide)",
                                           env_id=env_id, detail=detail)
            with trio.CancelScope(shield=True):
                await self.delete(env_id)
                # rootfs and bundle reach runsc through its view; a plan mount's source may still be out of reach
                blocked = await trio.to_thread.run_sync(unreachable_sources, spec, self.view_dir)
            if blocked:
                raise ContainerError(unreachable_message(blocked, range_root(spec)[0]), env_id=env_id, detail=detail)
            raise ContainerError(f"runsc {verb[0]} failed with exit status {returncode}", env_id=env_id, detail=detail)
        with open(pid_file) as f:
            init_pid = int(f.read().strip())
        self._envs.created(env_id, init_pid, spec)
        return init_pid

    async def _run_in_view(self, env_id: str, argv: list[str], rootfs: str, bundle_dir: str, gid: int,
                           output: int, fds: Sequence[int]) -> int:
        """Run ``runsc run`` (``argv``) in a mount namespace of its own that shows the env's rootfs
        and bundle under :attr:`view_dir` (:func:`enter_runsc_view`); its exit status.
        Cancellation kills it."""

        def spawn() -> subprocess.Popen:
            enter_runsc_view(self.view_dir, rootfs, bundle_dir, gid)
            stdin_r = _empty_stdin()  # not /dev/null: runsc chowns its stdio to the sandbox's user
            try:
                return subprocess.Popen(argv, stdin=stdin_r, stdout=output, stderr=output, pass_fds=tuple(fds))
            finally:
                os.close(stdin_r)

        try:
            proc = await trio.to_thread.run_sync(in_fresh_thread, spawn)
        except OSError as exc:
            raise ContainerError("could not show runsc the env's rootfs (in a mount namespace of its own)",
                                 env_id=env_id, detail=str(exc)) from exc
        pidfd = os.pidfd_open(proc.pid)
        try:
            await trio.lowlevel.wait_readable(pidfd)
        except BaseException:
            proc.kill()
            raise
        finally:
            os.close(pidfd)
            if proc.returncode is None:
                proc.wait()
        return proc.returncode

    async def start(self, env_id: str) -> None:
        """The init already runs (``create`` is ``runsc run --detach``: one runsc process and
        sandbox round trip fewer than create + start, ~40 ms here; nothing has to happen between
        the two under gVisor, whose root needs no remount)."""
        await self._envs.lookup(env_id)
        self._envs.started(env_id)

    async def _kill_sandbox_tree(self, env_id: str, root: int, *, rounds: int = 5) -> None:
        """SIGKILL ``root`` (a pid inside the sandbox) and its descendants, until a scan finds none
        (at most ``rounds`` scans). A job that left the tree before the scan (reparented to the
        init) is not found: gVisor's ps does not report sessions."""
        for _ in range(rounds):
            try:
                out = await self._cli.run("ps", env_id, env_id=env_id)
            except ContainerError:
                return
            table = ps_table(out)
            tree, grew = {root} & set(table), True
            while grew:
                grew = False
                for pid, ppid in table.items():
                    if pid not in tree and ppid in tree:
                        tree.add(pid)
                        grew = True
            if not tree:
                return
            async with trio.open_nursery() as n:
                for pid in tree:
                    n.start_soon(self._kill_pid, env_id, pid)
            await trio.sleep(0.01)

    async def _kill_pid(self, env_id: str, pid: int) -> None:
        try:
            await self._cli.run("kill", "--pid", str(pid), env_id, str(int(signal.SIGKILL)), env_id=env_id)
        except ContainerError:
            pass  # gone already

    async def kill(self, env_id: str, sig: int = signal.SIGKILL) -> None:
        await self._cli.run("kill", env_id, str(int(sig)), env_id=env_id)

    async def delete(self, env_id: str, force: bool = True) -> None:
        """Kill the sandbox and its gofer and return once both have exited (the env's files and
        mounts are free then); ``runsc delete`` removes runsc's state afterwards, in the
        background: it polls until the dead sandbox is *reaped*, and its reaper is PID 1 (an
        orphan), which on this VM reaps every ~2 s. Until it is done the env is already gone for
        :meth:`state` and :meth:`list`."""
        self._envs.forget(env_id)
        self._boots.pop(env_id, None)
        if env_id in self._deleting:
            return
        try:
            st = await self.state(env_id)
        except ContainerNotFoundError:
            return
        if not force and st.status in ("running", "paused"):
            raise ContainerError("container is running (delete with force=True)", env_id=env_id)
        pids = [st.pid, self._gofer_pid(env_id)]
        pidfds = []
        try:
            for pid in pids:
                if pid > 0 and sandbox_alive(pid, self.state_dir):
                    try:
                        fd = os.pidfd_open(pid)
                    except OSError:
                        continue
                    pidfds.append(fd)
                    if sandbox_alive(pid, self.state_dir):  # still ours now that the pidfd pins it
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
            with trio.move_on_after(self.kill_grace_s):
                for fd in pidfds:
                    await trio.lowlevel.wait_readable(fd)
        finally:
            for fd in pidfds:
                os.close(fd)
        self._deleting.add(env_id)
        if not pidfds:  # dead before we came (a leftover): no reap to wait for, or it is long done
            await self._remove_state(env_id)
            return
        trio.lowlevel.spawn_system_task(self._remove_state, env_id, name=f"runsc delete {env_id}")

    async def wait_deleted(self, env_id: str, timeout_s: float = 10.0) -> None:
        """Wait until a :meth:`delete` of ``env_id`` has removed runsc's state (it polls for the
        dead sandbox's reap, ~2 s here), so that the id can be created again."""
        with trio.move_on_after(timeout_s):
            while env_id in self._deleting:
                await trio.sleep(0.02)

    def _gofer_pid(self, env_id: str) -> int:
        try:
            with open(self._state_file(env_id), "rb") as f:
                return int(json.loads(f.read()).get("goferPid") or 0)
        except (OSError, ValueError):
            return 0

    async def _remove_state(self, env_id: str) -> None:
        try:
            await self._cli.run("delete", "--force", env_id, env_id=env_id)
        except ContainerNotFoundError:
            pass
        except BaseException as e:  # a system task must not raise; cancelled at the run's end, the
            # state stays and the next list() shows the env "stopped" for gc to delete again
            if not isinstance(e, (Exception, trio.Cancelled)):
                raise
            log.warning("env %s: runsc delete did not finish: %s", env_id, e)
        finally:
            self._deleting.discard(env_id)

    # state and list read runsc's state files instead of running runsc: `runsc state` asks the
    # sandbox over its control socket, and a sandbox frozen by the freezer (a paused env, or one a
    # commit froze) never answers, so a daemon re-adopting a paused env hung for good.

    def _state_file(self, env_id: str) -> str:
        return os.path.join(self.state_dir, f"{env_id}_sandbox:{env_id}.state")

    def _read_state(self, path: str, env_id: str) -> ContainerState:
        try:
            with open(path, "rb") as f:
                d = json.loads(f.read())
        except FileNotFoundError:
            raise ContainerNotFoundError("no such container", env_id=env_id) from None
        except (OSError, ValueError) as e:
            raise ContainerError("runsc's state file cannot be read", env_id=env_id, detail=f"{path}: {e}") from None
        pid = int((d.get("sandbox") or {}).get("pid") or 0)
        status = d.get("status", "unknown")
        if status in ("created", "running", "paused") and not sandbox_alive(pid, self.state_dir):
            status = "stopped"
        return ContainerState(id=d.get("id", env_id), pid=pid, status=status, bundle=d.get("bundleDir", ""),
                              created=d.get("createdAt", ""))

    async def state(self, env_id: str) -> ContainerState:
        await trio.lowlevel.checkpoint()
        if env_id in self._deleting:
            raise ContainerNotFoundError("no such container (being deleted)", env_id=env_id)
        return self._read_state(self._state_file(env_id), env_id)

    async def list(self) -> list[ContainerState]:
        await trio.lowlevel.checkpoint()
        out = []
        for name in sorted(os.listdir(self.state_dir)):
            cid, sep, rest = name.partition("_sandbox:")
            if sep and rest == f"{cid}.state" and cid not in self._deleting:  # a root container: one env, one sandbox
                try:
                    out.append(self._read_state(os.path.join(self.state_dir, name), cid))
                except ContainerNotFoundError:
                    continue  # deleted meanwhile
        return out


class _RunscExec(ExecCall):
    """``runsc exec --process``: runsc's errors are on its stderr (exit status 128); the command's
    pid in the sandbox goes to a file, so that a timeout can kill its tree there (the host does not
    see the sandbox's processes)."""

    def __init__(self, runtime: GvisorRuntime, env_id: str, process_path: str):
        self._runtime = runtime
        self.env_id = env_id
        self._pid_dir = tempfile.mkdtemp(prefix="exec-", dir=runtime.state_dir)
        self._pid_file = os.path.join(self._pid_dir, "pid")
        self.argv = [*runtime._cli.base, "exec", f"--process={process_path}", "--internal-pid-file", self._pid_file,
                     env_id]

    async def kill_tree(self, proc: trio.Process) -> None:
        try:
            with open(self._pid_file) as f:
                root = int(f.read().strip() or 0)
        except (OSError, ValueError):
            root = 0
        if root > 0:
            await self._runtime._kill_sandbox_tree(self.env_id, root)

    def result(self, result: ExecResult, argv: Sequence[str]) -> ExecResult:
        """runsc exec exits 128 with its own words on stderr when the command never started, or
        when the sandbox died under it (all of the env: e.g. the kernel's OOM kill at the env's hard
        memory limit, which under gVisor picks the sandbox, the one process holding the env's memory)."""
        env_id = self.env_id
        if result.exit_code == 128 and _SANDBOX_GONE.search(result.stderr) and not result.timed_out:
            raise ContainerError("the env's gVisor sandbox died while the command ran (at its memory max? under "
                                 "gVisor, what the env writes to files is held in the sandbox's memory too)",
                                 env_id=env_id, detail=result.stderr.decode(errors="replace")[-2000:])
        if result.exit_code != 128 or _EXEC_FAILED not in result.stderr or result.timed_out:
            return result
        err = result.stderr
        if b"file does not exist" in err and b"container" in err.split(_EXEC_FAILED)[0]:
            raise ContainerNotFoundError("no such container", env_id=env_id, detail=err.decode(errors="replace"))
        name = (list(argv)[0] if argv else "?").encode()
        if b"no such file or directory" in err or b"not found" in err:
            return msgspec.structs.replace(
                result, exit_code=127, command_not_found=True,
                stderr=b"weenv: command not found in env %s: %s\n" % (env_id.encode(), name))
        if b"permission denied" in err or b"exec format error" in err or b"is a directory" in err:
            detail = err.strip().rsplit(b": ", 1)[-1]
            return msgspec.structs.replace(
                result, exit_code=126, stderr=b"weenv: cannot execute %s in env %s: %s\n" % (name, env_id.encode(), detail))
        raise ContainerError("runsc exec failed", env_id=env_id, detail=err.decode(errors="replace"))

    def close(self) -> None:
        shutil.rmtree(self._pid_dir, ignore_errors=True)


_MOVED = ("ANNOTATION_RUNTIME", "RUNTIMES", "RuntimeRouter", "node_runtime", "plan_runtime", "start_cpu_hint")


def __getattr__(name: str) -> object:
    """The router and what goes with it lived here before :mod:`._router` had them: imports of
    them from here still work."""
    if name in _MOVED:
        from . import _router

        return getattr(_router, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
