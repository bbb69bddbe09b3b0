"""The one exception tree of :mod:`slime_plugin`.

::

    SlimePluginError            anything this package raises on purpose
     ├── ConfigError            a ``weenv`` setting (sample metadata, ``args.weenv_*``, ``WEENV_*``) is invalid
     ├── SandboxError           a sandbox operation failed (names the sandbox and the operation)
     │    ├── SandboxNotStartedError   used outside ``async with`` (or after it ended)
     │    ├── SnapshotUnavailableError the daemon cannot commit or fork (snapshots not supported)
     │    ├── CapacityError            the node refused a new env for now (admission: cores or memory taken)
     │    └── CommandFailedError       ``exec(..., check=True)`` saw a non-zero exit (also a RuntimeError)
     ├── GenerationError        the SGLang server could not be reached or answered nonsense
     │    └── GenerationAborted        SGLang ended a turn with finish reason ``abort``
     └── GradingError           the evaluator could not be run (not: it ran and said "wrong")

Errors of the weenv client (:class:`weenv.WeenvError`) are translated into :class:`SandboxError` at
the sandbox boundary, keeping the original as ``__cause__``. The rollout turns every error into an
ABORTED sample whose ``metadata["abort_reason"]`` starts with the error's ``reason`` tag.
"""

from __future__ import annotations


class SlimePluginError(Exception):
    """Base of every error raised by :mod:`slime_plugin`. ``reason`` is a short machine tag."""

    reason = "plugin_error"


class ConfigError(SlimePluginError):
    """Raised when a weenv setting is missing or has the wrong type or value.

    ``location`` names the setting as written by the user (``metadata.weenv.max_turns``,
    ``args.weenv_evaluator.command``, ``env WEENV_MAX_TURNS``)."""

    reason = "config"

    def __init__(self, location: str, message: str):
        super().__init__(f"{location}: {message}" if location else message)
        self.location, self.message = location, message


class SandboxError(SlimePluginError):
    """Raised when the weenv daemon refused or failed a sandbox operation (create, exec, file
    transfer, commit, kill), or could not be reached. ``sandbox_id`` is ``""`` before creation."""

    reason = "sandbox"

    def __init__(self, message: str, *, sandbox_id: str = "", operation: str = ""):
        where = " ".join(p for p in (f"sandbox {sandbox_id}" if sandbox_id else "", operation) if p)
        super().__init__(f"{where}: {message}" if where else message)
        self.sandbox_id, self.operation, self.message = sandbox_id, operation, message


class SandboxNotStartedError(SandboxError):
    """Raised when a sandbox method is called before ``__aenter__`` or after ``__aexit__``."""

    reason = "sandbox_not_started"


class SnapshotUnavailableError(SandboxError):
    """Raised by ``commit``/``fork`` when the daemon has no snapshot support; the rollout then
    falls back to one freshly prepared env per sample."""

    reason = "snapshot_unavailable"


class CapacityError(SandboxError):
    """Raised when the daemon refuses a new env because the node's guaranteed cores or memory are
    taken (HTTP 503, ``not_admitted``). Transient: the rollout waits and retries until
    ``admission_timeout_s``."""

    reason = "capacity"


class CommandFailedError(SandboxError, RuntimeError):
    """Raised by ``exec(..., check=True)`` when the command exits non-zero or times out.

    Also a :class:`RuntimeError`, which is what slime's E2B backend raises in the same case, so
    agent code written against that backend catches it unchanged."""

    reason = "command_failed"

    def __init__(self, cmd: str, exit_code: int, stdout: str, stderr: str, *, sandbox_id: str = ""):
        super().__init__(
            f"exit {exit_code}: {cmd[:120]}\n{stderr[-400:]}".rstrip(), sandbox_id=sandbox_id, operation="exec"
        )
        self.cmd, self.exit_code, self.stdout, self.stderr = cmd, exit_code, stdout, stderr


class GenerationError(SlimePluginError):
    """Raised when POST ``/generate`` fails after its retries, or answers without the fields a
    token-level rollout needs (``meta_info.finish_reason``, ``output_token_logprobs``)."""

    reason = "sglang"


class GenerationAborted(GenerationError):
    """Raised when SGLang ends a turn with finish reason ``abort``: slime's rollout manager is
    aborting in-flight requests (end of a rollout step). Not an infrastructure fault, but the
    episode cannot go on, and its env is gone by the time a partial rollout would resume it."""

    reason = "sglang_abort"


class GradingError(SlimePluginError):
    """Raised when the evaluator cannot run: its environment cannot be made, the files to grade
    cannot be copied, or it is not configured when a reward must be computed."""

    reason = "grading"
