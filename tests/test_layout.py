"""The provision package's layout, pinned (docs/architecture.md, "Package map"): what changes together
lives together, dependencies point one way, and the daemon only wires its parts together."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROVISION = ROOT / "weenv" / "provision"
PARTS = ("cgroups", "elastic", "envs", "runtime", "server")


def test_provision_is_a_daemon_and_its_parts() -> None:
    top = sorted(p.name for p in PROVISION.iterdir() if p.name != "__pycache__")
    assert top == ["__init__.py", "_daemon.py", "_errors.py", *PARTS], top
    for part in PARTS:
        assert (PROVISION / part / "__init__.py").is_file(), part
    assert (PROVISION / "runtime" / "agent" / "weenv-agent.c").is_file()


def _imports(path: pathlib.Path, package: str) -> set[str]:
    """The absolute names of the modules ``path`` (in ``package``) imports, relative ones resolved."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
                out |= {module} | {f"{module}.{a.name}" for a in node.names}
            else:
                out.add(node.module or "")
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_parts_never_import_the_daemon_or_its_server() -> None:
    """runtime, envs, elastic and cgroups are driven by the daemon, never the other way round; the
    API servers (weenv.api, weenv.cluster) reach a daemon only as clients, never through its code."""
    wrong = []
    for part in ("cgroups", "elastic", "envs", "runtime"):
        for path in (PROVISION / part).rglob("*.py"):
            names = _imports(path, f"weenv.provision.{part}")
            wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in sorted(names)
                      if n.startswith(("weenv.provision._daemon", "weenv.provision.server"))]
    for package in ("api", "cluster"):
        for path in (ROOT / "weenv" / package).rglob("*.py"):
            names = _imports(path, f"weenv.{package}")
            wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in sorted(names)
                      if n.startswith(("weenv.provision._daemon", "weenv.provision.server", "weenv.provision.envs",
                                       "weenv.provision.runtime"))]
    assert not wrong


def test_the_daemon_builds_the_env_manager_in_one_step() -> None:
    """No attribute of the manager is assigned from outside it: every part goes to its constructor."""
    tree = ast.parse((PROVISION / "_daemon.py").read_text())
    assigned = [f"line {node.lineno}: {ast.unparse(target)}" for node in ast.walk(tree)
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(target, ast.Attribute) and "manager" in ast.unparse(target.value)]
    assert not assigned


def test_the_routes_are_not_in_the_daemon() -> None:
    """The daemon's API is a server module of its own (the E2B API sits beside it, weenv.api)."""
    import types

    from weenv.provision import Daemon
    from weenv.provision.server import DaemonApi, Response

    assert not hasattr(Daemon, "_routes")
    api = DaemonApi(manager=types.SimpleNamespace(envs_dir="/nonexistent"), monitor=None,
                    request_stop=lambda **kw: None, started_s=0.0)
    for method, path in (("GET", "/v1/ping"), ("POST", "/v1/envs"), ("POST", "/v1/envs/e-1/exec"),
                         ("GET", "/v1/envs/e-1/processes/7/stream"), ("GET", "/v1/metrics")):
        assert not isinstance(api.router.match(method, path), Response), (method, path)


ENVS = PROVISION / "envs"
# the env manager's package: the facade and the parts it builds (issue 15, "a provision package you can read")
ENVS_MODULES = ("__init__.py", "_archive.py", "_commit.py", "_fileops.py", "_files.py", "_gc.py", "_manager.py", "_memchunks.py", "_memimages.py", "_memory.py", "_mounts.py", "_parking.py", "_pool.py",
                "_ports.py", "_processes.py", "_published.py", "_setup.py", "_snapshots.py", "_startcheck.py", "_state.py", "_trees.py", "_ttl.py",
                "_volumes.py", "_xattrs.py")
ENVS_MAX_LINES = 560  # 550 until park-after (envs/_parking.py) added its three calls


