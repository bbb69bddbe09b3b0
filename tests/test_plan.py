"""weenv.plan: the plan and lock model, located errors, codecs, locking, overrides, schema and CLI."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weenv.plan as wp
from weenv.cli import main as cli_main
from weenv.plan import (GROUP_CLASSES, Group, Lock, LockedGroup, LockError, Mount, Plan, PlanError,
                        PlanSyntaxError, PlanValidationError, ResolvedGroup)
from weenv.plan._ref import REF_PATTERN
from weenv.plan._units import SIZE_PATTERN

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = REPO_ROOT / "docs" / "plan.schema.json"
MiB, GiB = 1024**2, 1024**3


def digest_of(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


BASE = """\
name = "demo"

[[groups]]
name = "os"
ref = "debian:12"
class = "os"

[[groups]]
name = "python"
ref = "localhost:5000/tc/python:3.11"
class = "toolchain"

[[groups]]
name = "task"
ref = "tasks/t1:v1"
class = "task"
"""

FULL = """\
name = "swe-task"
workdir = "/work"
user = "1000:1000"
ttl_s = 600
network = "loopback"
init = ["/bin/sleep", "infinity"]

[env]
PYTHONUNBUFFERED = "1"
WEIRD = "a \\"quoted\\"\\nnewline\\t tab \\u2713 \\u0001"

[resources]
pids = 512
disk = "2GiB"

[resources.cpu]
min = 0.5
max = 4

[resources.memory]
min = "512MiB"
max = "1.5G"

[[groups]]
name = "os"
ref = "debian:12"
class = "os"

[[groups]]
name = "task-1"
ref = "tasks/t1@sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
class = "task"

