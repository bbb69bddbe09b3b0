"""Changing a plan at start time (``weenv up --cpu …``, ``Client.create(plan, **overrides)``) and
filling it from an image's config (``weenv pull``): the plan's own values always win."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ._codec import decode_builtins, plan_to_builtins
from ._errors import PlanValidationError, Problem
from ._model import Plan
from ._units import parse_cpu_range, parse_memory_range
from ._validate import normalised_path

P = TypeVar("P", bound=Plan)
OVERRIDES_SOURCE = "overrides"
IMAGE_SOURCE = "image config"


def apply_overrides(
    plan: P,
    *,
    name: str | None = None,
    ttl_s: float | None = None,
    cpu: float | str | tuple[float, float] | None = None,
    memory: int | str | tuple[int | str, int | str] | None = None,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    user: str | None = None,
    network: str | None = None,
    volumes: Sequence[Mapping[str, Any]] | None = None,
    mounts: Sequence[Mapping[str, Any]] | None = None,
) -> P:
    """A copy of ``plan`` (a :class:`Lock` stays a lock) with the given values replaced.

    ``cpu``: ``0.5`` or ``"0.5"`` sets min and max to 0.5 cores; ``"0.25-2"`` or ``(0.25, 2)`` a
    range. ``memory``: ``"1GiB"`` or bytes sets both; ``"512MiB-2GiB"`` a range. ``env`` is merged
    over the plan's (its keys win); ``volumes`` (``[[volumes]]`` tables) are mounted beside the plan's, and ``mounts``
    (``[[mounts]]``: read-only host binds) likewise. ``None`` leaves a value as it is. The result is validated like
    a file; errors name the override (``cpu: …``) and come from source ``overrides``.
    """
    data = plan_to_builtins(plan)
    problems: list[Problem] = []
    resources = data.setdefault("resources", {})
    if cpu is not None:
        try:
            low, high = parse_cpu_range(cpu)
            resources["cpu"] = {"min": low, "max": high}
        except (ValueError, TypeError) as e:
            problems.append(Problem("cpu", str(e)))
    if memory is not None:
        try:
            low_b, high_b = parse_memory_range(memory)
            resources["memory"] = {"min": low_b, "max": high_b}
        except (ValueError, TypeError) as e:
            problems.append(Problem("memory", str(e)))
    if problems:
        raise PlanValidationError(OVERRIDES_SOURCE, problems)
    for key, value in (("name", name), ("ttl_s", ttl_s), ("workdir", workdir), ("user", user), ("network", network)):
        if value is not None:
            data[key] = value
    if env is not None:
        data["env"] = {**data.get("env", {}), **dict(env)}
    if volumes:
        data["volumes"] = [*data.get("volumes", []), *(dict(v) for v in volumes)]
    if mounts:
        data["mounts"] = [*data.get("mounts", []), *(dict(m) for m in mounts)]
    return decode_builtins(data, type(plan), source=OVERRIDES_SOURCE, fmt="json")


def plan_defaults_from_image(config: Mapping[str, Any] | Any, *, command_as_init: bool = False,
                             source: str = "") -> dict[str, Any]:
    """Plan defaults (``env``, ``workdir``, ``user``, the ``[image]`` table) from an OCI image config.

    ``config`` is the image config document (its ``config`` object is used), that object itself,
    or a ``weenv.registry.ImageConfig``; the OCI keys are ``Env`` (``["K=V", …]``),
    ``WorkingDir``, ``User``, ``Entrypoint``, ``Cmd``, ``ExposedPorts``, ``Labels`` and ``StopSignal``
    (the last five go to the ``[image]`` table, with ``source``, the image reference, when given).
    Entrypoint + Cmd become ``init`` only with ``command_as_init=True``: an image's command is
    usually a shell or a server that exits or serves, while a weenv env wants a process that idles
    until it is told to run things. Empty values are left out. Raises
    :class:`PlanValidationError` (source ``image config``) for values a plan would refuse.
    """
    if not isinstance(config, Mapping) and hasattr(config, "working_dir"):
        # weenv.registry.ImageConfig (what `weenv pull` keeps): same fields, Python names.
        config = {"Env": list(config.env), "WorkingDir": config.working_dir, "User": config.user,
                  "Entrypoint": list(config.entrypoint), "Cmd": list(config.cmd)}
    inner = config.get("config", config) if isinstance(config, Mapping) else None
    if inner is None:
        inner = {}
    if not isinstance(inner, Mapping):
        raise PlanValidationError(IMAGE_SOURCE, [Problem("config", "expected an object")])
    out: dict[str, Any] = {}
    problems: list[Problem] = []
    env_list = inner.get("Env") or []
    env: dict[str, str] = {}
    if not isinstance(env_list, list):
        problems.append(Problem("Env", "expected a list of NAME=VALUE strings"))
        env_list = []
    for i, item in enumerate(env_list):
        if not isinstance(item, str) or "=" not in item:
            problems.append(Problem(f"Env[{i}]", f"expected NAME=VALUE, got {item!r}"))
            continue
        key, _, value = item.partition("=")
        env[key] = value  # later entries win, as in the runtime
    if env:
        out["env"] = env
    workdir = inner.get("WorkingDir")
    if workdir:
        # OCI allows a relative WorkingDir; runtimes resolve it against "/".
        out["workdir"] = normalised_path(os.path.join("/", workdir)) if isinstance(workdir, str) else workdir
    user = inner.get("User")
    if user:
        out["user"] = user
    if command_as_init:
        argv = list(inner.get("Entrypoint") or []) + list(inner.get("Cmd") or [])
        if argv:
            out["init"] = argv
    image: dict[str, Any] = {}
    for oci_key, key in (("Entrypoint", "entrypoint"), ("Cmd", "cmd")):
        if inner.get(oci_key):
            image[key] = inner[oci_key]
    ports = inner.get("ExposedPorts")
    if ports:
        image["ports"] = sorted(ports) if isinstance(ports, Mapping) else ports
    if inner.get("Labels"):
        image["labels"] = inner["Labels"]
    if inner.get("StopSignal"):
        image["stop_signal"] = inner["StopSignal"]
    if image or source:
        out["image"] = {"source": source, **image} if source else image
    if problems:
        raise PlanValidationError(IMAGE_SOURCE, problems)
    # Check the values with the plan's own rules (a throwaway plan around them).
    probe = {"name": "image", "snapshot": "image", **out}
    try:
        decode_builtins(probe, Plan, source=IMAGE_SOURCE, fmt="json")
    except PlanValidationError as e:
        raise PlanValidationError(IMAGE_SOURCE, e.problems) from None
    return out


def apply_image_defaults(plan: P, defaults: Mapping[str, Any]) -> P:
    """``plan`` with ``defaults`` (from :func:`plan_defaults_from_image`) filled in where the plan
    says nothing: env is merged under the plan's (plan keys win); workdir, user, init only when
    the plan leaves them unset (and the ``[image]`` table)."""
    data = plan_to_builtins(plan)
    if defaults.get("env"):
        data["env"] = {**dict(defaults["env"]), **data.get("env", {})}
    for key in ("workdir", "user", "init", "image"):
        if key in defaults and data.get(key) is None:
            data[key] = defaults[key]
    return decode_builtins(data, type(plan), source=IMAGE_SOURCE, fmt="json")