def test_the_env_manager_is_a_facade_over_small_modules() -> None:
    """Each module of envs/ says what it owns and stays readable on its own; the manager's parts
    never import the manager (it builds them, not the other way round)."""
    found = sorted(p.name for p in ENVS.glob("*.py"))
    assert found == sorted(ENVS_MODULES), found
    long, undocumented, upward = [], [], []
    for name in ENVS_MODULES:
        path = ENVS / name
        lines = len(path.read_text().splitlines())
        if lines > ENVS_MAX_LINES:
            long.append(f"{name}: {lines} lines")
        if not ast.get_docstring(ast.parse(path.read_text())):
            undocumented.append(name)
        if name not in ("__init__.py", "_manager.py") and "weenv.provision.envs._manager" in _imports(
                path, "weenv.provision.envs"):
            upward.append(name)
    assert not long, f"over {ENVS_MAX_LINES} lines: {long}"
    assert not undocumented
    assert not upward


def _late_attributes(path: pathlib.Path) -> list[str]:
    """``self.x = ...`` outside ``__init__`` for an ``x`` that ``__init__`` does not assign."""
    late = []
    for cls in ast.walk(ast.parse(path.read_text())):
        if not isinstance(cls, ast.ClassDef):
            continue
        made: set[str] = set()
        later: list[tuple[int, str]] = []
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                           if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        if fn.name == "__init__":
                            made.add(t.attr)
                        else:
                            later.append((node.lineno, t.attr))
        late += [f"{path.name}:{line} {cls.name}.{attr}" for line, attr in later if attr not in made]
    return late


def test_the_env_manager_and_its_parts_are_whole_once_built() -> None:
    """Every attribute of the manager and of each of its parts is made in ``__init__``: none appears
    later (the egress network to wire inline did, found with getattr)."""
    late = [x for name in ENVS_MODULES for x in _late_attributes(ENVS / name)]
    assert not late


# -- the outer ring (issue 27): imports run one way, the client is the only user of its privates -------

RING = {"weenv._wire": 0, "weenv._wire_volumes": 0, "weenv._routes": 0, "weenv._connection": 1, "weenv._calls": 2, "weenv._client": 3,
        "weenv._aclient": 3, "weenv.api": 4, "weenv.cluster": 5}
"""``_wire``/``_routes`` ← connection ← calls ← clients ← api ← cluster: a module may import its own
layer and those below, never one above."""
CORE = ("weenv.layerfmt", "weenv.registry", "weenv.envlet", "weenv.plan", "weenv.net", "weenv.provision")
"""The node's own parts: they are driven by the daemon and never reach for a client, the API or the cluster."""


def _layer(module: str) -> int | None:
    for name, rank in RING.items():
        if module == name or module.startswith(name + "."):
            return rank
    return None


def _modules() -> list[tuple[pathlib.Path, str]]:
    out = []
    for path in (ROOT / "weenv").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        package = ".".join(parts[:-1]) if parts[-1] != "__init__" else ".".join(parts[:-1])
        out.append((path, package))
    return out


def test_the_outer_ring_imports_one_way() -> None:
    wrong = []
    for path, package in _modules():
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mine = _layer(mod)
        for name in sorted(_imports(path, package)):
            theirs = _layer(name)
            if theirs is None:
                continue
            if mine is not None and theirs > mine:
                wrong.append(f"{path.relative_to(ROOT)} (layer {mine}) imports {name} (layer {theirs})")
            if mine is None and mod.startswith(CORE) and theirs >= RING["weenv._connection"]:
                wrong.append(f"{path.relative_to(ROOT)} (the node's own parts) imports {name}")
    assert not wrong, "\n".join(wrong)


def test_no_module_outside_the_client_touches_its_privates() -> None:
    """The clients' connection is public (``client.connection``); their private helpers are theirs."""
    clients = {"_client.py", "_aclient.py", "_connection.py", "_calls.py"}
    call = re.compile(r"\b(c|client|self\.client|env\.client|view\.client|\w+_client)\.(_request|_http|_ensure|_stream|"
                      r"_started|_run)\b")
    wrong = []
    for path in [*(ROOT / "weenv").rglob("*.py"), *(ROOT / "slime_plugin").rglob("*.py"),
                 *(ROOT / "benchmarks").rglob("*.py")]:
        if path.parent == ROOT / "weenv" and path.name in clients:
            continue
        text = path.read_text()
        for i, line in enumerate(text.splitlines(), 1):
            if call.search(line):
                wrong.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


