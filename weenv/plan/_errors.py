"""The one exception tree of :mod:`weenv.plan`.

::

    PlanError                   anything this package raises on purpose
     ├── PlanSyntaxError        the file is not valid TOML / JSON (names file, line, column)
     ├── PlanValidationError    the document parsed but breaks a rule (names file and field path)
     └── LockError              a lock cannot be made or does not match what a store serves

Locations use the plan's own spelling: ``groups[2].ref``, ``resources.memory.max``, ``env.PATH``.
"""

from __future__ import annotations

from dataclasses import dataclass


class PlanError(Exception):
    """Base of every error raised by :mod:`weenv.plan`."""


class PlanSyntaxError(PlanError):
    """Raised when a plan or lock is not well-formed TOML or JSON (or not UTF-8).

    ``line`` and ``column`` are 1-based; either is ``None`` when the parser did not say.
    """

    def __init__(self, source: str, message: str, *, line: int | None = None, column: int | None = None):
        where = source
        if line is not None:
            where += f":{line}"
            if column is not None:
                where += f":{column}"
        super().__init__(f"{where}: {message}")
        self.source, self.message, self.line, self.column = source, message, line, column


@dataclass(frozen=True)
class Problem:
    """One broken rule: where (``groups[2].ref``; ``""`` for the whole document) and what."""

    location: str
    message: str

    def __str__(self) -> str:
        return f"{self.location}: {self.message}" if self.location else self.message


class PlanValidationError(PlanError):
    """Raised when a parsed plan or lock breaks a type, value or cross-field rule.

    ``problems`` lists every broken rule found (type errors stop at the first; rules that relate
    several fields, such as ``min <= max`` or the order of group classes, are all reported).
    The message has one line per problem: ``plan.toml: groups[2].ref: expected …``.
    """

    def __init__(self, source: str, problems: list[Problem] | tuple[Problem, ...]):
        self.source = source
        self.problems = tuple(problems)
        # one line per problem, whatever odd text (a key with a newline) a message quotes
        super().__init__("\n".join(f"{source}: {p}".replace("\n", "\\n").replace("\r", "\\r")
                                   for p in self.problems))

    @property
    def location(self) -> str:
        """The location of the first problem."""
        return self.problems[0].location if self.problems else ""


class LockError(PlanError):
    """Raised when a group's ref cannot be resolved, a resolved digest contradicts a digest pinned
    in the ref, or what a store serves does not match the lock (manifest, layer or TOC digest).

    ``group`` names the group concerned when there is one.
    """

    def __init__(self, message: str, *, group: str | None = None):
        super().__init__(message)
        self.group = group
