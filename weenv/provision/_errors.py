"""The one exception tree of :mod:`weenv.provision`.

::

    ProvisionError                    anything this package raises on purpose
     └── CgroupError                  a cgroup operation failed
          ├── CgroupUnavailableError  the host lacks the hierarchy, controller or file asked for
          ├── CgroupNameError         a group name that could escape weenv's parent or is malformed
          ├── CgroupExistsError       create() of a group that is already there
          ├── CgroupNotFoundError     open() of a group that is not there, or it vanished mid-use
          └── CgroupBusyError         a group did not empty or freeze within its deadline
     ├── SpecError                    bad input for an OCI runtime config (env var, user, network, mount)
     │    └── UserNotFoundError       a user or group name the env's /etc/passwd or /etc/group lacks
     ├── ContainerError               crun failed, or an env's container is not in the state asked for
     │    ├── ContainerNotFoundError  no container with that env id (never created, or deleted)
     │    └── ContainerExistsError    create() of an env id that already has a container
     ├── EnvFileError                 a file operation inside an env's rootfs failed
     │    ├── EnvFileNotFoundError    the path (or a parent) does not exist inside the rootfs
     │    ├── EnvFileTypeError        a directory where a file was expected, or a FIFO/device/socket
     │    └── EnvFileTooLargeError    a read above its byte limit
     ├── HostError                    this host lacks what the runtime needs (crun, an init, openat2...)
     ├── MountError                   an env's upper tmpfs or overlay could not be (un)mounted
     └── EnvError                     a daemon env operation failed (names the env id)
          ├── EnvNotFoundError        no env with that id
          ├── EnvStateError           the env is not in the state the operation needs
          │    └── MemorySnapshotUnavailableError  its runtime cannot checkpoint memory (names why)
          ├── AdmissionError          the node cannot guarantee the env's minimum resources
          └── EnvStartError           the env could not start; its partial setup was undone

Every cgroup error carries ``group`` (the weenv group name) and ``path`` (the cgroupfs file or
directory) when they are known, and names them in its message. Lower-level ``OSError`` is
translated at the cgroup backend boundary and kept as ``__cause__``.

Container errors name the env id (and crun's own message); file errors name the path as seen
inside the env. ``OSError`` from crun invocations and file system calls is kept as ``__cause__``.
"""

from __future__ import annotations


class ProvisionError(Exception):
    """Base of every error raised by :mod:`weenv.provision`."""


class CgroupError(ProvisionError):
    """Raised when a cgroup operation fails; names the group and the cgroupfs path."""

    def __init__(self, message: str, *, group: str | None = None, path: str | None = None):
        where = []
        if group is not None:
            where.append(f"group {group!r}")
        if path is not None:
            where.append(f"at {path}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.group = group
        self.path = path


class CgroupUnavailableError(CgroupError):
    """Raised when the host has no usable cgroup hierarchy, or a controller (cpu, memory, pids,
    freezer) or interface file that the operation needs is missing."""


class CgroupNameError(CgroupError, ValueError):
    """Raised for a group name that is empty, too long, or not ``[A-Za-z0-9][A-Za-z0-9._-]*``."""


class CgroupExistsError(CgroupError):
    """Raised by ``create()`` when a group of that name already exists under weenv's parent."""


class CgroupNotFoundError(CgroupError):
    """Raised by ``open()`` for a group that does not exist, and by any operation on a group that
    was removed underneath it."""


class CgroupBusyError(CgroupError):
    """Raised when a group still holds processes after its removal deadline, or did not reach
    the frozen state in time."""


class SpecError(ProvisionError, ValueError):
    """Raised by the OCI spec builder for input it refuses: an env var name with ``=`` or NUL, an
    empty argv, a relative cwd, an unknown network mode, a bind mount that is not absolute."""


class UserNotFoundError(SpecError, LookupError):
    """Raised when a user or group given by name is not in the rootfs's /etc/passwd or
    /etc/group (names are resolved inside the env, never on the host)."""


class ContainerError(ProvisionError):
    """Raised when crun fails or reports something unexpected; names the env id and carries
    crun's message."""

    def __init__(self, message: str, *, env_id: str | None = None, detail: str | None = None):
        text = message if env_id is None else f"{message} (env {env_id!r})"
        if detail:
            text = f"{text}: {detail.strip()}"
        super().__init__(text)
        self.env_id = env_id
        self.detail = detail


class ContainerNotFoundError(ContainerError, LookupError):
    """Raised for an env id that has no container in weenv's crun state directory."""


class ContainerExistsError(ContainerError):
    """Raised by ``create()`` for an env id that already has a container."""


class ProcessNotFoundError(ContainerError, LookupError):
    """Raised for a pid that is not among the env's processes weenv started (or was forgotten:
    the agent keeps the newest 64 finished background processes)."""


class ProcessStateError(ContainerError):
    """Raised when a process cannot take the operation: stdin closed or never opened, no pty to
    resize (kind ``process_state``), or it already exited (:class:`ProcessExitedError`)."""


class ProcessExitedError(ProcessStateError):
    """Raised when the process an operation names has already exited (kind ``process_exited``)."""


class ProcessStartError(ContainerError):
    """Raised when a process handle's command could not be started (not found, bad cwd or user);
    ``not_found`` says the command does not exist in the env."""

    def __init__(self, message: str, *, env_id: str | None = None, detail: str | None = None, not_found: bool = False):
        super().__init__(message, env_id=env_id, detail=detail)
        self.not_found = not_found


class EnvFileError(ProvisionError):
    """Raised when a file operation inside an env's rootfs fails; names the path as seen inside
    the env."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(f"{message}: {path!r}" if path is not None else message)
        self.path = path


class EnvFileNotFoundError(EnvFileError, FileNotFoundError):
    """Raised when the path, or one of its parent directories, does not exist in the rootfs."""


class EnvFileTypeError(EnvFileError):
    """Raised for a directory where a file was expected (or the reverse), and for FIFOs, devices
    and sockets, which are never opened."""


class EnvFileTooLargeError(EnvFileError):
    """Raised when a file is larger than the byte limit given to ``read()``."""


class HostError(ProvisionError):
    """Raised when the host lacks something the runtime needs: the crun binary, a static init
    (catatonit), or a kernel feature; the message names it and the package that provides it."""


class MountError(ProvisionError):
    """Raised when an env's tmpfs or overlay cannot be mounted or unmounted; names the target."""


class EnvError(ProvisionError):
    """Raised by the daemon's env operations; names the env id."""

    def __init__(self, message: str, *, env_id: str | None = None):
        super().__init__(f"env {env_id}: {message}" if env_id else message)
        self.env_id = env_id


class EnvNotFoundError(EnvError, LookupError):
    """Raised for an env id the daemon does not know (never created, or already gone)."""


class EnvStateError(EnvError):
    """Raised when an env is not in the state an operation needs (exec into a paused env, resume a running one)."""


class MemorySnapshotUnavailableError(EnvStateError):
    """Raised when a memory snapshot (park, commit or fork with memory) is asked of an env whose
    runtime cannot checkpoint its processes: names the runtime and why (a 409; nothing was changed)."""


class AdmissionError(EnvError):
    """Raised when the node cannot guarantee an env's minimum resources (nothing was started)."""


class EnvStartError(EnvError):
    """Raised when an env could not be started; everything it had set up was undone."""
