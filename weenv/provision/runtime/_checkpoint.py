"""gVisor's memory snapshots: ``runsc checkpoint`` and ``runsc restore`` behind the seam's
:class:`~._seam.MemorySnapshots`, as a part of :class:`~._gvisor.GvisorRuntime`.

- checkpoint: ``runsc checkpoint --image-path DIR`` writes the sandbox's whole kernel state (every
  task, its memory, its open files by path, pids, the loopback stack) to ``DIR/checkpoint.img``,
  and the sandbox exits: its memory is the host's again. runsc's own ``--leave-running``
  restarts the container from the host's namespace, outside the env's cgroups and runsc's view
  of the rootfs, so weenv never passes it: a checkpoint that leaves the env running is a
  checkpoint, then a :meth:`restore` of the same image through the same path as a create.
- the state runsc keeps of the checkpointed container is removed at once, without waiting for
  its reaper (``runsc delete`` waits until PID 1 reaps the sandbox, ~2 s here): the sandbox and
  gofer have exited (watched through pidfds), so nothing of it runs, and the id is free for the
  restore.
- the image's page cache is dropped once it is written (:func:`drop_cached`): the sandbox
  wrote it, in the env's cgroup, which would hold it as memory.
- restore: ``runsc restore --detach --image-path DIR`` in the env's view and cgroups, as
  ``runsc run`` (:meth:`~._gvisor.GvisorRuntime._launch`); the Sentry reopens the files by path
  in the rootfs it is given (a fork's own copy).
"""

from __future__ import annotations

import glob
import logging
import os
import signal
from collections.abc import Mapping, Sequence

import trio

from .._errors import ContainerError, ContainerNotFoundError
from ._runsc import sandbox_alive
from ._seam import MemorySnapshots

log = logging.getLogger("weenv.runtime")

#: The file ``runsc checkpoint`` writes into the image directory.
IMAGE_FILE = "checkpoint.img"


def drop_cached(path: str) -> None:
    """Write ``path`` out and drop it from the page cache: the sandbox wrote the image, so its
    cached pages are charged to the env's cgroup, and a parked env would hold half its memory
    as the page cache of its own image (49 of 66 MiB, measured)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


#: What runsc says when the image holds a file the sandbox had from the host (an exec's stdio).
_HOST_FD = "failed to set host FD"


def restore_failure(log_path: str, start: int = 0) -> str:
    """runsc's reason in the init log (from offset ``start``) for a failed restore, without its
    goroutine dump, and what to do when it is a host file ("" when the log says nothing)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return ""
    line = next((x for x in text.splitlines() if "restoring container" in x), "")
    why = line.split("restoring container", 1)[1].split(": ", 1)[-1].rstrip(":").strip() if line else ""
    if _HOST_FD in why:
        why += (" (a process in the env held a file the sandbox got from the host when it was checkpointed: "
                "under gVisor an exec's stdin, stdout and stderr are such files, so a background process "
                "started by exec must have its own, e.g. `cmd </dev/null >/tmp/log 2>&1 &`)")
    return why