[[mounts]]
source = "/srv/data"
target = "/data"
"""


def load(text: str) -> Plan:
    return wp.load_plan(text, source="plan.toml")


# ---------------------------------------------------------------- model and defaults


def test_minimal_plan_takes_the_documented_defaults():
    p = load(BASE)
    assert p.name == "demo"
    assert [(g.name, g.group_class) for g in p.groups] == [("os", "os"), ("python", "toolchain"), ("task", "task")]
    assert p.env == {} and p.workdir is None and p.user is None and p.init is None
    assert p.resources.cpu.min == wp.DEFAULT_CPU_MIN_CORES == 0.25
    assert p.resources.cpu.max == wp.DEFAULT_CPU_MAX_CORES == 2.0
    assert p.resources.memory.min == wp.DEFAULT_MEMORY_MIN_BYTES == 256 * MiB
    assert p.resources.memory.max == wp.DEFAULT_MEMORY_MAX_BYTES == 2 * GiB
    assert p.resources.pids == wp.DEFAULT_PIDS == 1024
    assert p.resources.disk == wp.DEFAULT_DISK_BYTES == 1 * GiB
    assert p.network == "none" and p.ttl_s is None and p.mounts == [] and p.snapshot is None
    assert not wp.is_locked(p)


def test_full_plan_reads_every_field():
    p = load(FULL)
    assert p.workdir == "/work" and p.user == "1000:1000" and p.ttl_s == 600.0
    assert p.network == "loopback" and p.init == ["/bin/sleep", "infinity"]
    assert p.env["WEIRD"] == 'a "quoted"\nnewline\t tab \u2713 \x01'
    assert p.resources.cpu.min == 0.5 and p.resources.cpu.max == 4.0
    assert p.resources.memory.min == 512 * MiB and p.resources.memory.max == 1_500_000_000
    assert p.resources.pids == 512 and p.resources.disk == 2 * GiB
    assert p.mounts == [Mount(source="/srv/data", target="/data")]
    assert p.groups[1].ref.endswith("@sha256:" + "a" * 64)


def test_structs_are_frozen_and_strict():
    p = load(BASE)
    with pytest.raises(AttributeError):
        p.name = "other"  # type: ignore[misc]
    assert Plan.__struct_config__.forbid_unknown_fields
    assert all(c.__struct_config__.forbid_unknown_fields and c.__struct_config__.frozen
               for c in (Plan, Lock, Group, LockedGroup, Mount, wp.Resources, wp.CpuRange, wp.MemoryRange))


def test_the_class_key_maps_to_group_class():
    g = load(BASE).groups[0]
    assert g.group_class == "os"
    assert msgspec.to_builtins(g) == {"name": "os", "ref": "debian:12", "class": "os"}


def test_snapshot_plans_may_have_no_groups():
    p = load('name = "from-snap"\nsnapshot = "snap-1234"\n')
    assert p.groups == [] and p.snapshot == "snap-1234"


def test_groups_of_equal_class_may_repeat():
    text = BASE + '\n[[groups]]\nname = "task2"\nref = "tasks/t2:v1"\nclass = "task"\n'
    assert [g.name for g in load(text).groups][-2:] == ["task", "task2"]


# ---------------------------------------------------------------- located errors


def _with(extra: str, base: str = BASE) -> str:
    """The base plan with TOML inserted right after ``name = …`` (top-level keys)."""
    head, rest = base.split("\n", 1)
    return f"{head}\n{extra}\n{rest}"


def _group(idx: int, line_old: str, line_new: str, base: str = BASE) -> str:
    parts = base.split("[[groups]]")
    parts[idx + 1] = parts[idx + 1].replace(line_old, line_new, 1)
    return "[[groups]]".join(parts)


ERRORS = [
    # refs, names and classes of groups
    (_group(2, 'ref = "tasks/t1:v1"', 'ref = ""'),
     "plan.toml: groups[2].ref: expected a reference like host/repo:tag, got ''"),
    (_group(0, 'ref = "debian:12"', 'ref = "debian"'),
     "plan.toml: groups[0].ref: expected a reference like host/repo:tag, got 'debian'"),
    (_group(0, 'ref = "debian:12"', 'ref = "Team/debian:12"'),
     "plan.toml: groups[0].ref: expected a reference like host/repo:tag, got 'Team/debian:12'"),
    (_group(1, 'ref = "localhost:5000/tc/python:3.11"', "ref = 311"),
     "plan.toml: groups[1].ref: expected a string, got an integer (311)"),
    (_group(0, 'class = "os"', 'class = "oss"'),
     "plan.toml: groups[0].class: expected one of os, toolchain, harness, evaluator, task, got 'oss'"),
    (_group(0, 'class = "os"', ""), "plan.toml: groups[0].class: required field is missing"),
    (_group(0, 'class = "os"', 'clas = "os"'),
     "plan.toml: groups[0].clas: unknown field (expected one of: name, ref, class); did you mean 'class'?"),
    (_group(1, 'name = "python"', 'name = "Python"'),
     "plan.toml: groups[1].name: expected a lowercase name of letters, digits and '-' (1-63 characters, "
     "starting and ending with a letter or digit), got 'Python'"),
    (_group(1, 'name = "python"', 'name = "os"'),
     "plan.toml: groups[1].name: duplicate group name 'os' (also groups[0])"),
    (_group(2, 'class = "task"', 'class = "os"'),
     "plan.toml: groups[2].class: 'os' comes after 'toolchain' (groups[1]); list groups bottom first: "
     "os, toolchain, harness, evaluator, task"),
    ('name = "demo"\ngroups = "debian:12"\n', "plan.toml: groups: expected an array, got a string ('debian:12')"),
    ('name = "demo"\n', "plan.toml: groups: at least one group is needed (or a snapshot to start from)"),
    # top-level fields
    (BASE.replace('name = "demo"', 'name = "Demo"'),
     "plan.toml: name: expected a lowercase name of letters, digits and '-' (1-63 characters, starting and "
     "ending with a letter or digit), got 'Demo'"),
    (BASE.replace('name = "demo"', ""), "plan.toml: name: required field is missing"),
    (_with("ttl = 5"),
     "plan.toml: ttl: unknown field (expected one of: name, groups, env, workdir, user, init, resources, "
     "network, ttl_s, mounts, volumes, snapshot, runtime, image, setuid); did you mean 'ttl_s'?"),
    (_with('env = { "1BAD" = "x" }'),
     "plan.toml: env.1BAD: expected an environment variable name (letters, digits and '_', not starting "
     "with a digit), got '1BAD'"),
    (_with('env = { "A B" = "x" }'),
     'plan.toml: env."A B": expected an environment variable name (letters, digits and \'_\', not starting '
     "with a digit), got 'A B'"),
    (_with('env = { OK = "1", A = 3 }'), "plan.toml: env.A: expected a string, got an integer (3)"),
    (_with('env = { A = "a\\u0000b" }'),
     "plan.toml: env.A: expected a string without NUL characters, got 'a\\x00b'"),
    (_with("env = 3"), "plan.toml: env: expected a table, got an integer (3)"),
    (_with('workdir = "work"'), "plan.toml: workdir: expected an absolute path, got 'work'"),
    (_with('user = "root:"'),
     "plan.toml: user: expected a user name or uid, optionally followed by :group or :gid, got 'root:'"),
    (_with('user = "4294967295"'), "plan.toml: user: id 4294967295 is above 4294967294"),
    (_with("init = []"), "plan.toml: init: expected a non-empty array, got an empty array"),
    (_with('init = ["", "x"]'), "plan.toml: init[0]: the program to run must not be empty"),
    (_with('init = ["/bin/sh", 1]'), "plan.toml: init[1]: expected a string, got an integer (1)"),
    (_with('network = "wifi"'), "plan.toml: network: expected one of none, loopback, egress, host, got 'wifi'"),
    (_with("ttl_s = 0"), "plan.toml: ttl_s: expected a number > 0, got 0"),
    (_with("ttl_s = -1.5"), "plan.toml: ttl_s: expected a number > 0, got -1.5"),
    (_with('ttl_s = "10m"'), "plan.toml: ttl_s: expected a number, got a string ('10m')"),
    (_with('snapshot = "-x"'),
     "plan.toml: snapshot: expected a snapshot id (letters, digits and . _ : -), got '-x'"),
    # resources
    (_with("resources = 1"), "plan.toml: resources: expected a table, got an integer (1)"),
    (_with("resources = { cpu = 1 }"), "plan.toml: resources.cpu: expected a table, got an integer (1)"),
    (_with("resources = { cpu = { min = 0 } }"), "plan.toml: resources.cpu.min: expected a number > 0, got 0"),
    (_with("resources = { cpu = { max = 2000 } }"),
     "plan.toml: resources.cpu.max: expected a number <= 1024, got 2000"),
    (_with('resources = { cpu = { min = "4" } }'),
     "plan.toml: resources.cpu.min: expected a number, got a string ('4')"),
    (_with("resources = { cpu = { min = 4 } }"), "plan.toml: resources.cpu.min: min 4 cores is above max 2 cores"),
    (_with("resources = { cpu = { mni = 4 } }"),
     "plan.toml: resources.cpu.mni: unknown field (expected one of: min, max); did you mean 'min'?"),
    (_with('resources = { memory = { min = "2GiB", max = "1GiB" } }'),
     "plan.toml: resources.memory.min: min 2GiB is above max 1GiB"),
    (_with('resources = { memory = { max = "1XiB" } }'),
     "plan.toml: resources.memory.max: not a size: '1XiB' (use bytes or a string such as '512MiB', '2GiB')"),
    (_with('resources = { memory = { max = "1.5B" } }'),
     "plan.toml: resources.memory.max: not a whole number of bytes: '1.5B'"),
    (_with('resources = { memory = { max = "1MiB" } }'),
     "plan.toml: resources.memory.max: expected a size >= 4MiB, got '1MiB'"),
    (_with("resources = { memory = { max = 2048 } }"),
     "plan.toml: resources.memory.max: expected a size >= 4MiB, got 2048"),
    (_with("resources = { memory = { max = 1.5 } }"),
     "plan.toml: resources.memory.max: expected a size (bytes, or a string such as '512MiB' or '2GiB'), "
     "got a number (1.5)"),
    (_with("resources = { pids = 0 }"), "plan.toml: resources.pids: expected an integer >= 1, got 0"),
    (_with("resources = { pids = true }"), "plan.toml: resources.pids: expected an integer, got a boolean (true)"),
    (_with('resources = { disk = "10KiB" }'), "plan.toml: resources.disk: expected a size >= 1MiB, got '10KiB'"),
    # mounts
    (_with('mounts = [{ source = "/srv", target = "/" }]'),
     "plan.toml: mounts[0].target: '/' is not allowed: a mount on /, /proc, /sys or /dev (or below them) "
     "would replace what the environment needs to run"),
    (_with('mounts = [{ source = "/srv", target = "/proc" }]'),
     "plan.toml: mounts[0].target: '/proc' is not allowed: a mount on /, /proc, /sys or /dev (or below them) "
     "would replace what the environment needs to run"),
    (_with('mounts = [{ source = "/a", target = "/a" }, { source = "/srv", target = "/sys/fs/cgroup" }]'),
     "plan.toml: mounts[1].target: '/sys/fs/cgroup' is not allowed: a mount on /, /proc, /sys or /dev "
     "(or below them) would replace what the environment needs to run"),
    (_with('mounts = [{ source = "srv", target = "/data" }]'),
     "plan.toml: mounts[0].source: expected an absolute path, got 'srv'"),
    (_with('mounts = [{ source = "/srv", target = "/data/../etc" }]'),
     "plan.toml: mounts[0].target: '/data/../etc' is not a normalised path (write '/etc')"),
    (_with('mounts = [{ source = "/a", target = "/data" }, { source = "/b", target = "/data" }]'),
     "plan.toml: mounts[1].target: '/data' is already mounted by mounts[0]"),
    (_with('mounts = [{ source = "/a", target = "/data", rw = true }]'),
     "plan.toml: mounts[0].rw: unknown field (expected one of: source, target)"),
    (_with('mounts = [{ source = "/a" }]'), "plan.toml: mounts[0].target: required field is missing"),
    # absurd values (issue 14.16): every value is bounded, paths are normalised, sources keep off the host
    (_with("resources = { memory = { max = 100000000000000000000 } }"),
     "plan.toml: resources.memory.max: expected a size <= 1TiB, got 100000000000000000000"),
    (_with('resources = { memory = { min = "2TiB", max = "2TiB" } }'),
     "plan.toml: resources.memory.min: expected a size <= 1TiB, got '2TiB'"),
    (_with('resources = { disk = "1000TiB" }'), "plan.toml: resources.disk: expected a size <= 64TiB, got '1000TiB'"),
    (_with("ttl_s = 1e308"), "plan.toml: ttl_s: expected a number <= 2592000, got 1e+308"),
    (_with("ttl_s = inf"), "plan.toml: ttl_s: expected a number <= 2592000, got inf"),
    (_with("ttl_s = nan"), "plan.toml: ttl_s: expected a number > 0, got nan"),
    (_with("resources = { cpu = { max = inf } }"), "plan.toml: resources.cpu.max: expected a number <= 1024, got inf"),
    (_with("resources = { pids = 4194305 }"), "plan.toml: resources.pids: expected an integer <= 4194304, got 4194305"),
    (_with(f'env = {{ A = "{"x" * (8 << 20)}" }}'), "plan.toml: env.A: expected a string of at most 131072 characters"),
    (_with(f'env = {{ AB = "{"x" * 131070}" }}'),
     "plan.toml: env.AB: NAME=value is 131073 bytes, above the kernel's 131071 per variable"),
    (_with("env = { " + ", ".join(f'V{i} = "{"x" * 100_000}"' for i in range(11)) + " }"),
     "plan.toml: env: 1100045 bytes of variables is above 1MiB in all"),
    (_with("env = { " + ", ".join(f'V{i} = "x"' for i in range(4097)) + " }"),
     "plan.toml: env: expected a table of at most 4096 items"),
    (_with("init = [" + ", ".join(f'"{"x" * 100_000}"' for _ in range(6)) + "]"),
     "plan.toml: init: 600006 bytes of arguments is above 512KiB"),
    (_with(f'init = ["/bin/sh", "{"é" * 70_000}"]'),
     "plan.toml: init[1]: 140000 bytes is above the kernel's 131071 per argument"),
    (_with('workdir = "/../../../tmp/x"'), "plan.toml: workdir: '/../../../tmp/x' is not a normalised path (write '/tmp/x')"),
    (_with('workdir = "/work/"'), "plan.toml: workdir: '/work/' is not a normalised path (write '/work')"),
    (_with('workdir = "//work"'), "plan.toml: workdir: '//work' is not a normalised path (write '/work')"),
    (_with('mounts = [{ source = "/", target = "/h" }]'),
     "plan.toml: mounts[0].source: '/' exposes the host: it is the host's root"),
    (_with('mounts = [{ source = "/srv/../", target = "/h" }]'),
     "plan.toml: mounts[0].source: '/srv/../' is not a normalised path (write '/')\n"
     "plan.toml: mounts[0].source: '/srv/../' exposes the host: it is the host's root"),
    (_with('mounts = [{ source = "/proc", target = "/h" }]'),
     "plan.toml: mounts[0].source: '/proc' exposes the host: it is /proc"),
    (_with('mounts = [{ source = "/etc/ssh", target = "/h" }]'),
     "plan.toml: mounts[0].source: '/etc/ssh' exposes the host: it is inside /etc"),
    (_with('mounts = [{ source = "/var", target = "/h" }]'),
     "plan.toml: mounts[0].source: '/var' exposes the host: it contains /var/run"),
    (_with('mounts = [{ source = "/var/run/docker.sock", target = "/h" }]'),
     "plan.toml: mounts[0].source: '/var/run/docker.sock' exposes the host: it is inside /var/run"),
    (_with('mounts = [{ source = "/run/containerd/containerd.sock", target = "/h" }]'),
     "plan.toml: mounts[0].source: '/run/containerd/containerd.sock' exposes the host: it is inside /run"),
    (_with('mounts = [{ source = "/var/lib/docker", target = "/h" }]'),
     "plan.toml: mounts[0].source: '/var/lib/docker' exposes the host: it is /var/lib/docker"),
    (_with('mounts = [{ source = "/root/.ssh", target = "/h" }]'),
     "plan.toml: mounts[0].source: '/root/.ssh' exposes the host: it is inside /root"),
    (_with('mounts = [{ source = "/boot", target = "/h" }]'), "plan.toml: mounts[0].source: '/boot' exposes the host: it is /boot"),
    (_with('mounts = [{ source = "/dev/sda", target = "/h" }]'),
     "plan.toml: mounts[0].source: '/dev/sda' exposes the host: it is inside /dev"),
    (_with("mounts = [" + ", ".join(f'{{ source = "/srv", target = "/m{i}" }}' for i in range(65)) + "]"),
     "plan.toml: mounts: expected an array of at most 64 items"),
    ('name = "demo"\n' + "".join(f'[[groups]]\nname = "g{i}"\nref = "r:1"\nclass = "os"\n' for i in range(129)),
     "plan.toml: groups: expected an array of at most 128 items"),
]


@pytest.mark.parametrize("text,message", ERRORS, ids=[m.split(": ")[1] + f"#{i}" for i, (_, m) in enumerate(ERRORS)])
def test_every_error_names_the_file_and_location(text, message):
    with pytest.raises(PlanValidationError) as info:
        load(text)
    assert str(info.value) == message
    assert info.value.source == "plan.toml"
    assert info.value.location == message.split(": ")[1]


def test_mount_sources_keep_off_weenv_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("WEENV_HOME", str(home))
    for source, why in ((home / "store", f"it is inside $WEENV_HOME {home}"), (home, f"it is $WEENV_HOME {home}"),
                        (tmp_path, f"it contains $WEENV_HOME {home}")):
        with pytest.raises(PlanValidationError) as info:
            load(_with(f'mounts = [{{ source = "{source}", target = "/h" }}]'))
        assert str(info.value) == f"plan.toml: mounts[0].source: '{source}' exposes the host: {why}"
    assert load(_with(f'mounts = [{{ source = "{tmp_path / "data"}", target = "/h" }}]')).mounts[0].target == "/h"
    for fine in ("/srv/data", "/home/me/datasets", "/var/lib/datasets", "/usr/share/dict", "/etcetera", "/proc2"):
        assert wp.exposed_host_path(fine) is None, fine


def test_bounds_are_the_documented_ones():
    doc = (REPO_ROOT / "docs" / "plan.md").read_text()
    for text in ("≤ 1TiB", "≤ 64TiB", "≤ 2592000", "4096 variables", "1 MiB", "512 KiB", "128 groups", "64 mounts"):
        assert text in doc, text
    assert wp.MAX_MEMORY_BYTES == 1024**4 and wp.MAX_DISK_BYTES == 64 * 1024**4 and wp.MAX_TTL_S == 30 * 86400


def test_the_largest_values_still_load():
    text = _with('ttl_s = 2592000\nworkdir = "/w"\nresources = { memory = { min = "1TiB", max = "1TiB" }, '
                 'disk = "64TiB", pids = 4194304, cpu = { min = 1024, max = 1024 } }\n'
                 f'env = {{ AB = "{"x" * 131068}" }}\ninit = ["/bin/sh", "{"y" * 131071}"]')
    p = load(text)
    assert p.resources.memory.max == wp.MAX_MEMORY_BYTES and p.ttl_s == wp.MAX_TTL_S
    assert wp.load_plan(wp.dump_plan(p, "json")) == p


def test_cross_field_problems_are_all_reported():
    text = _group(1, 'name = "python"', 'name = "os"', _with("resources = { cpu = { min = 3 } }"))
    text = text.replace('class = "task"', 'class = "os"')
    with pytest.raises(PlanValidationError) as info:
        load(text)
    assert [p.location for p in info.value.problems] == ["groups[1].name", "groups[2].class", "resources.cpu.min"]
    assert str(info.value).count("plan.toml: ") == 3


def test_json_errors_use_json_words_and_the_same_locations():
    doc = {"name": "demo", "groups": [{"name": "os", "ref": "debian:12", "class": "os"}, {"name": "x"}]}
    with pytest.raises(PlanValidationError, match=r"^plan.json: groups\[1\].ref: required field is missing$"):
        wp.load_plan(json.dumps(doc), source="plan.json")
    with pytest.raises(PlanValidationError, match=r"^plan.json: expected an object of plan fields, got an array$"):
        wp.load_plan("[1, 2]", source="plan.json")
    doc["groups"] = {"a": 1}
    with pytest.raises(PlanValidationError, match=r"^plan.json: groups: expected an array, got an object$"):
        wp.load_plan(json.dumps(doc), source="plan.json")


@pytest.mark.parametrize("text,line,column,fragment", [
    ('name = "demo"\n[[groups]]\nname = \n', 3, 8, "invalid TOML"),
    ('name = "demo"\nname = "again"\n', 2, 15, "invalid TOML"),
    ('name = "demo', 1, 13, "invalid TOML"),
    ('{\n  "name": "demo",\n  "groups": [,]\n}', 3, 14, "invalid JSON"),
    ('{"name": "demo"', 1, 16, "invalid JSON"),
])
def test_syntax_errors_name_line_and_column(text, line, column, fragment):
    with pytest.raises(PlanSyntaxError) as info:
        wp.load_plan(text, source="p")
    e = info.value
    assert (e.line, e.column) == (line, column)
    assert str(e).startswith(f"p:{line}:{column}: {fragment}")


def test_json_duplicate_keys_and_non_numbers_are_syntax_errors():
    with pytest.raises(PlanSyntaxError, match="duplicate key 'name'"):
        wp.load_plan('{"name": "a", "name": "b"}')
    with pytest.raises(PlanSyntaxError, match="NaN is not a number"):
        wp.load_plan('{"name": "a", "ttl_s": NaN}')


def test_non_utf8_is_a_syntax_error_with_position(tmp_path):
    f = tmp_path / "plan.toml"
    f.write_bytes(b'name = "demo"\nuser = "\xff"\n')
    with pytest.raises(PlanSyntaxError) as info:
        wp.load_plan(f)
    assert (info.value.line, info.value.column) == (2, 9)
    assert str(info.value) == f"{f}:2:9: not UTF-8 text"


def test_error_tree():
    for cls in (PlanSyntaxError, PlanValidationError, LockError):
        assert issubclass(cls, PlanError)
    assert issubclass(PlanError, Exception) and not issubclass(PlanError, ValueError)


# ---------------------------------------------------------------- files, formats, round trips


def test_loaders_take_paths_str_paths_and_text(tmp_path):
    f = tmp_path / "plan.toml"
    f.write_text(BASE)
    expected = load(BASE)
    assert wp.load_plan(f) == expected
    assert wp.load_plan(str(f)) == expected
    assert wp.load_plan(BASE.encode()) == expected
    with pytest.raises(FileNotFoundError):
        wp.load_plan(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nx = 1\n')
    with pytest.raises(PlanValidationError) as info:
        wp.load_plan(str(bad))
    assert str(info.value).startswith(f"{bad}: x: unknown field")


@pytest.mark.parametrize("text", [BASE, FULL])
@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_dump_and_load_round_trip(text, fmt):
    p = load(text)
    out = wp.dump_plan(p, fmt)
    assert wp.load_plan(out) == p
    assert wp.load_plan(out, fmt=fmt) == p
    assert wp.dump_plan(wp.load_plan(out), fmt) == out  # stable


def test_toml_output_is_readable():
    out = wp.dump_plan(load(FULL), "toml")
    assert "[[groups]]" in out and 'class = "os"' in out
    assert 'min = "512MiB"' in out and 'disk = "2GiB"' in out  # sizes as text where exact
    assert "max = 1500000000" in out
    assert "null" not in out and "None" not in out
    assert "[env]" in wp.dump_plan(load(FULL)) and "[env]" not in wp.dump_plan(load(BASE))


def test_json_output_spells_every_default():
    data = json.loads(wp.dump_plan(load(BASE), "json"))
    assert data["resources"] == {"cpu": {"min": 0.25, "max": 2.0},
                                 "memory": {"min": 256 * MiB, "max": 2 * GiB}, "pids": 1024, "disk": GiB}
    assert data["network"] == "none" and data["env"] == {} and data["mounts"] == []
    assert "workdir" not in data and "ttl_s" not in data  # absent means unset


def test_write_plan_is_atomic_and_picks_the_format_by_extension(tmp_path):
    p = load(FULL)
    wp.write_plan(p, tmp_path / "out.json")
    wp.write_plan(p, tmp_path / "out.toml")
    assert (tmp_path / "out.json").read_text().startswith("{")
    assert wp.load_plan(tmp_path / "out.json") == wp.load_plan(tmp_path / "out.toml") == p
    assert sorted(os.listdir(tmp_path)) == ["out.json", "out.toml"]  # no temp files left


_alnum = "abcdefghijklmnopqrstuvwxyz0123456789"
_names = st.builds(str.__add__, st.sampled_from(_alnum), st.one_of(
    st.just(""), st.builds(str.__add__, st.text(_alnum + "-", max_size=8), st.sampled_from(_alnum))))
_env_names = st.builds(str.__add__, st.sampled_from("ABCXYZ_abz"), st.text("AZaz09_", max_size=12))
_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=30)
_segment = st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,10}", fullmatch=True)
_abs_paths = st.lists(_segment, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts))
_hex64 = st.text("0123456789abcdef", min_size=64, max_size=64).map(lambda h: "sha256:" + h)
_refs = st.builds(
    lambda host, repo, tag, dig: (f"{host}/" if host else "") + repo + (f":{tag}" if tag else "") + (f"@{dig}" if dig else ""),
    st.sampled_from([None, "localhost:5000", "registry.example.com", "127.0.0.1:5000", "[::1]:5000"]),
    st.from_regex(r"[a-z0-9]+(?:[._-][a-z0-9]+)?(?:/[a-z0-9]+)?", fullmatch=True),
    st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)),
    st.one_of(st.none(), _hex64),
).filter(lambda r: ":" in r.rsplit("/", 1)[-1] or "@" in r)
_pos_float = st.floats(min_value=0.001, max_value=1024, allow_nan=False, allow_infinity=False)


@st.composite
def plans(draw, locked: bool = False):
    classes = sorted(draw(st.lists(st.sampled_from(GROUP_CLASSES), min_size=1, max_size=5)),
                     key=GROUP_CLASSES.index)
    names = draw(st.lists(_names, min_size=len(classes), max_size=len(classes), unique=True))
    groups = []
    for name, cls in zip(names, classes):
        ref = draw(_refs)
        if locked:
            pinned = re.search(r"@(sha256:[0-9a-f]{64})$", ref)
            groups.append(LockedGroup(
                name=name, ref=ref, group_class=cls, digest=pinned[1] if pinned else draw(_hex64),
                layer_digest=draw(_hex64), layer_size=draw(st.integers(0, 2**40)), toc_digest=draw(_hex64),
                registry=draw(st.sampled_from([None, "localhost:5000", "r.example.com"])), repo="team/x"))
        else:
            groups.append(Group(name=name, ref=ref, group_class=cls))
    cpu = sorted([draw(_pos_float), draw(_pos_float)])
    mem = sorted([draw(st.integers(4 * MiB, wp.MAX_MEMORY_BYTES)), draw(st.integers(4 * MiB, wp.MAX_MEMORY_BYTES))])
    targets = draw(st.lists(_abs_paths.filter(lambda p: not p.startswith(("/proc", "/sys", "/dev"))),
                            max_size=3, unique=True))
    fields = dict(
        name=draw(_names),
        groups=groups,
        env=draw(st.dictionaries(_env_names, _text, max_size=4)),
        workdir=draw(st.one_of(st.none(), _abs_paths)),
        user=draw(st.one_of(st.none(), st.sampled_from(["root", "1000", "1000:1000", "app:staff", "nobody:65534"]))),
        init=draw(st.one_of(st.none(), st.lists(_text, min_size=1, max_size=3).filter(lambda a: a[0] != ""))),
        resources=wp.Resources(cpu=wp.CpuRange(min=cpu[0], max=cpu[1]),
                               memory=wp.MemoryRange(min=mem[0], max=mem[1]),
                               pids=draw(st.integers(1, 4_194_304)),
                               disk=draw(st.integers(1 * MiB, wp.MAX_DISK_BYTES))),
        network=draw(st.sampled_from(["none", "loopback"])),
        ttl_s=draw(st.one_of(st.none(), st.floats(min_value=1e-3, max_value=wp.MAX_TTL_S, allow_nan=False))),
        mounts=[Mount(source=draw(_abs_paths.filter(lambda p: wp.exposed_host_path(p) is None)), target=t)
                for t in targets],
        snapshot=draw(st.one_of(st.none(), st.from_regex(r"[a-z0-9][a-z0-9._:-]{0,20}", fullmatch=True))),
    )
    if locked:
        return Lock(lock_version=1, **fields)
    return Plan(**fields)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(), st.sampled_from(["toml", "json"]))
def test_random_valid_plans_round_trip(p, fmt):
    out = wp.dump_plan(p, fmt)
    back = wp.load_plan(out)
    assert back == p
    assert wp.load_any(out) == p


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(locked=True), st.sampled_from(["toml", "json"]))
def test_random_valid_locks_round_trip(lock, fmt):
    out = wp.dump_plan(lock, fmt)
    back = wp.load_any(out)
    assert isinstance(back, Lock) and back == lock
    assert wp.load_lock(out) == lock


# ---------------------------------------------------------------- locks


class FakeStore:
    """A resolver over a dict of tag refs → content; records what was asked."""

    def __init__(self):
        self.content: dict[str, str] = {}
        self.asked: list[str] = []

    def publish(self, ref: str, content: str) -> str:
        self.content[ref] = content
        return digest_of("manifest:" + content)

    def resolved(self, content: str, registry: str | None, repo: str) -> ResolvedGroup:
        return ResolvedGroup(manifest_digest=digest_of("manifest:" + content), layer_digest=digest_of("layer:" + content),
                             layer_size=len(content) * 1000, toc_digest=digest_of("toc:" + content),
                             registry=registry, repo=repo)

    def __call__(self, ref: str) -> ResolvedGroup:
        self.asked.append(ref)
        r = wp.parse_ref(ref)
        if r.digest:
            for tag_ref, content in self.content.items():
                if digest_of("manifest:" + content) == r.digest and wp.parse_ref(tag_ref).repo == r.repo:
                    return self.resolved(content, r.registry, r.repo)
            raise KeyError(f"no manifest {r.digest}")
        key = str(wp.Reference(r.registry, r.repo, r.tag, None))
        if key not in self.content:
            raise KeyError(f"no such tag {key}")
        return self.resolved(self.content[key], r.registry, r.repo)


@pytest.fixture
def store():
    s = FakeStore()
    s.publish("debian:12", "debian-12")
    s.publish("localhost:5000/tc/python:3.11", "python")
    s.publish("tasks/t1:v1", "task-1")
    return s


def test_lock_pins_every_group(store):
    p = load(BASE)
    lock = wp.lock_plan(p, store)
    assert isinstance(lock, Lock) and wp.is_locked(lock) and lock.lock_version == wp.LOCK_VERSION
    assert store.asked == [g.ref for g in p.groups]
    g = lock.groups[1]
    assert (g.name, g.ref, g.group_class) == ("python", "localhost:5000/tc/python:3.11", "toolchain")
    assert g.digest == digest_of("manifest:python") and g.toc_digest == digest_of("toc:python")
    assert g.layer_digest == digest_of("layer:python") and g.layer_size == 6000
    assert (g.registry, g.repo) == ("localhost:5000", "tc/python")
    assert lock.groups[0].registry is None and lock.groups[0].pinned_ref == "debian@" + digest_of("manifest:debian-12")
    assert g.pinned_ref == "localhost:5000/tc/python@" + g.digest
    # everything but the groups is the plan's
    assert wp.plan_to_builtins(lock)["resources"] == wp.plan_to_builtins(p)["resources"]


def test_lock_files_round_trip_and_are_recognised_by_content(store, tmp_path):
    lock = wp.lock_plan(load(FULL.replace("tasks/t1@sha256:" + "a" * 64, "tasks/t1:v1")), store)
    text = wp.dump_plan(lock, "toml")
    assert text.startswith("# weenv plan lock") and "\nlock_version = 1\n" in text
    for name, fmt in (("odd-name.toml", "toml"), ("plan.lock", "json"), ("lock.json", "json")):
        (tmp_path / name).write_text(wp.dump_plan(lock, fmt))
        assert wp.load_any(tmp_path / name) == lock
        assert wp.load_lock(tmp_path / name) == lock
        with pytest.raises(PlanValidationError, match=r": lock_version: this is a lock, not a plan"):
            wp.load_plan(tmp_path / name)
    with pytest.raises(PlanValidationError, match=r"^<plan>: lock_version: required field is missing: this is a plan"):
        wp.load_lock(BASE)


def test_a_ref_pinned_to_a_digest_must_resolve_to_it(store):
    good = store.publish("tasks/t1:v2", "task-1-v2")
    text = BASE.replace('ref = "tasks/t1:v1"', f'ref = "tasks/t1:v2@{good}"')
    assert wp.lock_plan(load(text), store).groups[2].digest == good

    class Liar(FakeStore):
        def __call__(self, ref):  # a store that answers the tag, ignoring the pin
            return store(ref.split("@")[0])

    bad = "sha256:" + "b" * 64
    text = BASE.replace('ref = "tasks/t1:v1"', f'ref = "tasks/t1:v1@{bad}"')
    with pytest.raises(LockError) as info:
        wp.lock_plan(load(text), Liar())
    assert info.value.group == "task"
    assert str(info.value) == (f"groups[2] (task): 'tasks/t1:v1@{bad}' pins {bad} but the store serves "
                               f"{digest_of('manifest:task-1')}")


def test_an_unresolvable_ref_is_a_lock_error_naming_the_group(store):
    text = BASE.replace("tasks/t1:v1", "tasks/t1:v9")
    with pytest.raises(LockError, match=r"^groups\[2\] \(task\): cannot resolve 'tasks/t1:v9': 'no such tag tasks/t1:v9'$"):
        wp.lock_plan(load(text), store)


@pytest.mark.parametrize("field,value,fragment", [
    ("manifest_digest", "sha256:xyz", "manifest_digest of 'debian:12' is not a sha256 digest"),
    ("toc_digest", "", "toc_digest of 'debian:12' is not a sha256 digest"),
    ("layer_size", -1, "layer_size of 'debian:12' is not a byte count"),
    ("layer_size", True, "layer_size of 'debian:12' is not a byte count"),
])
def test_a_malformed_resolver_answer_is_a_lock_error(store, field, value, fragment):
    def bad(ref):
        return msgspec.structs.replace(store(ref), **{field: value})

    with pytest.raises(LockError, match=re.escape("groups[0] (os): " + fragment)):
        wp.lock_plan(load(BASE), bad)


def test_a_resolver_answer_lacking_fields_is_a_lock_error():
    with pytest.raises(LockError, match=r"groups\[0\] \(os\): the resolver's answer for 'debian:12' lacks"):
        wp.lock_plan(load(BASE), lambda ref: object())


def test_locking_a_lock_refreshes_it_from_the_refs(store):
    lock = wp.lock_plan(load(BASE), store)
    store.publish("tasks/t1:v1", "task-1-rebuilt")
    again = wp.lock_plan(lock, store)
    assert again.groups[2].digest == digest_of("manifest:task-1-rebuilt")
    assert again.groups[:2] == lock.groups[:2]


def test_a_hand_edited_lock_contradicting_its_pin_is_refused(store):
    pin = store.publish("tasks/t1:v2", "x")
    lock = wp.lock_plan(load(BASE.replace('ref = "tasks/t1:v1"', f'ref = "tasks/t1@{pin}"')), store)
    text = wp.dump_plan(lock, "toml").replace(f'digest = "{pin}"', f'digest = "sha256:{"c" * 64}"')
    with pytest.raises(PlanValidationError, match=r"groups\[2\]\.digest: sha256:c+ differs from the digest pinned in ref"):
        wp.load_lock(text)


def test_unsupported_lock_versions_are_refused(store):
    text = wp.dump_plan(wp.lock_plan(load(BASE), store), "toml").replace("lock_version = 1", "lock_version = 2")
    with pytest.raises(PlanValidationError, match=r"lock_version: unsupported lock version 2; this weenv reads version 1"):
        wp.load_any(text)


@pytest.mark.parametrize("field,what", [
    ("manifest_digest", "digest"), ("layer_digest", "layer_digest"),
    ("layer_size", "layer_size"), ("toc_digest", "toc_digest")])
def test_verify_lock_group_names_the_group_and_the_field(store, field, what):
    lock = wp.lock_plan(load(BASE), store)
    g = lock.groups[1]
    served = store(g.ref)
    wp.verify_lock_group(g, served)  # what was locked matches
    changed = msgspec.structs.replace(served, **{field: 1 if field == "layer_size" else digest_of("other")})
    with pytest.raises(LockError) as info:
        wp.verify_lock_group(g, changed)
    assert info.value.group == "python"
    assert str(info.value).startswith(f"group 'python' ({g.pinned_ref}): {what} mismatch: the lock pins ")


def _manifest(g: LockedGroup, *, toc: str | None = None, size: int | None = None) -> bytes:
    from weenv.layerfmt import TOC_DIGEST_ANNOTATION

    return json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": g.layer_digest,
                    "size": g.layer_size if size is None else size,
                    "annotations": {TOC_DIGEST_ANNOTATION: toc or g.toc_digest}}],
    }).encode()


def test_verify_manifest_checks_bytes_layer_and_toc():
    base = LockedGroup(name="os", ref="debian:12", group_class="os", digest="sha256:" + "0" * 64,
                       layer_digest=digest_of("l"), layer_size=123, toc_digest=digest_of("t"), repo="debian")
    good = _manifest(base)
    g = msgspec.structs.replace(base, digest="sha256:" + hashlib.sha256(good).hexdigest())
    wp.verify_manifest(g, good)
    with pytest.raises(LockError, match=f"digest mismatch: the lock pins {g.digest}, the manifest fetched for it "
                                        "hashes to sha256:"):
        wp.verify_manifest(g, good + b" ")
    for bad, fragment in ((_manifest(g, toc=digest_of("x")),
                           f"toc_digest mismatch: the lock pins {g.toc_digest}, the manifest says {digest_of('x')}"),
                          (_manifest(g, size=124), "layer_size mismatch: the lock pins 123, the manifest says 124"),
                          (_manifest(msgspec.structs.replace(g, layer_digest=digest_of("m"))),
                           f"layer_digest mismatch: the lock pins {g.layer_digest}, the manifest names {digest_of('m')}"),
                          (b"[]", "not an OCI manifest"), (b"\xff", "not JSON")):
        pinned = msgspec.structs.replace(g, digest="sha256:" + hashlib.sha256(bad).hexdigest())
        with pytest.raises(LockError, match=fragment):
            wp.verify_manifest(pinned, bad)


# ---------------------------------------------------------------- overrides and image defaults


def test_overrides_replace_values_and_keep_the_rest():
    p = load(FULL)
    q = wp.apply_overrides(p, name="other", ttl_s=30, cpu="0.5", memory="1GiB", env={"A": "1", "WEIRD": "x"},
                           workdir="/tmp", user="root")
    assert (q.name, q.ttl_s, q.workdir, q.user) == ("other", 30.0, "/tmp", "root")
    assert (q.resources.cpu.min, q.resources.cpu.max) == (0.5, 0.5)
    assert (q.resources.memory.min, q.resources.memory.max) == (GiB, GiB)
    assert q.env == {"PYTHONUNBUFFERED": "1", "WEIRD": "x", "A": "1"}
    assert q.groups == p.groups and q.mounts == p.mounts and q.resources.pids == 512
    assert p.name == "swe-task"  # the original is untouched
    assert wp.apply_overrides(p) == p


@pytest.mark.parametrize("cpu,expected", [
    ("0.25-2", (0.25, 2.0)), (0.5, (0.5, 0.5)), (3, (3.0, 3.0)), ((1, 2), (1.0, 2.0)), (" 1 - 4 ", (1.0, 4.0))])
def test_cpu_overrides(cpu, expected):
    r = wp.apply_overrides(load(BASE), cpu=cpu).resources.cpu
    assert (r.min, r.max) == expected


@pytest.mark.parametrize("memory,expected", [
    ("512MiB-2GiB", (512 * MiB, 2 * GiB)), (GiB, (GiB, GiB)), ("1.5G", (1_500_000_000,) * 2),
    (("256MiB", 1 << 30), (256 * MiB, GiB))])
def test_memory_overrides(memory, expected):
    r = wp.apply_overrides(load(BASE), memory=memory).resources.memory
    assert (r.min, r.max) == expected


@pytest.mark.parametrize("kwargs,message", [
    ({"cpu": "abc"}, "overrides: cpu: not a number of cores: 'abc' (use cores such as 0.5, or a range such as 0.25-2)"),
    ({"cpu": "0"}, "overrides: cpu: a number of cores must be above 0, got '0' (use cores such as 0.5, or a range such as 0.25-2)"),
    ({"cpu": "4-1"}, "overrides: resources.cpu.min: min 4 cores is above max 1 cores"),
    ({"memory": "lots"}, "overrides: memory: not a size: 'lots' (use bytes or a string such as '512MiB', '2GiB') "
                         "(use a size such as 1GiB, or a range such as 512MiB-2GiB)"),
    ({"memory": "2GiB-1GiB"}, "overrides: resources.memory.min: min 2GiB is above max 1GiB"),
    ({"memory": "1MiB"}, "overrides: resources.memory.min: expected a size >= 4MiB, got 1048576"),
    ({"ttl_s": -1}, "overrides: ttl_s: expected a number > 0, got -1"),
    ({"name": "Bad Name"}, "overrides: name: expected a lowercase name of letters, digits and '-' (1-63 characters, "
                           "starting and ending with a letter or digit), got 'Bad Name'"),
    ({"env": {"1X": "y"}}, "overrides: env.1X: expected an environment variable name (letters, digits and '_', not "
                           "starting with a digit), got '1X'"),
    ({"workdir": "rel"}, "overrides: workdir: expected an absolute path, got 'rel'"),
])
def test_bad_overrides_name_what_is_wrong(kwargs, message):
    with pytest.raises(PlanValidationError) as info:
        wp.apply_overrides(load(BASE), **kwargs)
    assert str(info.value) == message


def test_overrides_keep_a_lock_a_lock(store):
    lock = wp.lock_plan(load(BASE), store)
    q = wp.apply_overrides(lock, ttl_s=5, cpu="1")
    assert isinstance(q, Lock) and q.groups == lock.groups and q.ttl_s == 5


IMAGE_CONFIG = {
    "architecture": "amd64", "os": "linux",
    "config": {"Env": ["PATH=/usr/local/bin:/usr/bin", "LANG=C.UTF-8", "EMPTY=", "EQ=a=b"],
               "WorkingDir": "/app", "User": "1000:1000",
               "Entrypoint": ["/entry.sh"], "Cmd": ["python3", "-m", "http.server"]},
    "rootfs": {"type": "layers", "diff_ids": []},
}


def test_image_config_becomes_plan_defaults():
    d = wp.plan_defaults_from_image(IMAGE_CONFIG)
    assert d == {"env": {"PATH": "/usr/local/bin:/usr/bin", "LANG": "C.UTF-8", "EMPTY": "", "EQ": "a=b"},
                 "workdir": "/app", "user": "1000:1000",
                 "image": {"entrypoint": ["/entry.sh"], "cmd": ["python3", "-m", "http.server"]}}
    full = wp.plan_defaults_from_image({"config": {"ExposedPorts": {"8080/tcp": {}, "53/udp": {}}, "Labels": {"a": "b"},
                                                   "StopSignal": "SIGINT"}}, source="reg.example/img:1")
    assert full == {"image": {"source": "reg.example/img:1", "ports": ["53/udp", "8080/tcp"], "labels": {"a": "b"},
                              "stop_signal": "SIGINT"}}
    with pytest.raises(PlanValidationError, match=r"image\.ports\[0\]"):
        wp.plan_defaults_from_image({"config": {"ExposedPorts": {"80/quic": {}}}})
    assert wp.plan_defaults_from_image(IMAGE_CONFIG["config"]) == d  # the inner object works too
    with_init = wp.plan_defaults_from_image(IMAGE_CONFIG, command_as_init=True)
    assert with_init["init"] == ["/entry.sh", "python3", "-m", "http.server"]
    assert wp.plan_defaults_from_image({"config": {"WorkingDir": "srv/app", "User": ""}}) == {"workdir": "/srv/app"}
    for odd in ("//app/", "/app/./", "/../app", "app/x/.."):  # images' own spellings become plan paths
        assert wp.plan_defaults_from_image({"WorkingDir": odd})["workdir"] == "/app", odd
    assert wp.plan_defaults_from_image({}) == {}


def test_bad_image_configs_are_located():
    with pytest.raises(PlanValidationError, match=r"^image config: Env\[1\]: expected NAME=VALUE, got 'JUNK'$"):
        wp.plan_defaults_from_image({"config": {"Env": ["A=1", "JUNK"]}})
    with pytest.raises(PlanValidationError, match=r"^image config: env\.1A: expected an environment variable name"):
        wp.plan_defaults_from_image({"config": {"Env": ["1A=1"]}})
    with pytest.raises(PlanValidationError, match=r"^image config: user: expected a user name or uid"):
        wp.plan_defaults_from_image({"config": {"User": "a b"}})


def test_plan_values_win_over_image_defaults():
    d = wp.plan_defaults_from_image(IMAGE_CONFIG, command_as_init=True)
    p = wp.apply_image_defaults(load(FULL), d)
    assert p.workdir == "/work" and p.user == "1000:1000" and p.init == ["/bin/sleep", "infinity"]
    assert p.env["PYTHONUNBUFFERED"] == "1" and p.env["LANG"] == "C.UTF-8"
    q = wp.apply_image_defaults(load(_with('env = { LANG = "en_US.UTF-8" }')), d)
    assert q.workdir == "/app" and q.user == "1000:1000" and q.init == d["init"]
    assert q.env["LANG"] == "en_US.UTF-8" and q.env["PATH"] == "/usr/local/bin:/usr/bin"


# ---------------------------------------------------------------- units and refs


@pytest.mark.parametrize("text,expected", [
    (0, 0), (4096, 4096), ("4096", 4096), ("512MiB", 512 * MiB), ("2GiB", 2 * GiB), ("1.5G", 1_500_000_000),
    ("1.5GiB", 1536 * MiB), ("1k", 1000), ("1Ki", 1024), ("2 gb", 2_000_000_000), ("10B", 10), (" 3TiB ", 3 * 1024**4),
    ("0.5KiB", 512)])
def test_parse_size(text, expected):
    assert wp.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", -1, "1.5B", "0.1KiB", "1XB", "GiB", "1e3", "1,5G", True, None, 1.5, "١٢"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        wp.parse_size(text)


@given(st.one_of(st.from_regex(SIZE_PATTERN), st.text(max_size=12)))
def test_schema_size_pattern_agrees_with_the_parser(text):
    pattern_ok = re.search(SIZE_PATTERN, text) is not None
    try:
        wp.parse_size(text)
        parsed = True
    except ValueError as e:
        parsed = "whole number of bytes" in str(e)  # the pattern cannot see fractions of a byte
    assert parsed == pattern_ok


@pytest.mark.parametrize("size,text", [(2 * GiB, "2GiB"), (1536 * MiB, "1536MiB"), (1000, 1000), (0, 0), (1024, "1KiB")])
def test_format_size(size, text):
    assert wp.format_size(size) == text


@pytest.mark.parametrize("ref,parts", [
    ("harness:v3", (None, "harness", "v3", None)),
    ("team/harness:v3", (None, "team/harness", "v3", None)),
    ("localhost:5000/a/b:t", ("localhost:5000", "a/b", "t", None)),
    ("localhost/a:t", ("localhost", "a", "t", None)),
    ("[::1]:5000/os:1", ("[::1]:5000", "os", "1", None)),
    ("reg.io/x@sha256:" + "a" * 64, ("reg.io", "x", None, "sha256:" + "a" * 64)),
    ("reg.io:443/x:1@sha256:" + "a" * 64, ("reg.io:443", "x", "1", "sha256:" + "a" * 64)),
])
def test_parse_ref(ref, parts):
    r = wp.parse_ref(ref)
    assert (r.registry, r.repo, r.tag, r.digest) == parts
    assert str(r) == ref
    assert re.search(REF_PATTERN, ref)


@pytest.mark.parametrize("ref", ["", "x", "x:", "X:1", "a//b:1", "a:b:c", "reg.io/x@sha256:abc", "a b:1",
                                 "Team/x:1", "x@md5:" + "a" * 32])
def test_parse_ref_rejects(ref):
    with pytest.raises(ValueError, match="expected a reference like host/repo:tag"):
        wp.parse_ref(ref)


def test_plan_refs_agree_with_the_registry_parser():
    """What a plan accepts, weenv.registry parses to the same parts."""
    from weenv.registry import parse_ref as registry_parse_ref

    for ref in ["harness:v3", "team/harness:v3", "localhost:5000/a/b:t", "[::1]:5000/os:1",
                "reg.io:443/x:1@sha256:" + "a" * 64, "a-b/c__d.e:1"]:
        ours, theirs = wp.parse_ref(ref), registry_parse_ref(ref)
        assert (ours.registry, ours.repo, ours.tag, ours.digest) == (theirs.registry, theirs.repo, theirs.tag, theirs.digest)


# ---------------------------------------------------------------- schema and public API


def test_committed_schema_is_current():
    assert SCHEMA_FILE.exists(), "docs/plan.schema.json is missing: run `weenv plan schema -o docs/plan.schema.json`"
    assert SCHEMA_FILE.read_text() == wp.dump_json_schema(), (
        "docs/plan.schema.json is stale: run `weenv plan schema -o docs/plan.schema.json`")


def test_schema_describes_files_not_python():
    schema = wp.plan_json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    defs = schema["$defs"]
    assert defs["Plan"]["additionalProperties"] is False and defs["Plan"]["required"] == ["name"]
    assert set(defs["Group"]["properties"]) == {"name", "ref", "class"}
    assert defs["Group"]["properties"]["class"]["enum"] == sorted(GROUP_CLASSES)
    mem_max = defs["MemoryRange"]["properties"]["max"]
    assert mem_max["anyOf"] == [{"type": "integer", "minimum": 4 * MiB, "maximum": wp.MAX_MEMORY_BYTES},
                                {"type": "string", "pattern": SIZE_PATTERN}]
    assert "anyOf" in defs["Resources"]["properties"]["disk"]
    lock = wp.plan_json_schema(lock=True)
    assert "lock_version" in lock["$defs"]["Lock"]["required"]
    assert {"digest", "toc_digest", "layer_digest", "layer_size", "repo"} <= set(lock["$defs"]["LockedGroup"]["required"])


def test_public_api_is_pinned():
    assert set(wp.__all__) == {
        "CpuRange", "DEFAULT_CPU_MAX_CORES", "DEFAULT_CPU_MIN_CORES", "DEFAULT_DISK_BYTES",
        "DEFAULT_MEMORY_MAX_BYTES", "DEFAULT_MEMORY_MIN_BYTES", "DEFAULT_NETWORK", "DEFAULT_PIDS",
        "GROUP_CLASSES", "Group", "ImageMeta", "LOCK_VERSION", "Lock", "LockError", "LockedGroup", "MemoryRange",
        "Mount", "HOST_PATHS", "MAX_ARG_STRLEN", "MAX_CORES", "MAX_DISK_BYTES", "MAX_ENV_BYTES", "MAX_ENV_VARS", "MAX_GROUPS",
        "MAX_INIT_ARGS", "MAX_INIT_BYTES", "MAX_LAYER_BYTES", "MAX_MEMORY_BYTES", "MAX_MOUNTS", "MAX_PIDS",
        "MAX_TTL_S", "exposed_host_path", "load_text",
        "Plan", "PlanError", "PlanSyntaxError", "PlanValidationError", "Problem", "Reference", "ResolvedGroup",
        "ResolvedGroupLike", "Resolver", "Resources", "apply_image_defaults", "apply_overrides", "dump_json_schema",
        "dump_plan", "format_for_path", "format_size", "is_locked", "load_any", "load_lock", "load_plan",
        "lock_plan", "parse_cpu_range", "parse_document", "parse_memory_range", "parse_ref", "parse_size",
        "plan_defaults_from_image", "plan_from_builtins", "plan_json_schema", "plan_to_builtins",
        "verify_lock_group", "verify_manifest", "write_plan", "MAX_VOLUMES", "VolumeMount",
    }


def test_plan_does_no_registry_or_runtime_imports():
    import subprocess
    import sys

    code = ("import sys, weenv.plan; bad = [m for m in sys.modules if m.startswith(('weenv.registry', "
            "'weenv.provision', 'weenv.envlet', 'httpx', 'trio', 'oras'))]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- CLI


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture
def plan_file(tmp_path):
    f = tmp_path / "plan.toml"
    f.write_text(FULL.replace("tasks/t1@sha256:" + "a" * 64, "tasks/t1:v1"))
    return f


@pytest.fixture
def fake_resolver(monkeypatch, store):
    store.publish("tasks/t1:v1", "task-1")
    monkeypatch.setattr("weenv.cli._plan._resolver", lambda: store)
    return store


def test_cli_check_prints_a_summary(runner, plan_file):
    r = runner.invoke(cli_main, ["plan", "check", str(plan_file)])
    assert r.exit_code == 0, r.output
    assert f"{plan_file}: ok (plan 'swe-task', 2 groups)" in r.output
    assert "cpu 0.5-4 cores" in r.output and "memory 512MiB-1.4 GiB" in r.output and "ttl 600s" in r.output
    assert "mount /srv/data → /data (read-only)" in r.output


def test_cli_check_reports_located_errors_and_exits_1(runner, tmp_path):
    f = tmp_path / "plan.toml"
    f.write_text(_group(2, 'ref = "tasks/t1:v1"', 'ref = ""'))
    r = runner.invoke(cli_main, ["plan", "check", str(f)])
    assert r.exit_code == 1
    assert f"{f}: groups[2].ref: expected a reference like host/repo:tag, got ''" in r.output
    r = runner.invoke(cli_main, ["plan", "check", "--json", str(f)])
    assert r.exit_code == 1
    assert json.loads(r.output) == {"ok": False, "source": str(f), "problems": [
        {"location": "groups[2].ref", "message": "expected a reference like host/repo:tag, got ''"}]}
    f.write_text("name = [\n")
    r = runner.invoke(cli_main, ["plan", "check", "--json", str(f)])
    assert r.exit_code == 1 and json.loads(r.output)["problems"][0]["line"] == 2
    r = runner.invoke(cli_main, ["plan", "check", str(tmp_path / "missing.toml")])
    assert r.exit_code == 1 and "No such file or directory" in r.output


def test_cli_lock_writes_toml_or_json_by_extension(runner, plan_file, fake_resolver, tmp_path):
    r = runner.invoke(cli_main, ["plan", "lock", str(plan_file)])
    assert r.exit_code == 0, r.output
    default = tmp_path / "plan.lock"
    lock = wp.load_lock(default)
    assert default.read_text().startswith("# weenv plan lock")
    assert [g.digest for g in lock.groups] == [digest_of("manifest:debian-12"), digest_of("manifest:task-1")]

    out = tmp_path / "plan.lock.json"
    r = runner.invoke(cli_main, ["plan", "lock", str(plan_file), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["lock_version"] == 1 and wp.load_any(out) == lock
    summary = json.loads(r.output)
    assert summary["path"] == str(out) and summary["groups"][1]["toc_digest"] == digest_of("toc:task-1")
    assert sorted(os.listdir(tmp_path)) == ["plan.lock", "plan.lock.json", "plan.toml"]  # no temp files

    r = runner.invoke(cli_main, ["plan", "lock", str(default), "-o", "-"])  # re-lock a lock, to stdout
    assert r.exit_code == 0 and wp.load_lock(r.output) == lock


def test_cli_lock_errors_name_the_file_and_group(runner, plan_file, fake_resolver, tmp_path):
    plan_file.write_text(plan_file.read_text().replace("tasks/t1:v1", "tasks/t1:v404"))
    r = runner.invoke(cli_main, ["plan", "lock", str(plan_file)])
    assert r.exit_code == 1
    assert f"{plan_file}: groups[1] (task-1): cannot resolve 'tasks/t1:v404'" in r.output
    assert not (tmp_path / "plan.lock").exists()


def test_cli_lock_without_a_registry_says_so(runner, plan_file, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_registry(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "registry" and level == 2 or name.startswith("weenv.registry"):
            raise ImportError("no registry in this build")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_registry)
    r = runner.invoke(cli_main, ["plan", "lock", str(plan_file)])
    assert r.exit_code == 1
    assert "weenv.registry.resolve_group is not available" in r.output


def test_cli_show_spells_out_defaults(runner, tmp_path):
    f = tmp_path / "plan.toml"
    f.write_text(BASE)
    r = runner.invoke(cli_main, ["plan", "show", str(f), "--json"])
    assert r.exit_code == 0
    assert json.loads(r.output)["resources"]["pids"] == 1024
    r = runner.invoke(cli_main, ["plan", "show", str(f)])
    assert r.exit_code == 0 and wp.load_plan(r.output) == wp.load_plan(f)
    assert 'max = "2GiB"' in r.output


def test_cli_schema_prints_the_committed_schema(runner, tmp_path):
    r = runner.invoke(cli_main, ["plan", "schema"])
    assert r.exit_code == 0 and r.output == wp.dump_json_schema()
    out = tmp_path / "s.json"
    r = runner.invoke(cli_main, ["plan", "schema", "--lock", "-o", str(out)])
    assert r.exit_code == 0 and json.loads(out.read_text())["title"] == "weenv lock"


# ---------------------------------------------------------------- integration: the real registry


@pytest.mark.integration
def test_lock_against_a_real_registry_and_the_local_store(registry, tmp_path, monkeypatch, runner):
    """Publish real groups to docker-registry and to the embedded store; lock through the real
    resolver; check the lock against the real manifests; a moved tag is caught."""
    from weenv.registry import open_store, publish, resolve_group

    monkeypatch.setenv("WEENV_HOME", str(tmp_path / "home"))
    trees = {}
    for name in ("os", "task", "task2"):
        d = tmp_path / name
        (d / "etc").mkdir(parents=True)
        (d / "etc" / f"{name}.txt").write_text(f"{name}\n" * 100)
        trees[name] = d
    os_ref = f"{registry.host}/plantest/os:v1"
    pub_os = publish(str(trees["os"]), os_ref, group="os", group_class="os", use_cache=False)
    pub_task = publish(str(trees["task"]), "plantest/task:v1", group="task", group_class="task", use_cache=False)

    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(f'name = "real"\n[[groups]]\nname = "os"\nref = "{os_ref}"\nclass = "os"\n'
                         '[[groups]]\nname = "task"\nref = "plantest/task:v1"\nclass = "task"\n')
    r = runner.invoke(cli_main, ["plan", "lock", str(plan_file), "-o", str(tmp_path / "plan.lock")])
    assert r.exit_code == 0, r.output
    lock = wp.load_lock(tmp_path / "plan.lock")
    g_os, g_task = lock.groups
    assert (g_os.digest, g_os.layer_digest, g_os.layer_size, g_os.toc_digest) == (
        pub_os.digest, pub_os.layer_digest, pub_os.size, pub_os.toc_digest)
    assert (g_os.registry, g_os.repo) == (registry.host, "plantest/os")
    assert (g_task.registry, g_task.repo, g_task.digest) == (None, "plantest/task", pub_task.digest)

    for g in lock.groups:  # what a provisioner does: fetch by digest, never by tag, and verify
        store = open_store(g.registry)
        try:
            manifest, _ = store.get_manifest(g.repo, g.digest)
        finally:
            store.close()
        wp.verify_manifest(g, manifest)
        wp.verify_lock_group(g, resolve_group(g.pinned_ref))

    publish(str(trees["task2"]), "plantest/task:v1", group="task", group_class="task", use_cache=False)
    moved = resolve_group("plantest/task:v1")
    with pytest.raises(LockError, match=r"group 'task' .*: digest mismatch: the lock pins "):
        wp.verify_lock_group(g_task, moved)
    wp.verify_lock_group(g_task, resolve_group(g_task.pinned_ref))  # the pinned digest still resolves

    stale = plan_file.read_text().replace('ref = "plantest/task:v1"', f'ref = "plantest/task:v1@{pub_task.digest}"')
    with pytest.raises(LockError, match=r"groups\[1\] \(task\): 'plantest/task:v1@sha256:[0-9a-f]+' pins "):
        wp.lock_plan(wp.load_plan(stale), lambda ref: resolve_group(ref.split("@")[0]))


def test_the_documented_example_is_valid_and_its_toml_and_json_agree():
    doc = (REPO_ROOT / "docs" / "plan.md").read_text()
    toml_text = re.findall(r"```toml\n(.*?)```", doc, re.S)[0]
    json_text = re.findall(r"```json\n(.*?)```", doc, re.S)[0]
    p = wp.load_plan(toml_text, source="docs/plan.md")
    assert wp.load_plan(json_text, source="docs/plan.md") == p
    assert len(p.groups) == 3 and p.mounts and p.init and p.ttl_s


def test_every_msgspec_message_kind_is_translated():
    """No msgspec wording (backquoted types, '$.' paths, regexes) reaches the user."""
    for text, _ in ERRORS:
        with pytest.raises(PlanValidationError) as info:
            load(text)
        for p in info.value.problems:
            assert "`" not in p.message and "$." not in p.message and "^" not in p.message, p
    long_ref = _group(0, 'ref = "debian:12"', f'ref = "{"a" * 600}:1"')
    with pytest.raises(PlanValidationError, match=r"groups\[0\]\.ref: expected a string of at most 512 characters$"):
        load(long_ref)


def test_image_defaults_from_what_weenv_pull_keeps():
    from weenv.registry import ImageConfig

    kept = ImageConfig.from_oci(IMAGE_CONFIG["config"])
    assert wp.plan_defaults_from_image(kept) == wp.plan_defaults_from_image(IMAGE_CONFIG)
    assert wp.plan_defaults_from_image(ImageConfig.from_oci(None)) == {}
