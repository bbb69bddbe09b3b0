"""One token-level call to an SGLang router's ``/generate``, as slime's own rollout makes it.

Request: ``{"input_ids": [...], "sampling_params": {...}, "return_logprob": true}``. Answer:
``text`` and ``meta_info`` with ``finish_reason.type`` (``stop`` / ``length`` / ``abort``) and
``output_token_logprobs`` (``[logprob, token_id, ...]`` per generated token).

The POST goes through slime's own ``slime.utils.http_utils.post(url, payload, max_retries=60,
headers=None)`` when slime is importable and its client is set up in this process (slime's rollout
manager calls ``init_http_client``), so ``--use-distributed-post`` and slime's retry policy apply
as they do to slime's own rollout; else through the plugin's httpx client and retries.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ._errors import GenerationError

logger = logging.getLogger(__name__)

#: ``slime.utils.http_utils.post``'s shape: ``(url, payload, max_retries=60, headers=None)`` → the
#: decoded JSON answer; raises once its retries are spent.
SlimePost = Callable[..., Awaitable[Any]]

_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Turn:
    """One generation: the new tokens, their log-probs, the text and SGLang's ``meta_info``."""

    text: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    meta_info: dict[str, Any]


def parse_generate_response(data: Any) -> Turn:
    """Check and unpack a ``/generate`` answer (pure; raises :class:`GenerationError`)."""
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise GenerationError(f"/generate answered without meta_info: {str(data)[:200]}")
    meta = data["meta_info"]
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if not isinstance(finish_type, str):
        raise GenerationError(f"/generate answered without meta_info.finish_reason.type: {str(meta)[:200]}")
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        if finish_type == "abort":  # an aborted request may carry nothing at all
            pairs = []
        else:
            raise GenerationError("/generate answered without output_token_logprobs (is return_logprob set?)")
    try:
        log_probs = [float(p[0]) for p in pairs]
        token_ids = [int(p[1]) for p in pairs]
    except (TypeError, ValueError, IndexError) as e:
        raise GenerationError(f"malformed output_token_logprobs: {e}") from None
    return Turn(text=str(data.get("text") or ""), token_ids=token_ids, log_probs=log_probs,
                finish_reason=finish_type, meta_info=meta)


def find_slime_http_utils() -> Any | None:
    """slime's ``slime.utils.http_utils`` module when it is importable and has ``post``, else None."""
    try:
        module = importlib.import_module("slime.utils.http_utils")
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken slime install must not abort every sample
        logger.warning("[weenv] slime.utils.http_utils cannot be imported (%s: %s); posting to SGLang with "
                       "the plugin's own client", type(e).__name__, e)
        return None
    return module if callable(getattr(module, "post", None)) else None


def slime_post(http_utils: Any | None) -> SlimePost | None:
    """``http_utils.post`` if slime's HTTP client is set up in this process. Before
    ``init_http_client`` (or with no rollout engines) slime's ``post`` would retry a missing client
    for a minute, so the plugin's own client is used instead."""
    if http_utils is None or getattr(http_utils, "_http_client", True) is None:
        return None
    return http_utils.post


async def generate(
    http: httpx.AsyncClient,
    url: str,
    input_ids: list[int],
    sampling_params: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    retries: int = 3,
    timeout_s: float = 600.0,
    post: SlimePost | None = None,
) -> Turn:
    """POST one request: through ``post`` (slime's ``http_utils.post``, with its own retries and
    no deadline) when given, else with ``http``, retrying transport errors and 429/5xx with
    jittered backoff (``retries``, ``timeout_s`` per attempt)."""
    payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}
    if post is not None:
        try:
            data = await post(url, payload, headers=headers)
        except Exception as e:  # noqa: BLE001 - whatever its retries ended on (httpx, Ray, ...)
            raise GenerationError(f"POST {url} through slime.utils.http_utils.post failed: "
                                  f"{type(e).__name__}: {str(e)[:200]}") from e
        return parse_generate_response(data)
    last: str = ""
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(random.uniform(0, min(8.0, 0.5 * 2**attempt)))
        try:
            resp = await http.post(url, json=payload, headers=headers, timeout=timeout_s)
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
            continue
        if resp.status_code in _RETRY_STATUSES:
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            continue
        if resp.status_code >= 400:
            raise GenerationError(f"POST {url}: HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            data = resp.json()
        except ValueError:
            raise GenerationError(f"POST {url}: the answer is not JSON: {resp.text[:200]}") from None
        return parse_generate_response(data)
    raise GenerationError(f"POST {url} failed {retries + 1} times; last: {last}")
