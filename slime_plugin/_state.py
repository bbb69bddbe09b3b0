"""Per-event-loop state shared by all samples of a rollout: the weenv client, the env-creation
limit, the group templates, the SGLang HTTP client (and slime's ``http_utils`` when importable);
and the (process-wide) tokenizer cache."""

from __future__ import annotations

import asyncio
import importlib
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import weenv

from ._config import RolloutSettings
from ._errors import ConfigError
from ._groups import GroupTemplates
from ._sglang import find_slime_http_utils


@dataclass
class LoopState:
    settings: RolloutSettings
    client: Any
    create_slots: asyncio.Semaphore
    env_slots: asyncio.Semaphore | None
    templates: GroupTemplates
    http: httpx.AsyncClient
    #: ``slime.utils.http_utils`` when slime is importable: its ``post`` then carries the turns.
    slime_http_utils: Any | None = None
    #: Counts of env operations (``created_from_plan``, ``created_from_snapshot``, ``commits``,
    #: ``snapshot_unavailable``, ``kills``…), for tests, benchmarks and logs.
    stats: Counter = field(default_factory=Counter)

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.client.aclose()


# Keyed by loop: asyncio primitives and httpx pools belong to the loop that made them.
_states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[RolloutSettings, LoopState]] = (
    weakref.WeakKeyDictionary()
)


_clusters: dict[tuple[str, str | None, str | None], Any] = {}
_clusters_lock = threading.Lock()


def _client_for(settings: RolloutSettings) -> Any:
    """The node's daemon, or (``cluster`` set) the cluster's placement over Ray node agents: one
    cluster connection per process (joining it blocks once, on the first sample)."""
    if settings.cluster is None:
        return weenv.AsyncClient(settings.socket, timeout_s=None, autostart=settings.autostart)
    from weenv import cluster as weenv_cluster

    key = (settings.cluster, settings.cluster_token, settings.cluster_store)
    with _clusters_lock:
        cluster = _clusters.get(key)
        if cluster is None:
            cluster = weenv_cluster.connect(None if settings.cluster == "auto" else settings.cluster,
                                            token=settings.cluster_token, store=settings.cluster_store)
            _clusters[key] = cluster
    return cluster.async_client()


def loop_state(settings: RolloutSettings) -> LoopState:
    per_loop = _states.setdefault(asyncio.get_running_loop(), {})
    state = per_loop.get(settings)
    if state is None:
        state = LoopState(
            settings=settings,
            # No HTTP-level deadline: the sandbox gives every call one sized to the operation.
            client=_client_for(settings),
            create_slots=asyncio.Semaphore(settings.create_concurrency),
            env_slots=None if settings.max_envs is None else asyncio.Semaphore(settings.max_envs),
            templates=GroupTemplates(),
            http=httpx.AsyncClient(timeout=settings.sglang_timeout_s,
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=256)),
            slime_http_utils=find_slime_http_utils(),
        )
        per_loop[settings] = state
    return state


def loop_states() -> list[LoopState]:
    """The states of the running loop."""
    return list(_states.get(asyncio.get_running_loop(), {}).values())


async def close_loop_states() -> None:
    for state in _states.pop(asyncio.get_running_loop(), {}).values():
        await state.aclose()


_tokenizers: dict[tuple[str | None, str | None], Any] = {}
_tokenizer_lock = threading.Lock()


def _load_tokenizer_blocking(args: Any, factory_path: str | None) -> Any:
    checkpoint = getattr(args, "hf_checkpoint", None)
    key = (factory_path, checkpoint if factory_path is None else None)
    with _tokenizer_lock:
        if key in _tokenizers:
            return _tokenizers[key]
        if factory_path is not None:
            module_name, _, attr = factory_path.rpartition(".")
            try:
                factory = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError, ValueError) as e:
                raise ConfigError("args.weenv_tokenizer", f"cannot load {factory_path!r}: {e}") from None
            tokenizer = factory(args)
        else:
            if not checkpoint:
                raise ConfigError("args.hf_checkpoint", "not set, and no weenv_tokenizer factory was given")
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ConfigError("args.weenv_tokenizer", "transformers is not installed; install it or give "
                                  "weenv_tokenizer: package.module.factory") from None
            tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True)
        _tokenizers[key] = tokenizer
        return tokenizer


async def load_tokenizer(args: Any, settings: RolloutSettings) -> Any:
    """The tokenizer for ``args`` (loaded once per process, off the event loop)."""
    key = (settings.tokenizer, getattr(args, "hf_checkpoint", None) if settings.tokenizer is None else None)
    if key in _tokenizers:
        return _tokenizers[key]
    return await asyncio.to_thread(_load_tokenizer_blocking, args, settings.tokenizer)


def encode(tokenizer: Any, text: str) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # tokenizers without that keyword add nothing anyway
        ids = tokenizer.encode(text)
    return [int(i) for i in ids]