class RunscCheckpoints(MemorySnapshots):
    """The checkpoint and restore of :class:`~._gvisor.GvisorRuntime` (it holds the attributes used here)."""

    memory_runtime = "gvisor"
    checkpoint_timeout_s: float = 120.0

    def image_facts(self) -> dict[str, str]:
        from ._runsc import _runsc_version

        return {"runtime": "gvisor", "platform": self.platform or "", "runsc": _runsc_version(self.runsc)}  # type: ignore[attr-defined]

    async def checkpoint(self, env_id: str, image_dir: str, *, leave_running: bool = False) -> None:
        st = await self.state(env_id)  # type: ignore[attr-defined]
        if st.status != "running":
            raise ContainerError(f"cannot checkpoint a {st.status} sandbox (only a running one)", env_id=env_id)
        boot = self._boots.get(env_id)  # type: ignore[attr-defined]
        if leave_running and boot is None:
            raise ContainerError("cannot leave it running after a checkpoint: this runtime did not create it",
                                 env_id=env_id)
        if not os.path.isdir(image_dir) or os.listdir(image_dir):
            raise ContainerError(f"the checkpoint's image directory {image_dir} must exist and be empty", env_id=env_id)
        gofer = self._gofer_pid(env_id)  # type: ignore[attr-defined]
        failure = ""
        with trio.move_on_after(self.checkpoint_timeout_s) as timer:
            try:
                await self._cli.run("checkpoint", "--image-path", image_dir, env_id, env_id=env_id)  # type: ignore[attr-defined]
            except ContainerNotFoundError:
                raise
            except ContainerError as e:
                failure = str(e)
        if timer.cancelled_caught:
            failure = f"runsc checkpoint did not finish within {self.checkpoint_timeout_s:g} s (is the sandbox frozen?)"
        if failure or not os.path.isfile(os.path.join(image_dir, IMAGE_FILE)):
            alive = sandbox_alive(st.pid, self.state_dir)  # type: ignore[attr-defined]
            raise ContainerError(f"checkpoint failed; the env {'runs on as it was' if alive else 'ended with it'}",
                                 env_id=env_id, detail=failure or f"runsc wrote no {IMAGE_FILE}")
        await self._forget_checkpointed(env_id, [st.pid, gofer])
        await trio.to_thread.run_sync(drop_cached, os.path.join(image_dir, IMAGE_FILE))
        if leave_running:
            assert boot is not None
            bundle_dir, rootfs, spec, procs = boot
            await self.restore(env_id, bundle_dir, rootfs, spec, image_dir, procs)

    async def _forget_checkpointed(self, env_id: str, pids: Sequence[int]) -> None:
        """Once the checkpointed sandbox and its gofer have exited (killed after a grace: the
        image is written), remove the state runsc keeps of them."""
        fds = []
        for pid in pids:
            if pid > 0 and sandbox_alive(pid, self.state_dir):  # type: ignore[attr-defined]
                try:
                    fds.append(os.pidfd_open(pid))
                except OSError:
                    continue
        try:
            with trio.move_on_after(5.0) as wait:
                for fd in fds:
                    await trio.lowlevel.wait_readable(fd)
            if wait.cancelled_caught:
                log.warning("env %s: the checkpointed sandbox did not exit within 5 s: killed", env_id)
                for fd in fds:
                    try:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                for fd in fds:
                    await trio.lowlevel.wait_readable(fd)
        finally:
            for fd in fds:
                os.close(fd)
        self._envs.forget(env_id)  # type: ignore[attr-defined]
        for path in glob.glob(os.path.join(glob.escape(self.state_dir), f"{glob.escape(env_id)}_sandbox:*")):  # type: ignore[attr-defined]
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    async def restore(self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, image_dir: str,
                      cgroup_procs: Sequence[str] = ()) -> int:
        if not os.path.isfile(os.path.join(image_dir, IMAGE_FILE)):
            raise ContainerError(f"no checkpoint image in {image_dir} (no {IMAGE_FILE})", env_id=env_id)
        await self.wait_deleted(env_id)  # type: ignore[attr-defined]
        if env_id in self._envs or env_id in self._deleting or os.path.exists(self._state_file(env_id)):  # type: ignore[attr-defined]
            raise ContainerError("a container with this id already exists", env_id=env_id)
        log_path = os.path.join(bundle_dir, "init.log")
        start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        try:
            pid = await self._launch(env_id, bundle_dir, rootfs, spec, cgroup_procs,  # type: ignore[attr-defined]
                                     ["restore", "--detach", "--image-path", os.path.abspath(image_dir)])
        except ContainerError:
            why = restore_failure(log_path, start)
            if not why:
                raise
            raise ContainerError(f"runsc restore failed: {why}", env_id=env_id, detail=f"runsc's log: {log_path}") from None
        self._boots[env_id] = (os.path.abspath(bundle_dir), rootfs, dict(spec), tuple(cgroup_procs))  # type: ignore[attr-defined]
        self._envs.started(env_id)  # type: ignore[attr-defined]
        return pid
