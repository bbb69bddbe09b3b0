"""Weenv settings for a rollout: per sample, with defaults from slime's ``args`` and the environment.

Every setting ``key`` is looked up, first found wins:

1. ``sample.metadata["weenv"]["key"]``   (the dataset row; a dict or a JSON string)
2. ``args.weenv_key``                    (a top-level key of the ``--custom-config-path`` YAML)
3. environment variable ``WEENV_KEY``    (strings; lists, tables and ``evaluator`` as JSON)
4. the default below

``evaluator`` merges key by key: ``args.weenv_evaluator`` gives defaults for
``metadata.weenv.evaluator``. Unknown keys are errors (a typo must not silently do nothing), and
every error names where the value came from.
"""

from __future__ import annotations

import json
import os
import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ._errors import ConfigError

PositiveSeconds = Annotated[float, Meta(gt=0)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class EvaluatorSpec(_Strict):
    """How a finished episode is graded (``evaluator`` table)."""

    #: Shell command; exit 0 → reward 1.0, else 0.0, unless its last stdout line is JSON: a number,
    #: or an object with a ``reward`` number.
    command: str
    timeout_s: PositiveSeconds = 300.0
    #: Grade in a fresh env made from the task snapshot (after setup, before the agent acted)
    #: instead of in the agent's env; ``copy_paths`` are carried over from the agent's env.
    grade_in_clean_env: bool = False
    copy_paths: list[str] = []
    user: str | None = None
    workdir: str | None = None
    env: dict[str, str] = {}


class EnvSpec(_Strict):
    """Everything one sample needs from weenv. See docs/slime.md for each key."""

    #: A plan or lock file path, an image REF (docs/images.md), or an inline plan table. One of ``plan`` /
    #: ``snapshot`` is needed.
    plan: str | dict[str, Any] | None = None
    #: A snapshot id (``snap-…``) to start from instead of a plan.
    snapshot: str | None = None
    workdir: str | None = None
    user: str = "root"
    env: dict[str, str] = {}
    #: Commands run once per task env before the agent starts (and before the group snapshot).
    setup: list[str] = []
    setup_timeout_s: PositiveSeconds = 600.0
    max_turns: Annotated[int, Meta(ge=1)] = 10
    #: Per tool call; a call past it is killed and the model sees exit code 124.
    command_timeout_s: PositiveSeconds = 60.0
    max_observation_bytes: Annotated[int, Meta(ge=64)] = 8192
    parser: str = "bash"
    #: Text around every observation, e.g. chat-template turn markers; not trained on.
    observation_prefix: str = ""
    observation_suffix: str = ""
    evaluator: EvaluatorSpec | None = None
    #: Prepare the task env once per group (same ``group_index``), snapshot it, and start each
    #: sample from the snapshot. Falls back to an env per sample when snapshots are unavailable.
    group_fork: bool = True
    cpu: float | str | None = None
    memory: int | str | None = None
    ttl_s: PositiveSeconds | None = None


class RolloutSettings(_Strict):
    """Process-wide settings (``args`` / environment only; not per sample)."""

    #: The weenv daemon's Unix socket; default: the client's default (``$WEENV_HOME/run/weenv.sock``).
    socket: str | None = None
    #: Start a daemon when none answers. Off: a rollout node should run ``weenv daemon`` already,
    #: and starting one blocks the event loop for up to 30 s.
    autostart: bool = False
    #: Env creations (create, snapshot, fork) in flight at once, independent of SGLang's semaphore.
    create_concurrency: Annotated[int, Meta(ge=1)] = 16
    #: Envs this process keeps alive at once (each sample holds at most one at a time); ``None``:
    #: no limit but the node's admission control.
    max_envs: Annotated[int, Meta(ge=1)] | None = None
    #: How long a creation refused for lack of node capacity is retried before the sample aborts.
    admission_timeout_s: Annotated[float, Meta(ge=0)] = 600.0
    #: ``package.module.factory`` called with ``args`` to get a tokenizer; default: Hugging Face
    #: ``AutoTokenizer.from_pretrained(args.hf_checkpoint)``.
    tokenizer: str | None = None
    #: Wall-clock guard for a whole sample (envs, generation, grading); ``None``: no guard.
    episode_timeout_s: PositiveSeconds | None = None
    sglang_timeout_s: PositiveSeconds = 600.0
    sglang_retries: Annotated[int, Meta(ge=0)] = 3
    #: Deadline of each daemon call but exec (create, commit, kill, file transfer); exec calls get
    #: this on top of the command's own timeout.
    client_timeout_s: PositiveSeconds = 300.0
    #: A Ray cluster whose nodes run weenv node agents: ``"auto"`` (the Ray cluster this job runs
    #: in) or its address; envs are then placed over its nodes (docs/cluster.md). ``None``: the
    #: node's own daemon (``socket``).
    cluster: str | None = None
    #: The token the node agents check (env ``WEENV_CLUSTER_TOKEN``).
    cluster_token: str | None = None
    #: ``host[:port]/repo`` of the cluster's registry: group snapshots are published there, so the
    #: envs of one group start on any node.
    cluster_store: str | None = None


ENV_FIELDS = frozenset(EnvSpec.__struct_fields__)
ROLLOUT_FIELDS = frozenset(RolloutSettings.__struct_fields__)
_STRING_FIELDS = {"plan", "snapshot", "workdir", "user", "parser", "observation_prefix", "observation_suffix",
                  "socket", "tokenizer", "cpu", "memory", "cluster", "cluster_token", "cluster_store"}
_AT = re.compile(r"at `\$\.?([^`]*)`")


def _env_value(key: str, raw: str) -> Any:
    if key in _STRING_FIELDS:
        return raw
    text = raw.strip()
    if text[:1] in "[{\"" or key in ("setup", "env", "copy_paths", "evaluator"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"env WEENV_{key.upper()}", f"not valid JSON: {e.msg}") from None
    if text.lower() in ("none", "null", ""):
        return None
    return text  # msgspec (strict=False) turns "8", "1.5", "true" into the field's type


def _args_settings(args: Any) -> dict[str, Any]:
    """``args.weenv_*`` attributes that are set, checked against the known keys."""
    found = {}
    for name, value in vars(args).items() if hasattr(args, "__dict__") else ():
        if not name.startswith("weenv_") or value is None:
            continue
        key = name[len("weenv_"):]
        if key not in ENV_FIELDS and key not in ROLLOUT_FIELDS:
            known = ", ".join(sorted(f"weenv_{k}" for k in ENV_FIELDS | ROLLOUT_FIELDS))
            raise ConfigError(f"args.{name}", f"unknown weenv setting (known: {known})")
        found[key] = value
    return found


def _convert(cls: type, merged: dict[str, Any], sources: dict[str, str]) -> Any:
    try:
        return msgspec.convert(merged, cls, strict=False)
    except msgspec.ValidationError as e:
        message = str(e)
        m = _AT.search(message)
        path = m.group(1) if m else ""
        top = re.split(r"[.\[]", path, maxsplit=1)[0] if path else ""
        if not top:
            unknown = re.search(r"unknown field `([^`]*)`", message)
            top = unknown.group(1) if unknown else ""
        source = sources.get(top, "weenv")
        rest = path[len(top):] if path.startswith(top) else ""
        location = f"{source}{rest}" if top else source
        raise ConfigError(location, _AT.sub("", message).rstrip(" -")) from None


def _metadata_settings(sample: Any) -> dict[str, Any]:
    metadata = getattr(sample, "metadata", None)
    if not isinstance(metadata, dict) or metadata.get("weenv") is None:
        return {}
    value = metadata["weenv"]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError("metadata.weenv", f"a string that is not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise ConfigError("metadata.weenv", f"expected a table, got {type(value).__name__}")
    return value


def resolve_env_spec(args: Any, sample: Any, environ: dict[str, str] | None = None) -> EnvSpec:
    """The :class:`EnvSpec` for ``sample`` (see the module docstring for the lookup order)."""
    environ = os.environ if environ is None else environ
    from_metadata = _metadata_settings(sample)
    from_args = _args_settings(args)
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in sorted(set(from_metadata) | ENV_FIELDS):
        if key in from_metadata:
            merged[key], sources[key] = from_metadata[key], f"metadata.weenv.{key}"
        elif key in from_args:
            merged[key], sources[key] = from_args[key], f"args.weenv_{key}"
        elif f"WEENV_{key.upper()}" in environ:
            merged[key] = _env_value(key, environ[f"WEENV_{key.upper()}"])
            sources[key] = f"env WEENV_{key.upper()}"
    evaluator_defaults = from_args.get("evaluator")
    if isinstance(evaluator_defaults, dict) and isinstance(merged.get("evaluator"), dict) \
            and sources.get("evaluator", "").startswith("metadata"):
        merged["evaluator"] = {**evaluator_defaults, **merged["evaluator"]}
    spec = _convert(EnvSpec, merged, sources)
    if spec.plan is None and spec.snapshot is None:
        raise ConfigError("metadata.weenv.plan", "no plan or snapshot: set metadata.weenv.plan, args.weenv_plan "
                          "(YAML weenv_plan) or WEENV_PLAN")
    if spec.evaluator is not None and spec.evaluator.grade_in_clean_env is False and spec.evaluator.copy_paths:
        raise ConfigError(sources.get("evaluator", "evaluator") + ".copy_paths",
                          "only used with grade_in_clean_env: true")
    return spec


def resolve_rollout_settings(args: Any, environ: dict[str, str] | None = None) -> RolloutSettings:
    """The :class:`RolloutSettings` from ``args.weenv_*`` and ``WEENV_*``."""
    environ = os.environ if environ is None else environ
    from_args = _args_settings(args)
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in ROLLOUT_FIELDS:
        if key in from_args:
            merged[key], sources[key] = from_args[key], f"args.weenv_{key}"
        elif f"WEENV_{key.upper()}" in environ:
            merged[key] = _env_value(key, environ[f"WEENV_{key.upper()}"])
            sources[key] = f"env WEENV_{key.upper()}"
    return _convert(RolloutSettings, merged, sources)


def spec_fingerprint(spec: EnvSpec) -> str:
    """What makes two samples' task envs the same (the group-template key)."""
    return json.dumps(
        [spec.plan, spec.snapshot, spec.workdir, spec.user, spec.env, spec.setup, spec.cpu, spec.memory],
        sort_keys=True, default=str,
    )
