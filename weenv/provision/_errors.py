"""The one exception tree of :mod:`weenv.provision`.

::

    ProvisionError                    anything this package raises on purpose
     └── CgroupError                  a cgroup operation failed
          ├── CgroupUnavailableError  the host lacks the hierarchy, controller or file asked for
          ├── CgroupNameError         a group name that could escape weenv's parent or is malformed
          ├── CgroupExistsError       create() of a group that is already there
          ├── CgroupNotFoundError     open() of a group that is not there, or it vanished mid-use
          └── CgroupBusyError         a group did not empty or freeze within its deadline

Every cgroup error carries ``group`` (the weenv group name) and ``path`` (the cgroupfs file or
directory) when they are known, and names them in its message. Lower-level ``OSError`` is
translated at the cgroup backend boundary and kept as ``__cause__``.
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
