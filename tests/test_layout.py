"""The provision package's layout, pinned (docs/architecture.md, "Package map"): what changes together
lives together, dependencies point one way, and the daemon only wires its parts together."""

from __future__ import annotations

import ast
import pathlib

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
ENVS_MODULES = ("__init__.py", "_commit.py", "_files.py", "_gc.py", "_manager.py", "_mounts.py", "_pool.py",
                "_ports.py", "_setup.py", "_snapshots.py", "_startcheck.py", "_state.py", "_trees.py", "_ttl.py")
ENVS_MAX_LINES = 550


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
