"""The errors of ``weenv package`` (drawn in weenv/build/_package.py)."""

from __future__ import annotations

from ._build import BuildError


class PackageError(BuildError):
    """Raised when a task cannot be packaged; the message names the repository, commit or command."""


class TasksFileError(PackageError):
    """Raised for a malformed tasks file; the message starts with ``FILE:LINE:``."""
