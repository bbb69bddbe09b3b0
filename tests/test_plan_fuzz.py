"""Fuzzing the plan and lock readers: whatever the bytes, only typed errors that name the file.

Like the layer parser's fuzz tests: garbage, mutated valid documents and random structures go
through every reader (``load_any`` / ``load_lock`` / ``load_plan`` on paths and text,
``load_text``, ``plan_from_builtins``); each either returns a plan or raises a
:class:`weenv.plan.PlanError` whose every line starts with the document's name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weenv.plan as wp
from weenv.plan import Lock, PlanError

H = "sha256:" + "ab" * 32
LOCK_TOML = f"""\
lock_version = 1
name = "demo"
workdir = "/work"
ttl_s = 600
init = ["/bin/sleep", "infinity"]

[env]
PATH = "/usr/bin:/bin"

[resources]
pids = 256
disk = "64MiB"

[resources.cpu]
min = 0.25
max = 2.0

[resources.memory]
min = "64MiB"
max = "512MiB"

[[groups]]
name = "os"
ref = "busybox:test"
class = "os"
digest = "{H}"
layer_digest = "{H}"
layer_size = 1234
toc_digest = "{H}"
repo = "busybox"

[[mounts]]
source = "/srv/data"
target = "/data"
"""
LOCK_JSON = wp.dump_plan(wp.load_lock(LOCK_TOML), "json")
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_named(e: PlanError, name: str) -> None:
    text = str(e)
    assert text, "an empty message"
    for line in text.split("\n"):
        assert line.startswith(name + ":"), f"{line!r} does not name {name!r}"


def read_all_ways(data: bytes, tmp: Path, name: str) -> None:
    """Every reader on ``data``: a plan or a PlanError naming the file, nothing else."""
    path = tmp / name
    path.write_bytes(data)
    for reader in (wp.load_any, wp.load_lock, wp.load_plan):
        for src in (path, str(path)):
            try:
                reader(src)
            except PlanError as e:
                assert_named(e, str(path))
    # as text: load_text takes str or bytes; load_any takes bytes as text (a str may be a path)
    for reader, src in ((wp.load_text, data), (wp.load_text, data.decode("utf-8", "replace")), (wp.load_any, data)):
        try:
            reader(src, source=name)
        except PlanError as e:
            assert_named(e, name)


def _mutate(doc: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    out = bytearray(doc)
    for pos, cut, insert in edits:
        pos %= len(out) + 1
        out[pos : pos + cut] = insert
    return bytes(out)


_edits = st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 8), st.binary(max_size=6)), min_size=1, max_size=6)
_tokens = st.sampled_from([b"\x00", b"\xff", b"\n", b"=", b"[", b"]", b"{", b"}", b'"', b"'", b"[[", b"inf", b"nan",
                           b"-", b"1e308", b"9" * 5000, b"\\u0000", b"true", b"1979-05-27", b"/..", b"..", b","])


@FUZZ
@given(st.binary(max_size=512))
def test_binary_garbage_gives_typed_errors_naming_the_file(tmp_path_factory, data):
    read_all_ways(data, tmp_path_factory.mktemp("g"), "garbage.lock")


@FUZZ
@given(st.sampled_from([LOCK_TOML.encode(), LOCK_JSON.encode()]), _edits)
def test_mutated_locks_give_typed_errors_naming_the_file(tmp_path_factory, doc, edits):
    read_all_ways(_mutate(doc, edits), tmp_path_factory.mktemp("m"), "plan.lock")


@FUZZ
@given(st.sampled_from([LOCK_TOML.encode(), LOCK_JSON.encode()]),
       st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 4), _tokens), min_size=1, max_size=4))
def test_locks_with_odd_tokens_give_typed_errors_naming_the_file(tmp_path_factory, doc, edits):
    read_all_ways(_mutate(doc, edits), tmp_path_factory.mktemp("t"), "plan.lock.json")


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20),
                     st.sampled_from(["", "/", "/..", "1GiB", "64TiB", H, "os", "a:b", "\x00"]))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                       max_leaves=20)
_LOCK_RAW = json.loads(LOCK_JSON)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


_LOCK_PATHS = _paths(_LOCK_RAW)[1:]


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(doc, dict):
        return {**doc, head: _replace(doc[head], rest, value)}
    out = list(doc)
    out[head] = _replace(out[head], rest, value)
    return out


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_LOCK_PATHS), _values), min_size=1, max_size=3))
def test_any_value_in_any_field_gives_a_located_error(changes):
    doc = _LOCK_RAW
    for path, value in changes:
        try:
            doc = _replace(doc, path, value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier change replaced what this path goes through
    for cls in (Lock, wp.Plan):
        try:
            wp.plan_from_builtins(doc, cls, source="request body $.plan")
        except PlanError as e:
            assert_named(e, "request body $.plan")
    text = json.dumps(doc, allow_nan=True)
    try:
        wp.load_text(text, fmt="json", source="plan.lock.json")
    except PlanError as e:
        assert_named(e, "plan.lock.json")


@FUZZ
@given(_values)
def test_random_documents_give_typed_errors(doc):
    try:
        wp.plan_from_builtins(doc, Lock, source="doc")  # type: ignore[arg-type]
    except PlanError as e:
        assert_named(e, "doc")


@pytest.mark.parametrize("data,fragment", [
    (b"\x00" * 64, "garbage.lock:1:1: a NUL byte: this is binary data, not a plan"),
    (b"\x00\x01\x02abc", "garbage.lock:1:1: a NUL byte"),
    (b"lock_version = 1\x00\n", "garbage.lock:1:17: a NUL byte"),
    (b"\xff\xfe\x00", "garbage.lock:1:1: not UTF-8 text"),
    (b"x = " + b"[" * 100_000, "garbage.lock: invalid TOML: nested too deeply"),
    (b'{"a":' + b"[" * 100_000, "garbage.lock: invalid JSON: nested too deeply"),
    (b"x = " + b"9" * 5000, "garbage.lock: invalid TOML: Exceeds the limit"),
    (b'{"name": 1' + b"0" * 5000 + b"}", "garbage.lock: invalid JSON: Exceeds the limit"),
    (b"justoneword", "garbage.lock:1:12: invalid TOML"),
    (b"x" * (17 << 20), "garbage.lock: larger than 16 MiB: not a plan"),
])
def test_garbage_files_name_the_file_and_what_is_wrong(tmp_path, monkeypatch, data, fragment):
    path = tmp_path / "garbage.lock"
    path.write_bytes(data)
    monkeypatch.chdir(tmp_path)  # messages then carry the name as given
    with pytest.raises(PlanError) as info:
        wp.load_any("garbage.lock")
    assert str(info.value).startswith(fragment)
    with pytest.raises(PlanError) as info:
        wp.load_text(data, source="garbage.lock")
    assert str(info.value).startswith(fragment)


def test_text_is_never_taken_for_a_path(tmp_path):
    """load_text (what the daemon reads requests with) never opens a file, whatever the string."""
    secret = tmp_path / "secret.toml"
    secret.write_text('name = "secret"\nsnapshot = "s"\n')
    assert wp.load_any(str(secret)).name == "secret"  # a path for load_any ...
    with pytest.raises(wp.PlanSyntaxError, match=r"^req:1:\d+: invalid TOML"):
        wp.load_text(str(secret), source="req")  # ... but text for load_text
    with pytest.raises(wp.PlanSyntaxError, match="^req: expected plan text, got int"):
        wp.load_text(3, source="req")  # type: ignore[arg-type]
    with pytest.raises(wp.PlanSyntaxError, match="^req: unknown plan format 'yaml'"):
        wp.load_text("name = 'x'", fmt="yaml", source="req")  # type: ignore[arg-type]
    # a string with a NUL is never a path (open() would raise a bare ValueError)
    with pytest.raises(wp.PlanSyntaxError, match=r"^<plan>:1:4: a NUL byte"):
        wp.load_any("abc\x00def")
