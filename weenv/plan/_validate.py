"""Plan rules: msgspec's decode errors in the plan's own words, and the cross-field rules.

msgspec reports one error like ``Expected `str` matching regex '^…$' - at `$.groups[2].ref```;
:func:`translate_error` turns it into ``Problem("groups[2].ref", "expected a reference like
host/repo:tag, got ''")`` using the raw document and the type. :func:`check_plan` then checks what
one field's type cannot say (min <= max, class order, duplicates, mount targets) and returns every
problem it finds.
"""

from __future__ import annotations

import difflib
import posixpath
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

from ._errors import Problem
from ._model import (GROUP_CLASSES, GVISOR_MEMORY_HEADROOM_BYTES, MAX_ARG_STRLEN, MAX_ENV_BYTES, MAX_INIT_BYTES, NETWORKS,
                     PATTERN_DESCRIPTIONS, LockedGroup, NetworkPolicy, Plan, group_class_rank)
from ._ref import parse_ref
from ._units import human_size
from ._walk import (Segment, child_type, convert_ok, dict_item_types, format_location, is_size,
                    struct_of, type_info, unwrap)

_MSG = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<at>[^`]*)`(?: in `(?P<in>[^`]*)`)?)?$", re.DOTALL)
_PATH_TOKEN = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_TYPE_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
               "array": "an array", "null": "null", "object": "a table"}
_FORBIDDEN_MOUNT_TARGETS = ("/proc", "/sys", "/dev")
HOST_PATHS: tuple[str, ...] = (
    "/proc", "/sys", "/dev", "/boot", "/etc", "/root", "/run", "/var/run",
    # container runtimes' state and sockets (docker.sock and containerd.sock live under /run)
    "/var/lib/docker", "/var/lib/containerd", "/var/lib/containers", "/var/lib/kubelet", "/var/lib/lxc",
    "/var/lib/weenv",  # weenv's default home; the current $WEENV_HOME is added at check time
)
"""Host paths a mount source may not be, lie inside, or contain (besides ``/`` itself and
``$WEENV_HOME``): bound read-only into an env they still hand it the host's secrets, devices,
runtime sockets or the state of other envs."""
_MAX_ID = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_words(spec: str, fmt: str, size: bool = False) -> str:
    if size:
        return "a size (bytes, or a string such as '512MiB' or '2GiB')"
    words = []
    for part in spec.split(" | "):
        if part == "null":
            continue  # absence already means "not set"; TOML has no null
        word = _TYPE_WORDS.get(part, f"`{part}`")
        if part == "object" and fmt == "json":
            word = "an object"
        words.append(word)
    return " or ".join(words) or "null"


def _parse_path(text: str) -> list[str | int | None]:
    """``$.groups[2].ref`` → ``["groups", 2, "ref"]``; ``[...]`` (an unnamed dict entry) → None."""
    out: list[str | int | None] = []
    for m in _PATH_TOKEN.finditer(text.removeprefix("$")):
        if m.group(1) is not None:
            out.append(m.group(1))
        elif m.group(2) == "...":
            out.append(None)
        else:
            out.append(int(m.group(2)))
    return out


@dataclass
class _Found:
    segments: list[Segment]
    value: Any = None
    type: mi.Type | None = None
    found: bool = True
    dict_items: tuple[Any, Any] | None = None  # (key, value) annotations when the value is a dict field


def _resolve(raw: Any, root: mi.Type, tokens: list[str | int | None]) -> _Found:
    """Follow ``tokens`` through the raw document; name unnamed dict entries by re-checking each."""
    at = _Found(segments=[], value=raw, type=root)
    for tok in tokens:
        if tok is None:
            items = at.dict_items
            key = None
            if isinstance(at.value, dict) and items is not None:
                key = next((k for k, v in at.value.items() if not convert_ok(v, items[1])), None)
            if key is None:
                at.found = False
                return at
            tok = key
        st = struct_of(at.type)
        at.dict_items = None
        if st is not None and isinstance(tok, str):
            fname = next((f.name for f in st.fields if f.encode_name == tok), None)
            at.dict_items = dict_item_types(st.cls, fname) if fname else None
        at.segments.append(tok)
        at.type = child_type(at.type, tok) if at.type is not None else None
        try:
            at.value = at.value[tok]
        except (KeyError, IndexError, TypeError):
            at.value, at.found = None, False
    return at


def translate_error(err: msgspec.ValidationError, raw: Any, root_cls: type, fmt: str,
                    original: Any = None) -> Problem:
    """One msgspec validation error as a located :class:`Problem` in the plan's own words.

    ``original`` is the document before sizes were turned into integers, so that messages show
    what the user wrote ("1MiB") rather than what was checked.
    """
    m = _MSG.match(str(err))
    assert m is not None  # the pattern accepts any text
    msg = m["msg"]
    root = type_info(root_cls)
    if m["in"] is not None:  # "- at `key` in `$.env`": a dict key broke its rule
        at = _resolve(raw, root, _parse_path(m["in"]))
        bad = None
        if isinstance(at.value, dict) and at.dict_items is not None:
            bad = next((k for k in at.value if not convert_ok(k, at.dict_items[0])), None)
        if bad is None:
            return Problem(format_location(at.segments), "invalid key: " + _rewrite(msg, None, None, fmt, True))
        return Problem(format_location([*at.segments, bad]), _rewrite(msg, bad, None, fmt, is_key=True))

    at = _resolve(raw, root, _parse_path(m["at"] or "$"))
    segments, t = at.segments, at.type
    shown = at.value
    if original is not None and at.found:
        shown = _resolve(original, root, list(segments)).value

    if (mm := re.match(r"Object missing required field `(.+)`$", msg, re.DOTALL)):
        return Problem(format_location([*segments, mm[1]]), "required field is missing")
    if (mm := re.match(r"Object contains unknown field `(.+)`$", msg, re.DOTALL)):
        st = struct_of(t)
        names = [f.encode_name for f in st.fields] if st else []
        text = "unknown field"
        if names:
            text += f" (expected one of: {', '.join(names)})"
            close = difflib.get_close_matches(mm[1], names, n=1)
            if close:
                text += f"; did you mean {close[0]!r}?"
        return Problem(format_location([*segments, mm[1]]), text)
    if (mm := re.match(r"Invalid enum value (.+)$", msg, re.DOTALL)):
        base = unwrap(t)[0] if t is not None else None
        if isinstance(base, mi.UnionType):  # network = "…" | [network]: the string choices
            base = next((unwrap(m)[0] for m in base.types if isinstance(unwrap(m)[0], mi.LiteralType)), None)
        values = [str(v) for v in base.values] if isinstance(base, mi.LiteralType) else []
        for ordered in (GROUP_CLASSES, NETWORKS):  # msgspec sorts choices; say them in their own order
            if set(ordered) == set(values):
                values = list(ordered)
        return Problem(format_location(segments), f"expected one of {', '.join(values)}, got {mm[1]}")
    return Problem(format_location(segments), _rewrite(msg, shown, t, fmt))


def _pattern_of(t: mi.Type | None) -> str | None:
    """The regex of a string type (or of the string member of an optional string)."""
    if t is None:
        return None
    base, _ = unwrap(t)
    if isinstance(base, mi.UnionType):
        base = next((unwrap(m)[0] for m in base.types if isinstance(unwrap(m)[0], mi.StrType)), None)
    return base.pattern if isinstance(base, mi.StrType) else None


def _rewrite(msg: str, value: Any, t: mi.Type | None, fmt: str, is_key: bool = False) -> str:
    size = is_size(t)
    if (mm := re.match(r"Expected `(\w+)` matching regex '(.*)'$", msg, re.DOTALL)):
        # msgspec prints the pattern escaped; the type (or, for keys, the unescaped text) has it as written.
        pattern = _pattern_of(t) or mm[2].replace("\\\\", "\\")
        desc = PATTERN_DESCRIPTIONS.get(pattern, f"a string matching {pattern}")
        return f"expected {desc}, got {_show(value)}"
    if (mm := re.match(r"Expected `([^`]+)` of length (>=|<=) (\d+)$", msg)):
        what = _type_words(mm[1], fmt)
        if mm[2] == ">=" and mm[3] == "1":
            got = "''" if mm[1] == "str" else ("an empty array" if mm[1] == "array" else _show(value))
            return f"expected a non-empty {what.split(' ', 1)[1]}, got {got}"
        unit = "characters" if mm[1] == "str" else "items"
        bound = "at least" if mm[2] == ">=" else "at most"
        return f"expected {what} of {bound} {mm[3]} {unit}"
    if (mm := re.match(r"Expected `([^`]+)` (>=|>|<=|<) (\S+)$", msg)):
        bound = mm[3]
        if size:
            bound = human_size(int(float(bound)))
            return f"expected a size {mm[2]} {bound}, got {_show(value)}"
        bound = bound.removesuffix(".0")
        return f"expected {_type_words(mm[1], fmt)} {mm[2]} {bound}, got {_show(value)}"
    if (mm := re.match(r"Expected `([^`]+)`, got `([^`]+)`$", msg)):
        got = _type_words(mm[2], fmt)
        if not isinstance(value, (dict, list)) and value is not None and not is_key:
            got += f" ({_show(value)})"
        return f"expected {_type_words(mm[1], fmt, size)}, got {got}"
    return msg[:1].lower() + msg[1:]


def normalised_path(path: str) -> str:
    """``path`` without ``.``, ``..``, repeated or trailing ``/`` (``//x`` too: POSIX keeps it)."""
    return "/" + posixpath.normpath(path).lstrip("/")


def exposed_host_path(source: str, *, home: str | None = None) -> str | None:
    """Why a bind-mount ``source`` (absolute, normalised) would expose the host, or ``None``.

    Refused: ``/``; any of :data:`HOST_PATHS` or ``home`` (default ``$WEENV_HOME``); a path inside
    one of them; a path that contains one of them (``/var`` holds ``/var/run``). The provisioner
    calls this again on the resolved path, since a plan cannot see symlinks.
    """
    from .. import _home

    if source == "/":
        return "it is the host's root"
    weenv_home = normalised_path(home if home is not None else _home.home())
    for protected in (*HOST_PATHS, weenv_home):
        what = "$WEENV_HOME " + protected if protected == weenv_home else protected
        if source == protected:
            return f"it is {what}"
        if source.startswith(protected + "/"):
            return f"it is inside {what}"
        if protected.startswith(source + "/"):
            return f"it contains {what}"
    return None


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_plan(plan: Plan) -> list[Problem]:
    """Every rule that relates several fields, or needs more than a pattern, as problems."""
    problems: list[Problem] = []
    add = problems.append

    if not plan.groups and plan.snapshot is None:
        add(Problem("groups", "at least one group is needed (or a snapshot to start from)"))
    seen: dict[str, int] = {}
    highest: tuple[int, int] | None = None  # (rank, index) of the highest class so far
    for i, g in enumerate(plan.groups):
        if g.name in seen:
            add(Problem(f"groups[{i}].name", f"duplicate group name {g.name!r} (also groups[{seen[g.name]}])"))
        else:
            seen[g.name] = i
        try:
            parse_ref(g.ref)
        except ValueError as e:
            add(Problem(f"groups[{i}].ref", str(e)))
        rank = group_class_rank(g.group_class)
        if highest is not None and rank < highest[0]:
            above = plan.groups[highest[1]]
            add(Problem(f"groups[{i}].class", (
                f"{g.group_class!r} comes after {above.group_class!r} (groups[{highest[1]}]); "
                f"list groups bottom first: {', '.join(GROUP_CLASSES)}"
            )))
        if highest is None or rank >= highest[0]:
            highest = (rank, i)
        if isinstance(g, LockedGroup):
            try:
                pinned = parse_ref(g.ref).digest
            except ValueError:
                pinned = None
            if pinned is not None and pinned != g.digest:
                add(Problem(f"groups[{i}].digest", f"{g.digest} differs from the digest pinned in ref {g.ref!r}"))

    cpu, mem = plan.resources.cpu, plan.resources.memory
    if cpu.min > cpu.max:
        add(Problem("resources.cpu.min", f"min {cpu.min:g} cores is above max {cpu.max:g} cores"))
    if mem.min > mem.max:
        add(Problem("resources.memory.min", f"min {human_size(mem.min)} is above max {human_size(mem.max)}"))
    if plan.runtime == "gvisor":
        gvisor_disk = gvisor_disk_problem(plan)
        if gvisor_disk is not None:
            add(gvisor_disk)

    if plan.user is not None:
        for part in plan.user.split(":"):
            if part.isdigit() and int(part) > _MAX_ID:
                add(Problem("user", f"id {part} is above {_MAX_ID}"))
    if plan.init is not None and plan.init and not plan.init[0]:
        add(Problem("init[0]", "the program to run must not be empty"))
    if plan.init is not None:
        init_bytes = 0
        for i, arg in enumerate(plan.init):
            n = _utf8_len(arg) + 1
            init_bytes += n
            if n > MAX_ARG_STRLEN:
                add(Problem(f"init[{i}]", f"{n - 1} bytes is above the kernel's {MAX_ARG_STRLEN - 1} per argument"))
        if init_bytes > MAX_INIT_BYTES:
            add(Problem("init", f"{init_bytes} bytes of arguments is above {human_size(MAX_INIT_BYTES)}"))
    env_bytes = 0
    for key, value in plan.env.items():
        n = _utf8_len(key) + 1 + _utf8_len(value) + 1  # NAME=value and its NUL, as the kernel counts
        env_bytes += n
        if n > MAX_ARG_STRLEN:
            add(Problem(format_location(["env", key]), (
                f"NAME=value is {n - 1} bytes, above the kernel's {MAX_ARG_STRLEN - 1} per variable"
            )))
    if env_bytes > MAX_ENV_BYTES:
        add(Problem("env", f"{env_bytes} bytes of variables is above {human_size(MAX_ENV_BYTES)} in all"))
    if plan.workdir is not None and normalised_path(plan.workdir) != plan.workdir:
        add(Problem("workdir", (
            f"{plan.workdir!r} is not a normalised path (write {normalised_path(plan.workdir)!r})"
        )))

    targets: dict[str, int] = {}
    for i, mount in enumerate(plan.mounts):
        for field in ("source", "target"):
            path = getattr(mount, field)
            if normalised_path(path) != path:
                add(Problem(f"mounts[{i}].{field}", (
                    f"{path!r} is not a normalised path (write {normalised_path(path)!r})"
                )))
        exposed = exposed_host_path(normalised_path(mount.source))
        if exposed is not None:
            add(Problem(f"mounts[{i}].source", f"{mount.source!r} exposes the host: {exposed}"))
        target = mount.target
        if target == "/" or any(target == p or target.startswith(p + "/") for p in _FORBIDDEN_MOUNT_TARGETS):
            add(Problem(f"mounts[{i}].target", (
                f"{target!r} is not allowed: a mount on /, /proc, /sys or /dev (or below them) "
                "would replace what the environment needs to run"
            )))
        if target in targets:
            add(Problem(f"mounts[{i}].target", f"{target!r} is already mounted by mounts[{targets[target]}]"))
        else:
            targets[target] = i
    taken = {t: f"mounts[{i}]" for t, i in targets.items()}
    names: dict[str, int] = {}
    for i, vol in enumerate(plan.volumes):
        where = f"volumes[{i}]"
        if normalised_path(vol.path) != vol.path:
            add(Problem(f"{where}.path", f"{vol.path!r} is not a normalised path (write {normalised_path(vol.path)!r})"))
        if vol.path == "/" or any(vol.path == p or vol.path.startswith(p + "/") for p in _FORBIDDEN_MOUNT_TARGETS):
            add(Problem(f"{where}.path", (
                f"{vol.path!r} is not allowed: a mount on /, /proc, /sys or /dev (or below them) "
                "would replace what the environment needs to run"
            )))
        if vol.path in taken:
            add(Problem(f"{where}.path", f"{vol.path!r} is already mounted by {taken[vol.path]}"))
        else:
            taken[vol.path] = where
        if vol.name in names:
            add(Problem(f"{where}.name", f"volume {vol.name!r} is mounted already by volumes[{names[vol.name]}]"))
        else:
            names[vol.name] = i
    problems += _network_problems(plan)
    mode = plan.network if isinstance(plan.network, str) else plan.network.mode
    if plan.runtime == "gvisor" and mode not in ("none", "loopback"):
        add(Problem("runtime", (
            f'"gvisor" cannot have network = {mode!r}: a gVisor env has its own network stack with '
            'loopback only (use network = "none" or "loopback", or runtime = "crun")'
        )))
    return problems


def gvisor_disk_problem(plan: Plan, runtime: str = 'runtime = "gvisor"') -> Problem | None:
    """``resources.disk`` that a gVisor sandbox at the plan's memory max cannot hold (gVisor keeps
    the files an env writes in the sandbox's memory); None when it fits. The daemon asks it too,
    for plans that name no runtime on a node whose default is gVisor."""
    disk, mem_max = plan.resources.disk, plan.resources.memory.max
    if disk + GVISOR_MEMORY_HEADROOM_BYTES <= mem_max:
        return None
    return Problem("resources.disk", (
        f"{human_size(disk)} does not fit {runtime} with memory max {human_size(mem_max)}: "
        "gVisor holds the files an env writes in the sandbox's memory, and a sandbox out of memory "
        f"dies whole; keep disk at most memory max - {human_size(GVISOR_MEMORY_HEADROOM_BYTES)} "
        f"(here {human_size(max(mem_max - GVISOR_MEMORY_HEADROOM_BYTES, 0))}) or raise memory max"
    ))


def _network_problems(plan: Plan) -> list[Problem]:
    """The ``[network]`` table: entries in the allow/deny grammar, egress-only fields only with egress."""
    from ..net._policy import parse_entry

    net = plan.network
    if not isinstance(net, NetworkPolicy):
        return []
    problems = []
    for name in ("allow", "deny"):
        for i, text in enumerate(getattr(net, name)):
            try:
                parse_entry(text)
            except ValueError as e:
                problems.append(Problem(f"network.{name}[{i}]", str(e)))
    if net.mode != "egress":
        for name in ("allow", "deny", "bandwidth", "dns"):
            if getattr(net, name) not in (None, []):
                problems.append(Problem(f"network.{name}", (
                    f"only for mode = \"egress\" (mode is {net.mode!r}: the env has no route out to filter)")))
    if net.bandwidth is not None:
        from ..net._policy import parse_bandwidth

        try:
            parse_bandwidth(net.bandwidth)
        except ValueError as e:
            problems.append(Problem("network.bandwidth", str(e)))
    return problems


def shape_problem(raw: Any, fmt: str) -> Problem | None:
    """A problem if the document is not a table at all (before msgspec sees it)."""
    if isinstance(raw, dict):
        return None
    got = "an array" if isinstance(raw, list) else _show(raw)
    return Problem("", f"expected {'a table' if fmt == 'toml' else 'an object'} of plan fields, got {got}")
