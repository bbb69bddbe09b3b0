"""gVisor (``runsc``) as the runtime of envs that run code nobody trusts, and the router that
lets one daemon hold crun envs and gVisor envs side by side.

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

The platform (how the Sentry intercepts system calls) is probed, never assumed: ``kvm`` when
``/dev/kvm`` runs a probe container within a few seconds, else ``ptrace`` (:func:`probe_platform`).
The answer is cached per runsc version and kernel in the runtime's state directory.
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
import time
from collections.abc import Mapping, Sequence

import msgspec
import trio

from ..._atomic import atomic_write
from .._errors import ContainerError, ContainerExistsError, ContainerNotFoundError, HostError, SpecError
from ._hostcheck import HostFacts, detect_host
from ._ocispec import ANNOTATION_NETWORK, User
from ._ns import TRAMPOLINE_FAILED, _CgroupFds, _empty_stdin
from ._runtime import DEFAULT_MAX_OUTPUT_BYTES, ContainerState, CrunRuntime, ExecResult, OutputCallback, Runtime

log = logging.getLogger("weenv.runtime")

RUNTIMES = ("crun", "gvisor")
#: The annotation that names the runtime of an env (set by the daemon; read by :class:`RuntimeRouter`).
ANNOTATION_RUNTIME = "org.weenv.runtime"
#: Network modes a gVisor env can have (the sandbox's own stack; no veth, no host network).
GVISOR_NETWORK_MODES = ("none", "loopback")
PLATFORMS = ("kvm", "ptrace")

_NO_CONTAINER = (b"file does not exist", b"does not exist")
# runsc exec's words (exit status 128) when the command could not be started in the sandbox.
_EXEC_FAILED = b"executing processes for container"
# ... and when the sandbox went away while it waited for the command.
_SANDBOX_GONE = re.compile(rb'^waiting on pid \d+: .*in sandbox .*(EOF|connection refused|connection reset)', re.M)


class PlatformProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`probe_platform` found: the platform to use and why the others were passed over."""

    platform: str
    runsc_version: str
    kernel_release: str
    results: dict[str, str]
    """platform -> "ok" or why it did not work ("hung for 5 s", "exit status 1: ...", "no /dev/kvm")."""


