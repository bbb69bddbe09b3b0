"""Retry and deadline decisions without I/O: which failures to retry, how long to wait, when to stop.

The remote store calls :meth:`RetryPolicy.decide` after each failed attempt with what happened and
the current time; the answer is a delay or a reason to give up. Time and randomness are passed in,
so tests drive it with a fake clock and a fixed jitter.
"""

from __future__ import annotations

import email.utils
import random
from collections.abc import Callable
from dataclasses import dataclass

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def parse_retry_after(value: str | None, now_epoch_s: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or an HTTP date); None if absent/invalid."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - now_epoch_s)


@dataclass(frozen=True)
class Retry:
    delay_s: float
    reason: str


@dataclass(frozen=True)
class GiveUp:
    reason: str


@dataclass(frozen=True)
class RetryPolicy:
    """Jittered exponential backoff within an overall deadline.

    ``deadline_s`` bounds one whole operation (all attempts and waits); ``request_timeout_s`` bounds
    each HTTP exchange and is cut to what remains of the deadline.
    """

    max_attempts: int = 6
    base_delay_s: float = 0.05
    max_delay_s: float = 4.0
    deadline_s: float = 60.0
    request_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0

    def backoff_s(self, attempt: int, jitter: float) -> float:
        """Delay before attempt ``attempt + 1`` (attempt counts from 1); ``jitter`` in [0, 1)."""
        ceiling = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
        return ceiling * (0.5 + 0.5 * jitter)  # "equal jitter": never zero, never above the ceiling

    def timeout_s(self, started_s: float, now_s: float) -> float:
        return max(0.001, min(self.request_timeout_s, self.deadline_s - (now_s - started_s)))

    def expired(self, started_s: float, now_s: float) -> bool:
        return now_s - started_s >= self.deadline_s

    def decide(
        self,
        *,
        attempt: int,
        started_s: float,
        now_s: float,
        status: int | None = None,
        error: str | None = None,
        retry_after_s: float | None = None,
        jitter: float = 0.5,
    ) -> Retry | GiveUp:
        """After failed attempt number ``attempt`` (from 1): wait and retry, or give up.

        ``status`` is the HTTP status, or ``error`` a transport failure (reset, timeout, refused).
        """
        what = f"HTTP {status}" if status is not None else (error or "failure")
        if status is not None and status not in RETRYABLE_STATUS:
            return GiveUp(f"{what} is not retryable")
        if attempt >= self.max_attempts:
            return GiveUp(f"{what} after {attempt} attempts")
        remaining = self.deadline_s - (now_s - started_s)
        delay = self.backoff_s(attempt, jitter)
        if retry_after_s is not None:
            if retry_after_s > remaining:
                return GiveUp(f"{what}: Retry-After {retry_after_s:.1f}s exceeds the {remaining:.1f}s left of the deadline")
            delay = max(delay, retry_after_s)
        if delay >= remaining:
            return GiveUp(f"{what}: deadline of {self.deadline_s:.1f}s reached after {attempt} attempts")
        return Retry(delay, what)


def default_jitter() -> Callable[[], float]:
    return random.Random().random
