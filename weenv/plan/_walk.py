"""Walking plan data alongside its msgspec type: locations, size fields, and type lookups."""

from __future__ import annotations

import functools
import json
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import msgspec.inspect as mi

Segment = str | int
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def format_location(segments: Sequence[Segment]) -> str:
    """``["groups", 2, "ref"]`` → ``groups[2].ref``; odd dict keys are quoted: ``env."A B"``."""
    out = ""
    for seg in segments:
        if isinstance(seg, int):
            out += f"[{seg}]"
        else:
            text = seg if _BARE_KEY.match(seg) else json.dumps(seg)
            out += f".{text}" if out else text
    return out


@functools.lru_cache(maxsize=None)
def type_info(cls: type) -> mi.Type:
    return mi.type_info(cls)


def unwrap(t: mi.Type) -> tuple[mi.Type, dict[str, Any]]:
    """The type under any ``Metadata`` layers, and their merged ``extra``."""
    extra: dict[str, Any] = {}
    while isinstance(t, mi.Metadata):
        extra.update(t.extra or {})
        t = t.type
    return t, extra


def _non_none(t: mi.Type) -> list[mi.Type]:
    base, _ = unwrap(t)
    if isinstance(base, mi.UnionType):
        return [m for m in base.types if not isinstance(unwrap(m)[0], mi.NoneType)]
    return [t]


def child_type(t: mi.Type, segment: Segment) -> mi.Type | None:
    """The type of ``value[segment]`` when ``value`` has type ``t``; ``None`` if unknown."""
    for member in _non_none(t):
        base, _ = unwrap(member)
        if isinstance(base, mi.StructType) and isinstance(segment, str):
            for f in base.fields:
                if f.encode_name == segment:
                    return f.type
        elif isinstance(base, mi.ListType) and isinstance(segment, int):
            return base.item_type
        elif isinstance(base, mi.DictType) and isinstance(segment, str):
            return base.value_type
    return None


def struct_of(t: mi.Type | None) -> mi.StructType | None:
    if t is None:
        return None
    for member in _non_none(t):
        base, _ = unwrap(member)
        if isinstance(base, mi.StructType):
            return base
    return None


def is_size(t: mi.Type | None) -> bool:
    return t is not None and any(unwrap(m)[1].get("unit") == "bytes" for m in _non_none(t))


@functools.lru_cache(maxsize=None)
def size_paths(cls: type) -> tuple[tuple[str | None, ...], ...]:
    """Paths to every size field of ``cls``; ``None`` stands for any list index or dict key."""
    out: list[tuple[str | None, ...]] = []

    def visit(t: mi.Type, path: tuple[str | None, ...], seen: frozenset[type]) -> None:
        if is_size(t):
            out.append(path)
            return
        for member in _non_none(t):
            base, _ = unwrap(member)
            if isinstance(base, mi.StructType) and base.cls not in seen:
                for f in base.fields:
                    visit(f.type, (*path, f.encode_name), seen | {base.cls})
            elif isinstance(base, mi.ListType):
                visit(base.item_type, (*path, None), seen)
            elif isinstance(base, mi.DictType):
                visit(base.value_type, (*path, None), seen)

    visit(type_info(cls), (), frozenset())
    return tuple(out)


def map_sizes(value: Any, cls: type, fn: Callable[[Any, list[Segment]], Any]) -> Any:
    """A copy of ``value`` (builtins of a ``cls``) with ``fn(v, path)`` applied to every size
    field present. Shapes that do not match the type are left alone, for msgspec to report."""

    def apply(node: Any, rest: tuple[str | None, ...], path: list[Segment]) -> Any:
        if not rest:
            return fn(node, path)
        head, tail = rest[0], rest[1:]
        if head is None:
            if isinstance(node, list):
                return [apply(v, tail, [*path, i]) for i, v in enumerate(node)]
            if isinstance(node, dict):
                return {k: apply(v, tail, [*path, k]) for k, v in node.items()}
            return node
        if isinstance(node, dict) and head in node:
            return {**node, head: apply(node[head], tail, [*path, head])}
        return node

    for p in size_paths(cls):
        value = apply(value, p, [])
    return value


def dict_item_types(struct_cls: type, field_name: str) -> tuple[Any, Any] | None:
    """The (key, value) annotations of a dict-typed field, with their ``Meta`` kept."""
    hint = typing.get_type_hints(struct_cls, include_extras=True).get(field_name)
    while typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) is dict:
        key_t, value_t = typing.get_args(hint)
        return key_t, value_t
    return None


def convert_ok(value: Any, annotation: Any) -> bool:
    """Whether ``value`` alone passes the checks of ``annotation``."""
    try:
        msgspec.convert(value, annotation)
    except msgspec.ValidationError:
        return False
    return True
