"""Reading and writing plans and locks: TOML for people, JSON for programs, JSON Schema for editors.

A document is parsed (syntax errors name file, line and column), its sizes are turned into bytes,
msgspec converts it to a :class:`Plan` or :class:`Lock` (type errors are translated to the plan's
locations), then :func:`check_plan` applies the cross-field rules. A lock is recognised by its
``lock_version`` key, whatever the file is called.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from typing import Any, Literal, TypeVar, overload

import msgspec
import msgspec.inspect as mi
import tomli_w

from .._atomic import atomic_write
from ._errors import PlanSyntaxError, PlanValidationError, Problem
from ._model import LOCK_VERSION, Lock, Plan
from ._units import SIZE_PATTERN, format_size, parse_size
from ._validate import check_plan, shape_problem, translate_error
from ._walk import format_location, is_size, map_sizes, struct_of, type_info, unwrap

Format = Literal["toml", "json"]
P = TypeVar("P", bound=Plan)
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_TOML_WHERE = re.compile(r"\(at line (\d+), column (\d+)\)\s*$")
_LOCK_HEADER = "# weenv plan lock: every group pinned to digests. Made by `weenv plan lock`; do not edit.\n"

PlanSource = str | bytes | os.PathLike[str]


MAX_DOCUMENT_BYTES = 16 * 1024**2
"""Largest plan or lock file read: far above any plan the value bounds admit (env ≤ 1 MiB, init ≤
512 KiB, ≤ 128 groups), small enough that garbage is refused before it is parsed."""


def _read_source(src: PlanSource, source: str | None) -> tuple[bytes, str]:
    """(bytes, name for messages). PathLike → file; str → text if it looks like a document, else a path."""
    if isinstance(src, os.PathLike) or (isinstance(src, str) and not _looks_like_text(src)):
        path = os.fspath(src)
        name = source or path
        with open(path, "rb") as f:
            data = f.read(MAX_DOCUMENT_BYTES + 1)
    elif isinstance(src, (str, bytes)):
        data = src if isinstance(src, bytes) else src.encode("utf-8", "surrogatepass")
        name = source or "<plan>"
    else:
        raise PlanSyntaxError(source or "<plan>", f"expected plan text or a path, got {type(src).__name__}")
    return data, name


def _decode_text(data: bytes, name: str) -> str:
    if len(data) > MAX_DOCUMENT_BYTES:
        raise PlanSyntaxError(name, f"larger than {MAX_DOCUMENT_BYTES // 1024**2} MiB: not a plan")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise PlanSyntaxError(name, "not UTF-8 text", line=line, column=column) from None
    nul = text.find("\x00")
    if nul >= 0:  # neither TOML nor JSON admits a raw NUL; say so before a parser says something odder
        line = text.count("\n", 0, nul) + 1
        raise PlanSyntaxError(name, "a NUL byte: this is binary data, not a plan", line=line,
                              column=nul - (text.rfind("\n", 0, nul) + 1) + 1)
    return text


def _looks_like_text(s: str) -> bool:
    # A NUL cannot be in a path, and no path is that long: both mean the string is content.
    return "\n" in s or "=" in s or "\x00" in s or len(s) > 4096 or s.lstrip().startswith(("{", "["))


def sniff_format(text: str) -> Format:
    """JSON if the document starts with ``{`` (a TOML document cannot), else TOML."""
    return "json" if text.lstrip("\ufeff \t\r\n").startswith("{") else "toml"


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a number plans accept")


def parse_document(text: str, fmt: Format | None = None, *, source: str = "<plan>") -> tuple[Any, Format]:
    """The builtins of a TOML or JSON document; :class:`PlanSyntaxError` with line and column."""
    fmt = fmt or sniff_format(text)
    try:
        return _parse(text, fmt, source)
    except RecursionError:
        raise PlanSyntaxError(source, f"invalid {fmt.upper()}: nested too deeply") from None


def _parse(text: str, fmt: Format, source: str) -> tuple[Any, Format]:
    if fmt == "toml":
        try:
            return tomllib.loads(text), fmt
        except tomllib.TOMLDecodeError as e:
            msg = str(e)
            where = _TOML_WHERE.search(msg)
            if where:
                raise PlanSyntaxError(source, f"invalid TOML: {msg[: where.start()].strip()}",
                                      line=int(where[1]), column=int(where[2])) from None
            if msg.endswith("(at end of document)"):
                lines = text.split("\n")
                raise PlanSyntaxError(source, f"invalid TOML: {msg.removesuffix('(at end of document)').strip()}",
                                      line=len(lines), column=len(lines[-1]) + 1) from None
            raise PlanSyntaxError(source, f"invalid TOML: {msg}") from None
        except ValueError as e:  # what the TOML parser passes through, e.g. an integer of 5000 digits
            raise PlanSyntaxError(source, f"invalid TOML: {e}") from None
    if fmt == "json":
        try:
            return json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_no_constants), fmt
        except json.JSONDecodeError as e:
            raise PlanSyntaxError(source, f"invalid JSON: {e.msg}", line=e.lineno, column=e.colno) from None
        except ValueError as e:  # from the hooks: we know the message, not the position
            raise PlanSyntaxError(source, f"invalid JSON: {e}") from None
    raise PlanSyntaxError(source, f"unknown plan format {fmt!r} (use 'toml' or 'json')")


def _sizes_to_bytes(raw: Any, cls: type, problems: list[Problem]) -> Any:
    def convert(value: Any, path: list[Any]) -> Any:
        if isinstance(value, str):
            try:
                return parse_size(value)
            except ValueError as e:
                problems.append(Problem(format_location(path), str(e)))
        return value

    return map_sizes(raw, cls, convert)


def decode_builtins(raw: Any, cls: type[P], *, source: str = "<plan>", fmt: Format = "toml") -> P:
    """Validate parsed builtins as ``cls`` (:class:`Plan` or :class:`Lock`); located errors."""
    try:
        return _decode_builtins(raw, cls, source, fmt)
    except RecursionError:  # builtins made by a program rather than parsed from a file
        raise PlanValidationError(source, [Problem("", "nested too deeply")]) from None


def _decode_builtins(raw: Any, cls: type[P], source: str, fmt: Format) -> P:
    problem = shape_problem(raw, fmt)
    if problem:
        raise PlanValidationError(source, [problem])
    if cls is Lock and "lock_version" not in raw:
        raise PlanValidationError(source, [Problem("lock_version", (
            "required field is missing: this is a plan, not a lock (make a lock with `weenv plan lock`)"
        ))])
    if cls is not Lock and "lock_version" in raw:
        raise PlanValidationError(source, [Problem("lock_version", (
            "this is a lock, not a plan: read it with load_lock or load_any"
        ))])
    if "lock_version" in raw and raw["lock_version"] != LOCK_VERSION and isinstance(raw["lock_version"], int) \
            and not isinstance(raw["lock_version"], bool):
        raise PlanValidationError(source, [Problem("lock_version", (
            f"unsupported lock version {raw['lock_version']}; this weenv reads version {LOCK_VERSION}"
        ))])
    problems: list[Problem] = []
    converted = _sizes_to_bytes(raw, cls, problems)
    if problems:
        raise PlanValidationError(source, problems[:1])
    try:
        plan = msgspec.convert(converted, cls)
    except msgspec.ValidationError as e:
        raise PlanValidationError(source, [translate_error(e, converted, cls, fmt, original=raw)]) from None
    problems = check_plan(plan)
    if problems:
        raise PlanValidationError(source, problems)
    return plan


def _load(src: PlanSource, cls: type[Plan] | None, fmt: Format | None, source: str | None) -> Plan:
    data, name = _read_source(src, source)
    # a .json file that does not start with "{" is still meant as JSON (load_text sees to it)
    return load_text(data, fmt=fmt, source=name, cls=cls)


def load_text(text: str | bytes, *, fmt: Format | None = None, source: str = "<plan>",
              cls: type[Plan] | None = None) -> Plan | Lock:
    """A :class:`Lock` or :class:`Plan` (or ``cls``) from document text, never read as a path: for
    text that comes from elsewhere (the daemon's API), where a string must not name a local file."""
    if not isinstance(text, (str, bytes)):
        raise PlanSyntaxError(source, f"expected plan text, got {type(text).__name__}")
    data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    doc = _decode_text(data, source)
    if fmt is None and sniff_format(doc) == "toml" and source.lower().endswith(".json"):
        fmt = "json"
    raw, used = parse_document(doc, fmt, source=source)
    if cls is None:
        cls = Lock if isinstance(raw, dict) and "lock_version" in raw else Plan
    return decode_builtins(raw, cls, source=source, fmt=used)


def load_plan(src: PlanSource, *, fmt: Format | None = None, source: str | None = None) -> Plan:
    """A :class:`Plan` from a file (``Path``, or a ``str`` path) or from document text.

    A ``str`` is read as text when it contains a newline or ``=``, or starts with ``{`` or ``[``; otherwise it
    is a path. ``fmt`` defaults to sniffing (``{`` → JSON, a ``.json`` name → JSON, else TOML); ``source`` names the
    document in messages (default: the path, or ``<plan>``). A lock is refused: use :func:`load_any`.
    """
    return _load(src, Plan, fmt, source)


def load_lock(src: PlanSource, *, fmt: Format | None = None, source: str | None = None) -> Lock:
    """A :class:`Lock` (a document with ``lock_version``); a plain plan is refused."""
    lock = _load(src, Lock, fmt, source)
    assert isinstance(lock, Lock)
    return lock


def load_any(src: PlanSource, *, fmt: Format | None = None, source: str | None = None) -> Plan | Lock:
    """A :class:`Lock` if the document has ``lock_version``, else a :class:`Plan`."""
    return _load(src, None, fmt, source)


def is_locked(plan: Plan) -> bool:
    """Whether every group is pinned (the plan is a :class:`Lock`)."""
    return isinstance(plan, Lock)


def _drop_none(value: Any, drop_empty: bool) -> Any:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            v = _drop_none(v, drop_empty)
            if v is None or (drop_empty and isinstance(v, (dict, list)) and not v):
                continue
            out[k] = v
        return out
    if isinstance(value, list):
        return [_drop_none(v, drop_empty) for v in value]
    return value


def plan_to_builtins(plan: Plan, *, human_sizes: bool = False, drop_empty: bool = False) -> dict[str, Any]:
    """The plan as dicts and lists with file keys (``class``), every default explicit, ``None``
    fields left out (absent and ``None`` mean the same); ``lock_version`` first for locks."""
    data = _drop_none(msgspec.to_builtins(plan), drop_empty)
    if human_sizes:
        data = map_sizes(data, type(plan), lambda v, _p: format_size(v) if isinstance(v, int) else v)
    if "lock_version" in data:
        data = {"lock_version": data.pop("lock_version"), **data}
    return data


def dump_plan(plan: Plan, fmt: Format = "toml") -> str:
    """The plan or lock as TOML (sizes as "2GiB", empty tables left out) or indented JSON."""
    if fmt == "json":
        return json.dumps(plan_to_builtins(plan), indent=2, ensure_ascii=False) + "\n"
    if fmt == "toml":
        text = tomli_w.dumps(plan_to_builtins(plan, human_sizes=True, drop_empty=True))
        return (_LOCK_HEADER + text) if isinstance(plan, Lock) else text
    raise ValueError(f"unknown plan format {fmt!r} (use 'toml' or 'json')")


def format_for_path(path: str | os.PathLike[str]) -> Format:
    """JSON for ``*.json``, TOML otherwise."""
    return "json" if os.fspath(path).lower().endswith(".json") else "toml"


def write_plan(plan: Plan, path: str | os.PathLike[str], fmt: Format | None = None) -> None:
    """Write atomically (temp file in the same directory, fsync, rename; mode 0644); format by extension."""
    path = os.fspath(path)
    atomic_write(path, dump_plan(plan, fmt or format_for_path(path)), mode=0o644)


def plan_json_schema(*, lock: bool = False) -> dict[str, Any]:
    """The JSON Schema of plan files (or lock files); size fields accept integers and strings."""
    cls: type[Plan] = Lock if lock else Plan
    schema = msgspec.json.schema(cls)
    defs = schema.get("$defs", {})
    seen: set[type] = set()

    def patch(st: Any) -> None:
        if st is None or st.cls in seen:
            return
        seen.add(st.cls)
        props = defs.get(st.cls.__name__, {}).get("properties", {})
        for f in st.fields:
            if is_size(f.type) and f.encode_name in props:
                prop = props[f.encode_name]
                integer = {"type": "integer"}
                for bound in ("minimum", "maximum"):
                    if bound in prop:
                        integer[bound] = prop.pop(bound)
                prop.pop("type", None)
                prop["anyOf"] = [integer, {"type": "string", "pattern": SIZE_PATTERN}]
            for member in _members(f.type):
                patch(struct_of(member))

    patch(struct_of(type_info(cls)))
    return {"$schema": SCHEMA_DIALECT,
            "title": "weenv lock" if lock else "weenv plan",
            "description": ("A weenv lock file: a plan whose groups are pinned to digests. See docs/plan.md."
                            if lock else "A weenv environment plan. See docs/plan.md."),
            **schema}


def _members(t: Any) -> list[Any]:
    """Types nested in ``t`` that may hold structs (list items, dict values, union members)."""
    base, _ = unwrap(t)
    if isinstance(base, mi.UnionType):
        return [x for m in base.types for x in _members(m)]
    if isinstance(base, mi.ListType):
        return _members(base.item_type)
    if isinstance(base, mi.DictType):
        return _members(base.value_type)
    return [base]


def dump_json_schema(*, lock: bool = False) -> str:
    return json.dumps(plan_json_schema(lock=lock), indent=2, ensure_ascii=False) + "\n"


@overload
def plan_from_builtins(data: dict[str, Any], cls: type[Lock], *, source: str = ...) -> Lock: ...
@overload
def plan_from_builtins(data: dict[str, Any], cls: type[Plan] = ..., *, source: str = ...) -> Plan: ...
def plan_from_builtins(data: dict[str, Any], cls: type[Plan] = Plan, *, source: str = "<plan>") -> Plan:
    """Validate dicts and lists (file keys, sizes as ints or strings) as a plan or lock."""
    return decode_builtins(data, cls, source=source, fmt="json")