def _runsc_version(runsc: str) -> str:
    try:
        out = subprocess.run([runsc, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.splitlines()[0].strip() if out else ""


def _probe_one(runsc: str, platform: str, static_binary: str, work: str, timeout_s: float) -> str:
    """Run ``static_binary --version`` as a container on ``platform``; "ok" or why not."""
    root = os.path.join(work, f"state-{platform}")
    bundle = os.path.join(work, f"bundle-{platform}")
    rootfs = os.path.join(bundle, "rootfs")
    os.makedirs(rootfs, exist_ok=True)
    os.makedirs(root, exist_ok=True)
    shutil.copy2(static_binary, os.path.join(rootfs, "probe"))
    spec = {
        "ociVersion": "1.0.2",
        "process": {"args": ["/probe", "--version"], "cwd": "/", "user": {"uid": 0, "gid": 0}, "env": ["PATH=/"]},
        "root": {"path": rootfs, "readonly": True},
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(spec, f)
    base = [runsc, "--root", root, "--network=none", "--ignore-cgroups", f"--platform={platform}"]
    cid = f"weenv-probe-{platform}-{os.getpid()}"
    # not /dev/null: runsc chowns its stdio to the sandbox's user (nobody), the host's /dev/null with it
    stdin_r = _empty_stdin()
    stdout = os.open(os.path.join(bundle, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        proc = subprocess.run([*base, "run", "--bundle", bundle, cid], stdin=stdin_r,
                              stdout=stdout, stderr=subprocess.PIPE, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"hung for {timeout_s:g} s"
    except OSError as e:
        return f"could not run runsc: {e}"
    finally:
        os.close(stdin_r)
        os.close(stdout)
        subprocess.run([*base, "delete", "--force", cid], capture_output=True, timeout=30)
    if proc.returncode != 0:
        return f"exit status {proc.returncode}: {proc.stderr.decode(errors='replace').strip()[-300:]}"
    return "ok"


def probe_platform(runsc: str, static_binary: str, *, cache_dir: str | None = None, timeout_s: float = 5.0,
                   kvm_device: str = "/dev/kvm") -> PlatformProbe:
    """Find the fastest gVisor platform that runs a container here: ``kvm`` if ``kvm_device`` is
    there and a probe container on it exits within ``timeout_s``, else ``ptrace`` (probed too).
    Raises :class:`HostError` when neither works. With ``cache_dir`` the answer is kept for the
    same runsc version and kernel (a probe costs about a second, a hung kvm ``timeout_s`` more)."""
    version = _runsc_version(runsc)
    kernel = os.uname().release
    cache = os.path.join(cache_dir, "platform.json") if cache_dir else None
    if cache is not None:
        try:
            with open(cache, "rb") as f:
                found = msgspec.json.decode(f.read(), type=PlatformProbe)
            if found.runsc_version == version and found.kernel_release == kernel:
                return found
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            pass
    results: dict[str, str] = {}
    chosen = None
    with tempfile.TemporaryDirectory(prefix="weenv-runsc-probe-") as work:
        for platform in PLATFORMS:
            if platform == "kvm" and not os.path.exists(kvm_device):
                results[platform] = f"no {kvm_device}"
                continue
            results[platform] = _probe_one(runsc, platform, static_binary, work, timeout_s)
            if results[platform] == "ok":
                chosen = platform
                break
    if chosen is None:
        raise HostError("runsc cannot run a container on this host: " + "; ".join(f"{k}: {v}" for k, v in results.items()))
    found = PlatformProbe(platform=chosen, runsc_version=version, kernel_release=kernel, results=results)
    if cache is not None:
        os.makedirs(cache_dir, exist_ok=True)  # type: ignore[arg-type]
        atomic_write(cache, msgspec.json.encode(found), mode=None, fsync=False)
    log.info("gVisor platform: %s (%s)", chosen, ", ".join(f"{k}: {v}" for k, v in results.items()))
    return found


def gvisor_spec(spec: Mapping, rootfs: str) -> dict:
    """The crun spec weenv builds, as runsc takes it: the rootfs's own /tmp bound over the tmpfs
    gVisor would mount there, and the refusals (network modes the sandbox cannot have)."""
    spec = json.loads(json.dumps(spec))  # a deep copy: the caller's spec stays as built
    network = spec.get("annotations", {}).get(ANNOTATION_NETWORK, "none")
    if network not in GVISOR_NETWORK_MODES:
        raise SpecError(f"network = {network!r} is not available under gVisor (only {' or '.join(GVISOR_NETWORK_MODES)})")
    if any(ns.get("path") for ns in spec.get("linux", {}).get("namespaces", ())):
        raise SpecError("gVisor envs cannot join an existing namespace")
    spec["root"] = {**spec.get("root", {}), "path": rootfs}
    mounts = spec.setdefault("mounts", [])
    if os.path.isdir(os.path.join(rootfs, "tmp")) and not any(m.get("destination") == "/tmp" for m in mounts):
        mounts.append({"destination": "/tmp", "type": "bind", "source": os.path.join(rootfs, "tmp"),
                       "options": ["rbind", "nosuid", "nodev"]})
    return spec


def _sandbox_alive(pid: int, state_dir: str) -> bool:
    """The sandbox process ``pid`` runs (not a zombie) and is one of ours (a reused pid is not)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return st[st.rindex(b")") + 2:][:1] not in (b"Z", b"X") and os.fsencode(state_dir) in cmd


def _ps_table(out: bytes) -> dict[int, int]:
    """pid -> ppid from ``runsc ps`` (a table: UID PID PPID C TTY STIME TIME CMD; its json
    format holds only pids)."""
    table = {}
    for line in out.decode(errors="replace").splitlines()[1:]:
        f = line.split()
        if len(f) >= 3 and f[1].isdigit() and f[2].isdigit():
            table[int(f[1])] = int(f[2])
    return table


class GvisorRuntime(CrunRuntime):
    """Runs runsc for real. ``run_dir`` is weenv's; runsc's state goes to ``run_dir/runsc``.
    ``platform`` None: probed (and cached in the state directory).

    One difference from the seam: :meth:`create` already lets the init run (``runsc run
    --detach``, ~40 ms less than create + start), so the env is "running" before :meth:`start`;
    exec still waits for start. Nothing weenv does between the two needs the init parked."""

    name = "gvisor"
    supports_agent = False

    def __init__(
        self,
        run_dir: str,
        *,
        host: HostFacts | None = None,
        platform: str | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        drain_grace_s: float = 0.1,
        kill_grace_s: float = 5.0,
    ):
        self.host = host if host is not None else detect_host()
        self.runsc = self.host.require_runsc()
        self.state_dir = os.path.join(run_dir, "runsc")
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        if platform is not None and platform not in PLATFORMS:
            raise HostError(f"unknown gVisor platform {platform!r} (this runsc knows {', '.join(PLATFORMS)})")
        self.platform = platform  # None until the first create probes it (off the daemon's start)
        self.platform_probe: PlatformProbe | None = None
        self._probe_lock = trio.Lock()
        self.max_output_bytes = max_output_bytes
        self.drain_grace_s = drain_grace_s
        self.kill_grace_s = kill_grace_s
        self._private_ns = None  # runsc with --ignore-cgroups does not mind a hybrid host
        # The platform is the sandbox's: only create takes it; exec, kill, state talk to the sandbox.
        self._base = [self.runsc, "--root", self.state_dir, "--network=none", "--ignore-cgroups", "--overlay2=none",
                      "--file-access=shared", "--file-access-mounts=shared", "--oci-seccomp",
                      # more runsc flags for debugging, e.g. "--debug --debug-log=/tmp/runsc/" or "--strace"
                      *shlex.split(os.environ.get("WEENV_RUNSC_FLAGS", ""))]
        self._exec_pid_files: dict[int, tuple[str, str]] = {}  # runsc exec's pid -> (env, in-sandbox pid file)
        self._deleting: set[str] = set()  # killed, runsc delete still polling for the reap
        self._known: dict[str, tuple[int, dict]] = {}
        self._started: set[str] = set()
        self._agents: dict[str, tuple[str, User]] = {}  # always empty: no agent under gVisor

    async def ensure_platform(self) -> str:
        """The platform, probed (in a worker thread, once, however many envs start at once) unless
        given or cached: the first gVisor env on a new runsc or kernel pays ~1 s, plus the kvm
        probe's 5 s bound where kvm hangs."""
        async with self._probe_lock:
            if self.platform is None:
                found = await trio.to_thread.run_sync(
                    lambda: probe_platform(self.runsc, self.host.require_init(), cache_dir=self.state_dir))
                self.platform_probe = found
                self.platform = found.platform
                log.info("gVisor envs run on the %s platform (%s)", found.platform,
                         ", ".join(f"{k}: {v}" for k, v in found.results.items()))
        return self.platform

    async def _crun(self, *args: str, env_id: str | None = None) -> bytes:
        proc = await trio.run_process([*self._base, *args], capture_stdout=True, capture_stderr=True, check=False)
        if proc.returncode != 0:
            detail = proc.stderr.decode(errors="replace")
            if env_id is not None and any(m in proc.stderr for m in _NO_CONTAINER):
                raise ContainerNotFoundError("no such container", env_id=env_id, detail=detail)
            raise ContainerError(f"runsc {args[0]} failed with exit status {proc.returncode}", env_id=env_id, detail=detail)
        return proc.stdout

    async def _lookup(self, env_id: str) -> tuple[int, dict]:
        known = self._known.get(env_id)
        if known is not None:
            return known
        st = await self.state(env_id)
        try:
            with open(os.path.join(st.bundle, "config.json"), "rb") as f:
                spec = json.loads(f.read())
        except OSError as exc:
            raise ContainerNotFoundError("runsc's bundle has no config for this container", env_id=env_id) from exc
        known = (st.pid, spec.get("process", {}))
        if st.pid > 0:
            self._known[env_id] = known
        if st.status in ("running", "paused"):
            self._started.add(env_id)
        return known

    async def create(
        self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, cgroup_procs: Sequence[str] = (),
        *, listen_fd: int | None = None,
    ) -> int:
        if listen_fd is not None:
            raise ContainerError("gVisor envs have no in-env agent (runsc cannot pass it a socket)", env_id=env_id)
        # runsc itself, given an id it already has, fails and takes the existing container's state
        # with it (its sandbox left running with nothing to find it by): refuse before it runs.
        if env_id in self._known or env_id in self._deleting or os.path.exists(self._state_file(env_id)):
            raise ContainerExistsError("a container with this id already exists", env_id=env_id)
        spec = gvisor_spec(spec, rootfs)
        platform = await self.ensure_platform()
        bundle_dir = os.path.abspath(bundle_dir)
        pid_file = os.path.join(bundle_dir, "init.pid")
        log_path = os.path.join(bundle_dir, "runsc.log")
        with open(os.path.join(bundle_dir, "config.json"), "wb") as f:
            f.write(json.dumps(spec).encode())
        for stale in (pid_file, log_path):
            try:
                os.unlink(stale)
            except FileNotFoundError:
                pass
        # The init's stdout/stderr go to a log in the bundle (runsc hands its own stdio to the
        # sandbox, so a pipe would never see EOF); runsc's own errors land there too.
        init_log_path = os.path.join(bundle_dir, "init.log")
        init_log = os.open(init_log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        log_start = os.fstat(init_log).st_size
        try:
            with _CgroupFds(cgroup_procs) as cg:
                argv = cg.wrap([*self._base, f"--platform={platform}", "run", "--detach", "--bundle", bundle_dir, "--pid-file", pid_file,
                                "--user-log", log_path, env_id])
                stdin_r = _empty_stdin()  # not /dev/null: runsc chowns its stdio to the sandbox's user
                try:
                    proc = await trio.run_process(argv, stdin=stdin_r, stdout=init_log, stderr=init_log,
                                                  check=False, pass_fds=tuple(cg.fds))
                finally:
                    os.close(stdin_r)
        except OSError as exc:
            raise ContainerError("could not open the env's cgroups", env_id=env_id, detail=str(exc)) from exc
        finally:
            os.close(init_log)
        if proc.returncode != 0:
            detail = ""
            for path, start in ((init_log_path, log_start), (log_path, 0)):
                try:
                    with open(path, "rb") as f:
                        f.seek(start)
                        detail += f.read()[-4000:].decode(errors="replace")
                except OSError:
                    pass
            if proc.returncode == TRAMPOLINE_FAILED and not detail:
                detail = f"could not write the new process into {', '.join(cgroup_procs)}"
            if "already exists" in detail or "address already in use" in detail:
                # the latter: a sandbox of this id holds its control socket, here or under another
                # runsc root (the socket is in the host-wide abstract namespace); never delete it
                raise ContainerExistsError("a container with this id already exists (gVisor sandbox ids are host-wide)",
                                           env_id=env_id, detail=detail)
            with trio.CancelScope(shield=True):
                await self.delete(env_id)
            raise ContainerError(f"runsc run failed with exit status {proc.returncode}", env_id=env_id, detail=detail)
        with open(pid_file) as f:
            init_pid = int(f.read().strip())
        self._known[env_id] = (init_pid, spec.get("process", {}))
        self._started.discard(env_id)
        return init_pid

    async def start(self, env_id: str) -> None:
        """The init already runs (``create`` is ``runsc run --detach``: one runsc process and
        sandbox round trip fewer than create + start, ~40 ms here; nothing has to happen between
        the two under gVisor, whose root needs no remount)."""
        await self._lookup(env_id)
        self._started.add(env_id)

    async def exec(
        self,
        env_id: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: User | None = None,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        cgroup_procs: Sequence[str] = (),
        on_output: OutputCallback | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        _init_pid, base = await self._lookup(env_id)
        if env_id not in self._started:
            raise ContainerError("cannot exec in an env that was created but not started", env_id=env_id)
        cap = self.max_output_bytes if max_output_bytes is None else max_output_bytes
        process = self._exec_process(base, argv, env=env, cwd=cwd, user=user)
        payload = json.dumps(process).encode()
        if len(payload) > 60_000:  # over a pipe buffer the write below would block
            raise SpecError(f"exec process description is {len(payload)} bytes; keep env and argv under 60 kB")
        proc_r, proc_w = os.pipe2(os.O_CLOEXEC)
        log_r, log_w = os.pipe2(os.O_CLOEXEC)  # _collect reads crun's log from it: runsc's errors are on stderr
        pid_dir = tempfile.mkdtemp(prefix="exec-", dir=self.state_dir)
        pid_file = os.path.join(pid_dir, "pid")
        closing = [proc_r, proc_w, log_r, log_w]
        if stdin is None:
            closing.append(_empty_stdin())
        try:
            os.write(proc_w, payload)
            os.close(proc_w)
            closing.remove(proc_w)
            os.close(log_w)
            closing.remove(log_w)
            started = time.perf_counter()
            with _CgroupFds(cgroup_procs) as cg:
                proc = await trio.lowlevel.open_process(
                    cg.wrap([*self._base, "exec", f"--process=/dev/fd/{proc_r}", "--internal-pid-file", pid_file, env_id]),
                    stdin=subprocess.PIPE if stdin is not None else closing[-1],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    pass_fds=(proc_r, *cg.fds),
                )
            os.close(proc_r)
            closing.remove(proc_r)
            self._exec_pid_files[proc.pid] = (env_id, pid_file)
            try:
                result = await self._collect(env_id, proc, log_r, started, stdin, timeout_s, on_output, cap, argv[:1])
            finally:
                self._exec_pid_files.pop(proc.pid, None)
        finally:
            for fd in closing:
                os.close(fd)
            shutil.rmtree(pid_dir, ignore_errors=True)
        return self._translate(env_id, argv, result)

    def _translate(self, env_id: str, argv: Sequence[str], result: ExecResult) -> ExecResult:
        """runsc exec exits 128 with its own words on stderr when the command never started, or
        when the sandbox died under it (all of the env: e.g. the kernel's OOM kill at the env's hard
        memory limit, which under gVisor picks the sandbox, the one process holding the env's memory)."""
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

    async def _stop_exec(self, proc: trio.Process) -> None:
        """Kill the command's process tree inside the sandbox, then let runsc exec report."""
        env_id, pid_file = self._exec_pid_files.get(proc.pid, ("", ""))
        if env_id:
            try:
                with open(pid_file) as f:
                    root = int(f.read().strip() or 0)
            except (OSError, ValueError):
                root = 0
            if root > 0:
                await self._kill_sandbox_tree(env_id, root)
        with trio.move_on_after(self.kill_grace_s):
            await proc.wait()
            return
        proc.kill()
        with trio.move_on_after(self.kill_grace_s):
            await proc.wait()

    async def _kill_sandbox_tree(self, env_id: str, root: int, *, rounds: int = 5) -> None:
        """SIGKILL ``root`` (a pid inside the sandbox) and its descendants, until a scan finds none
        (at most ``rounds`` scans). A job that left the tree before the scan (reparented to the
        init) is not found: gVisor's ps does not report sessions."""
        for _ in range(rounds):
            try:
                out = await self._crun("ps", env_id, env_id=env_id)
            except ContainerError:
                return
            table = _ps_table(out)
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

    async def _agent_socket(self, env_id: str):  # type: ignore[override]
        await self._lookup(env_id)
        raise ContainerError(
            "process handles (background processes, attach, stdin, signals, pty) are not available under gVisor: "
            "they live in the in-env agent, which gVisor envs do not run; use exec, or runtime = \"crun\"",
            env_id=env_id)

    async def _kill_pid(self, env_id: str, pid: int) -> None:
        try:
            await self._crun("kill", "--pid", str(pid), env_id, str(int(signal.SIGKILL)), env_id=env_id)
        except ContainerError:
            pass  # gone already

    async def kill(self, env_id: str, sig: int = signal.SIGKILL) -> None:
        await self._crun("kill", env_id, str(int(sig)), env_id=env_id)

    async def delete(self, env_id: str, force: bool = True) -> None:
        """Kill the sandbox and its gofer and return once both have exited (the env's files and
        mounts are free then); ``runsc delete`` removes runsc's state afterwards, in the
        background: it polls until the dead sandbox is *reaped*, and its reaper is PID 1 (an
        orphan), which on this VM reaps every ~2 s. Until it is done the env is already gone for
        :meth:`state` and :meth:`list`."""
        self._known.pop(env_id, None)
        self._started.discard(env_id)
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
                if pid > 0 and _sandbox_alive(pid, self.state_dir):
                    try:
                        fd = os.pidfd_open(pid)
                    except OSError:
                        continue
                    pidfds.append(fd)
                    if _sandbox_alive(pid, self.state_dir):  # still ours now that the pidfd pins it
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

    def _gofer_pid(self, env_id: str) -> int:
        try:
            with open(self._state_file(env_id), "rb") as f:
                return int(json.loads(f.read()).get("goferPid") or 0)
        except (OSError, ValueError):
            return 0

    async def _remove_state(self, env_id: str) -> None:
        try:
            await self._crun("delete", "--force", env_id, env_id=env_id)
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
        if status in ("created", "running", "paused") and not _sandbox_alive(pid, self.state_dir):
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


# -- the router ------------------------------------------------------------------------------------


class RuntimeRouter(Runtime):
    """One :class:`Runtime` over several: ``create`` picks the runtime named by the spec's
    :data:`ANNOTATION_RUNTIME` (default ``default``); every other call goes to the runtime that
    holds the env (remembered, or found by asking each). Runtimes are built on first use, so a node
    without runsc runs crun envs and refuses only gVisor ones."""

    def __init__(self, factories: Mapping[str, object], default: str):
        if default not in factories:
            raise HostError(f"unknown runtime {default!r} (this node has {', '.join(factories)})")
        self._factories = dict(factories)
        self._runtimes: dict[str, Runtime] = {}
        self.default = default
        self._owner: dict[str, str] = {}
        self.host = self.get(default).host if hasattr(self.get(default), "host") else None

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

    def supports_agent(self, name: str | None) -> bool:
        return getattr(self.get(name or self.default), "supports_agent", True)

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

    async def create(self, env_id, bundle_dir, rootfs, spec, cgroup_procs=(), **kw) -> int:
        name = spec.get("annotations", {}).get(ANNOTATION_RUNTIME) or self.default
        rt = self.get(name)
        pid = await rt.create(env_id, bundle_dir, rootfs, spec, cgroup_procs, **kw)
        self._owner[env_id] = name
        return pid

    async def start(self, env_id):
        return await (await self._of(env_id)).start(env_id)

    async def exec(self, env_id, argv, **kw):
        return await (await self._of(env_id)).exec(env_id, argv, **kw)

    async def start_process(self, env_id, argv, **kw):
        return await (await self._of(env_id)).start_process(env_id, argv, **kw)

    async def connect_process(self, env_id, pid):
        return await (await self._of(env_id)).connect_process(env_id, pid)

    async def list_processes(self, env_id):
        return await (await self._of(env_id)).list_processes(env_id)

    async def send_stdin(self, env_id, pid, data, *, close=False):
        return await (await self._of(env_id)).send_stdin(env_id, pid, data, close=close)

    async def signal_process(self, env_id, pid, sig):
        return await (await self._of(env_id)).signal_process(env_id, pid, sig)

    async def resize_process(self, env_id, pid, rows, cols):
        return await (await self._of(env_id)).resize_process(env_id, pid, rows, cols)

    async def wait_process(self, env_id, pid, timeout_s=None):
        return await (await self._of(env_id)).wait_process(env_id, pid, timeout_s)

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


def plan_runtime(runtime: Runtime, requested: str | None) -> tuple[dict[str, str], bool]:
    """For a plan's ``runtime`` (None: the node's default): the spec annotations that route the
    env to it, and whether the in-env agent can be its init. Raises :class:`HostError` naming the
    runtime when this daemon cannot run it."""
    if isinstance(runtime, RuntimeRouter):
        name = requested or runtime.default
        return {ANNOTATION_RUNTIME: name}, bool(getattr(runtime.get(name), "supports_agent", True))
    own = getattr(runtime, "name", "crun")
    if requested is not None and requested != own:
        raise HostError(f'runtime = "{requested}": this daemon runs only {own} envs')
    return {}, bool(getattr(runtime, "supports_agent", True))


def node_runtime(run_dir: str, default: str = "crun", *, host: HostFacts | None = None) -> RuntimeRouter:
    """The daemon's runtime: crun and gVisor envs side by side, ``default`` for plans that name none."""
    if default not in RUNTIMES:
        raise HostError(f"unknown runtime {default!r} (weenv has {', '.join(RUNTIMES)})")
    host = host if host is not None else detect_host()
    return RuntimeRouter({"crun": lambda: CrunRuntime(run_dir, host=host),
                          "gvisor": lambda: GvisorRuntime(run_dir, host=host)}, default=default)


#: A gVisor env starts with this CPU quota (clamped to its plan's range), not at its min: the
#: sandbox's kernel finishes booting and loads the first command's binary on the env's CPU, and at
#: a 0.05-core min the first exec took ~280 ms instead of ~50 ms. The monitor halves it when idle.
GVISOR_START_CPU_CORES = 1.0


def start_cpu_hint(routing: Mapping[str, str], start_cpu_cores: float | None) -> float | None:
    """The CPU quota an env starts at (see :data:`GVISOR_START_CPU_CORES`); crun envs keep theirs."""
    if routing.get(ANNOTATION_RUNTIME) != "gvisor":
        return start_cpu_cores
    return max(start_cpu_cores or 0.0, GVISOR_START_CPU_CORES)