MAX_MODULE_LINES = 600


def test_no_module_of_the_outer_ring_is_over_600_lines() -> None:
    long = []
    for package in ("api", "cluster", "build", "cli"):
        for path in (ROOT / "weenv" / package).rglob("*.py"):
            n = len(path.read_text().splitlines())
            if n > MAX_MODULE_LINES:
                long.append(f"{path.relative_to(ROOT)}: {n} lines")
    for name in ("_client.py", "_aclient.py", "_connection.py", "_calls.py", "_wire.py", "_wire_volumes.py", "_routes.py"):
        n = len((ROOT / "weenv" / name).read_text().splitlines())
        if n > MAX_MODULE_LINES:
            long.append(f"weenv/{name}: {n} lines")
    for path in [*(ROOT / "weenv" / "provision" / "runtime").glob("*.py"),
                 *(ROOT / "weenv" / "provision" / "elastic").glob("*.py")]:
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, "\n".join(long)


# -- the runtime seam (issue 27 item 3): a small containers interface, one process host, gVisor beside crun --

RUNTIME = PROVISION / "runtime"
RUNTIME_MODULES = ("__init__.py", "_agent.py", "_checkpoint.py", "_criu.py", "_gvisor.py", "_hostcheck.py", "_idmap.py", "_ns.py",
                   "_oci.py", "_ocispec.py", "_processes.py", "_router.py", "_runsc.py", "_runtime.py", "_seam.py",
                   "_seccomp.py", "_spawn.py")
PROCESS_CALLS = {"exec", "start_process", "connect_process", "list_processes", "send_stdin", "signal_process",
                 "resize_process", "wait_process"}


def test_the_runtime_package_is_small_modules_that_say_what_they_own() -> None:
    found = sorted(p.name for p in RUNTIME.glob("*.py"))
    assert found == sorted(RUNTIME_MODULES), found
    assert not [name for name in RUNTIME_MODULES if not ast.get_docstring(ast.parse((RUNTIME / name).read_text()))]


def test_the_runtime_seam_is_small_and_gvisor_is_not_built_on_crun() -> None:
    """A runtime implements six container calls; the env's processes are one ProcessHost's (crun,
    gVisor and the router hand theirs out: none runs a command itself, none overrides another's
    private); the router forwards the containers interface only; nothing of the seam raises by default."""
    from weenv.provision.runtime import CrunRuntime, GvisorRuntime, Runtime, RuntimeRouter
    from weenv.provision.runtime._processes import ProcessHost
    from weenv.provision.runtime._seam import Containers

    assert Containers.__abstractmethods__ == {"create", "start", "kill", "delete", "state", "list"}
    assert not issubclass(GvisorRuntime, CrunRuntime) and not issubclass(CrunRuntime, GvisorRuntime)
    assert PROCESS_CALLS <= set(vars(ProcessHost)) and PROCESS_CALLS <= set(vars(Runtime))
    for cls in (CrunRuntime, GvisorRuntime, RuntimeRouter):
        assert not PROCESS_CALLS & set(vars(cls)), cls
    assert {n for n in vars(RuntimeRouter) if not n.startswith("_")} == {
        "create", "start", "kill", "delete", "state", "list", "capability", "get"}
    overrides = [f"{p.name}:{i}" for p in RUNTIME.glob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
                 if "type: ignore[override]" in line]
    assert not overrides
    seam = ast.parse((RUNTIME / "_seam.py").read_text())
    raising = [fn.name for fn in ast.walk(seam) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
               and any(isinstance(node, ast.Raise) for node in ast.walk(fn))]
    assert not raising
