"""The public surface of weenv, pinned: each package's exact ``__all__``, written out, not built from
``dir()``; every name importable; fakes only in :mod:`weenv.testing`; benchmarks independent of tests/.

Changing a package's surface means changing the list here, on purpose. (``weenv.layerfmt`` importing
nothing from registry/envlet/httpx/pyfuse3/trio is pinned in tests/test_layerfmt.py.)
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import weenv

ROOT = pathlib.Path(__file__).resolve().parent.parent

PUBLIC_API: dict[str, list[str]] = {
    "weenv": [
        "__version__", "ApiError", "AsyncClient", "AsyncEnv", "Client", "DaemonUnavailableError", "Env",
        "EnvNotFoundError", "ExecResult", "WeenvError",
    ],
    "weenv.layerfmt": [
        "BuildResult", "BytesReader", "Chunk", "Columns", "DEFAULT_CHUNK_SIZE", "DEFAULT_LIMITS",
        "DEFAULT_TAIL_READ", "Entry", "EntryNotFoundError", "FOOTER_SIZE", "FORMAT_VERSION", "FileReader",
        "Footer", "IntegrityError", "Layer", "LayerError", "LayerFormatError", "LayerInputError",
        "LimitExceededError", "Limits", "MEDIA_TYPE", "OPAQUE_NAME", "RandomAccessReader", "SourceEntry", "TOC",
        "TOC_DIGEST_ANNOTATION", "TYPE_NAMES", "TruncatedLayerError", "UnsafePathError", "WHITEOUT_PREFIX",
        "build_entries", "build_layer", "decode_chunk", "decompress_chunk", "normalize_lookup", "read_tail",
        "scan_directory", "scan_tar", "verify_chunk",
    ],
    "weenv.registry": [
        "ArtifactError", "AuthError", "BlobRangeError", "BlobReader", "ConvertedImage", "ConvertedLayer",
        "Descriptor", "ExportResult",
        "GROUP_ARTIFACT_TYPE", "GROUP_CLASSES", "GroupInfo", "ImageConfig", "IntegrityError", "LayoutStore",
        "NotFoundError", "ProtocolError", "PublishResult", "PullResult", "PulledGroup", "Ref", "RefError",
        "RegistryError", "RegistryUnavailableError", "RemoteStore", "RetryPolicy", "Store", "StoreError",
        "convert_image", "export_oci", "image_config", "image_lock", "is_image_ref", "local_store_path", "lock_for_image",
        "mapped_errors", "open_layer_ref", "open_store", "parse_groups_spec", "parse_ref", "publish", "publish_layer_file", "pull", "resolve_group",
    ],
    "weenv.envlet": [
        "ChunkIntegrityError", "ChunkTier", "ControlError", "DiskCache", "EnvletClient", "EnvletError",
        "EnvletProcess", "EnvletUnavailableError", "FetchError", "Fetcher", "LayerInfo", "LayerNotFoundError",
        "LayerSource", "LayerTree", "MemoryCache", "Metrics", "StoreSpec", "TierConfig", "TierConfigError",
        "clear_stale_mount", "load_tiers", "serve",
    ],
    "weenv.plan": [
        "CpuRange", "DEFAULT_CPU_MAX_CORES", "DEFAULT_CPU_MIN_CORES", "DEFAULT_DISK_BYTES",
        "DEFAULT_MEMORY_MAX_BYTES", "DEFAULT_MEMORY_MIN_BYTES", "DEFAULT_NETWORK", "DEFAULT_PIDS",
        "GROUP_CLASSES", "Group", "HOST_PATHS", "ImageMeta", "LOCK_VERSION", "Lock", "LockError", "LockedGroup",
        "MAX_ARG_STRLEN", "MAX_CORES", "MAX_DISK_BYTES", "MAX_ENV_BYTES", "MAX_ENV_VARS", "MAX_GROUPS",
        "MAX_INIT_ARGS", "MAX_INIT_BYTES", "MAX_LAYER_BYTES", "MAX_MEMORY_BYTES", "MAX_MOUNTS", "MAX_PIDS",
        "MAX_TTL_S", "MAX_VOLUMES", "MemoryRange", "Mount", "Plan", "PlanError", "PlanSyntaxError", "PlanValidationError",
        "Problem", "Reference", "ResolvedGroup", "ResolvedGroupLike", "Resolver", "Resources",
        "apply_image_defaults", "apply_overrides", "dump_json_schema", "dump_plan", "exposed_host_path",
        "format_for_path", "format_size", "is_locked", "load_any", "load_lock", "load_plan", "load_text",
        "lock_plan", "parse_cpu_range", "parse_document", "parse_memory_range", "parse_ref", "parse_size",
        "plan_defaults_from_image", "plan_from_builtins", "plan_json_schema", "plan_to_builtins",
        "verify_lock_group", "verify_manifest", "VolumeMount", "write_plan",
    ],
    "weenv.api": [
        "AccessTokens", "ApiKey", "Backend", "Gate", "ImageRouting", "KeyStore", "NodeBackend", "OwnerTable", "StoreError",
        "TemplateStore", "create_app", "serve",
    ],
    "weenv.cluster": [
        "AgentError", "AgentHandle", "AsyncClusterClient", "AsyncClusterEnv", "Backend", "Capacity", "Choice", "Cluster", "ClusterAuthError", "ClusterEnv", "ClusterError", "ClusterView", "EnvHeld", "EnvLostError", "LayerHeld", "LocalCluster", "NodeAgent", "NodeClient", "NodeEntry", "NodeLostError", "NodeReport", "NodeState", "PendingCall", "PlacementError", "PlacementRequest", "Reconciler", "SnapshotHeld", "UnknownEnvError", "VolumeConflictError", "VolumeHeld", "VolumeNotFoundError", "agent_class", "agent_name", "async_client", "capacity_from_top", "client", "connect", "gateway_url", "load_published", "node_name_for", "node_of", "place", "place_group", "place_volume", "rank", "request_for", "stop_node", "volume_home", "volume_nodes", "with_pending"],
    "weenv.net": [
        "EgressPolicy", "Entry", "PolicyError", "parse_bandwidth", "parse_entry", "parse_policy",
    ],
    "weenv.provision": [
        "Admission", "AdmissionError", "BindMount", "Cgroup", "CgroupBackend", "CgroupBusyError", "CgroupError",
        "CgroupExistsError", "CgroupNameError", "CgroupNotFoundError", "CgroupSample", "CgroupUnavailableError",
        "ContainerError", "ContainerExistsError", "ContainerNotFoundError", "ContainerState", "CrunRuntime",
        "DEFAULT_POLICY", "Daemon", "DaemonConfig", "Decision", "EnvError", "EnvFileError",
        "EnvFileNotFoundError", "EnvFileTooLargeError", "EnvFileTypeError", "EnvLimits", "EnvManager",
        "EnvMetrics", "EnvNotFoundError", "EnvQuotaState", "EnvStartError", "EnvStateError", "ExecResult",
        "FileInfo", "HostError", "HostFacts", "Monitor", "MonitorStatistics", "MountError", "NodeView",
        "PolicyConfig", "ProvisionError", "RootFS", "Runtime", "SpecError", "User", "UserNotFoundError",
        "V1Backend", "V2Backend", "admit", "build_spec", "criu_status", "decide", "detect_backend",
        "detect_host", "prepare_bundle", "resolve_user", "serve",
    ],
    "weenv.provision.runtime": [
        "BindMount", "ContainerState", "CrunRuntime", "ExecResult", "GvisorRuntime", "HostFacts", "IdMap",
        "Runtime", "RuntimeRouter", "User", "build_spec", "criu_status", "detect_host", "node_runtime",
        "prepare_bundle",
    ],
    "weenv.provision.envs": [
        "EnvManager", "EnvRecord", "FileInfo", "LayerTrees", "LockVerifier", "RootFS", "SnapshotNotFoundError", "SnapshotRecord",
        "SnapshotStore", "resolve_user",
    ],
    "weenv.provision.elastic": [
        "Admission", "DEFAULT_POLICY", "Decision", "EnvLimits", "EnvMetrics", "EnvQuotaState", "Monitor",
        "MonitorStatistics", "NodeView", "PROMETHEUS_CONTENT_TYPE", "PolicyConfig", "admit", "decide",
        "render_prometheus",
    ],
    "weenv.provision.server": [
        "DaemonApi", "HTTPError", "Request", "Response", "Router", "Server", "StreamResponse",
    ],
    "weenv.provision.cgroups": [
        "ALL_FEATURES", "Cgroup", "CgroupBackend", "CgroupFs", "CgroupLayout", "CgroupSample", "PAGE_BYTES",
        "V1Backend", "V1Cgroup", "V2Backend", "V2Cgroup", "check_name", "detect_backend", "parse_layout",
    ],
    "weenv.testing": [
        "BadEntry", "BuildError", "ByteTokenizer", "DEFAULT_ROOT", "DOORS_SOURCE", "DaemonHandle", "Dockerd", "ENV_VAR", "EgressDaemon", "FakeBackend", "FakeCgroup", "FakeChunkTier", "FakeCommand", "FakeRuntime", "FakeSGLang", "FakeStore", "Fault", "FixtureCacheError", "HostUnsupported", "LegacySample", "OUTSIDE_A", "OUTSIDE_B", "OUTSIDE_BIG_BYTES", "OUTSIDE_HOST", "OUTSIDE_NAMES", "OUTSIDE_OTHER_PORT", "OUTSIDE_PORT", "Outside", "PROBE_SOURCE", "Proxy", "ProxyLog", "RegistryProcess", "Reply", "SHIPPED_DEVICES", "Sample", "ScriptedDaemon", "attempts", "busybox_plan", "busybox_tree", "byte_tokenizer", "cache_root", "cached", "check_debian_tar", "check_executable", "check_file", "check_tar", "check_tree", "debian_tar", "debian_tar_name", "device_plan", "egress_daemon", "extracted", "find", "leftovers", "parse_rollout_result", "require_fuse", "require_root", "require_tool", "rollout_binary", "sampling_params", "slime_args", "source_tree", "start_dockerd", "start_proxy", "start_registry", "stop_dockerd", "stop_proxy", "stop_registry", "teardown_private_daemon", "train_side_checks", "turns", "wait_for", "weenv_links"],
    "weenv.build": [
        "BuildError", "DockerBuildResult", "DockerfileError", "PackageError", "StepFailedError", "TaskRecord",
        "TasksFileError", "build", "build_dockerfile", "check_lock",
        "default_results_path", "is_git_url", "load_tasks", "lock_with_image_defaults", "package", "package_tasks",
        "plan_name", "read_results",
    ],
    "weenv.cli": [
        "main",
    ],
    "slime_plugin": [
        "Action", "BashBlockParser", "CallResult", "CapacityError", "CommandFailedError", "ConfigError",
        "EnvSpec", "EvaluatorSpec", "GenerationAborted", "GenerationError", "GradingError",
        "HermesToolCallParser", "RolloutSettings", "SandboxError", "SandboxNotStartedError", "SlimePluginError",
        "SnapshotUnavailableError", "ToolCall", "ToolCallParser", "WeenvSandbox", "load_parser",
        "resolve_env_spec", "resolve_rollout_settings",
    ],
}


@pytest.mark.parametrize("name", sorted(PUBLIC_API))
def test_all_is_pinned(name: str) -> None:
    assert importlib.import_module(name).__all__ == PUBLIC_API[name]


@pytest.mark.parametrize("name", sorted(PUBLIC_API))
def test_every_public_name_imports(name: str) -> None:
    module = importlib.import_module(name)
    assert len(set(module.__all__)) == len(module.__all__), "a name listed twice"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists names it does not have: {missing}"
    namespace: dict[str, object] = {}
    exec(f"from {name} import *", namespace)  # noqa: S102 - the star import is what __all__ is for
    assert set(module.__all__) <= set(namespace)


def _packages() -> list[str]:
    names = ["weenv", "slime_plugin"]
    for root in ("weenv", "slime_plugin"):
        module = importlib.import_module(root)
        names += [m.name for m in pkgutil.walk_packages(module.__path__, prefix=f"{root}.") if m.ispkg]
    return sorted(names)


@pytest.mark.parametrize("name", _packages())
def test_every_package_lists_its_re_exports_explicitly(name: str) -> None:
    """No ``__all__`` built from ``dir()`` (it picks up ``annotations`` and submodules); every
    ``from ._x import Y as Y`` re-export is listed, every listed name is pinned above."""
    module = importlib.import_module(name)
    source = pathlib.Path(module.__file__).read_text()  # type: ignore[arg-type]
    tree = ast.parse(source)
    assigned = [node for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
    assert len(assigned) == 1, f"{name}: __init__ has no (or more than one) __all__ assignment"
    value = assigned[0].value
    assert isinstance(value, ast.List) and all(isinstance(e, ast.Constant) for e in value.elts) or name == "weenv", \
        f"{name}: __all__ must be a literal list of names"
    re_exports = {a.asname for node in tree.body if isinstance(node, ast.ImportFrom)
                  for a in node.names if a.asname is not None and a.asname == a.name}
    assert re_exports <= set(module.__all__), f"{name}: re-exported but not in __all__: {re_exports - set(module.__all__)}"
    assert name in PUBLIC_API, f"{name} is a package: pin its __all__ in PUBLIC_API"


def test_fakes_live_only_in_weenv_testing() -> None:
    leaks = [f"{name}.{n}" for name in _packages() if name != "weenv.testing"
             for n in importlib.import_module(name).__all__ if n.startswith("Fake")]
    assert not leaks
    import weenv.provision
    import weenv.provision.cgroups

    for module, fake in ((weenv.provision, "FakeRuntime"), (weenv.provision, "FakeBackend"),
                         (weenv.provision.cgroups, "FakeBackend"), (weenv.provision.cgroups, "FakeCgroup")):
        assert not hasattr(module, fake), f"{module.__name__}.{fake} is back in production code"
    assert [n for n in PUBLIC_API["weenv.testing"] if n.startswith("Fake")] == [
        "FakeBackend", "FakeCgroup", "FakeChunkTier", "FakeCommand", "FakeRuntime", "FakeSGLang", "FakeStore"]


def test_production_code_does_not_import_the_test_harness() -> None:
    code = ("import sys, weenv, weenv.build, weenv.cli, weenv.envlet, weenv.layerfmt, weenv.net, weenv.plan, weenv.provision, "
            "weenv.registry, slime_plugin, slime_plugin.rollout, slime_plugin.sandbox\n"
            "print(','.join(m for m in sys.modules if m.startswith(('weenv.testing', 'tests', 'benchmarks'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


def test_weenv_testing_needs_no_pytest() -> None:
    """Benchmarks run without the test extras: the harness must import (and skip) without pytest."""
    code = ("import sys; sys.modules['pytest'] = None\n"
            "import weenv.testing as t, unittest\n"
            "try:\n    t.require_tool('weenv-no-such-tool')\n"
            "except t.HostUnsupported as e:\n    assert isinstance(e, unittest.SkipTest) and 'weenv-no-such-tool' in str(e)\n"
            "else:\n    raise SystemExit('no error for a missing tool')\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


_TESTS_MODULE = re.compile(r"""["']tests\.\w""")


def test_benchmarks_import_nothing_from_tests() -> None:
    """benchmarks/ and tests/ share weenv.testing; neither a benchmark's import nor a dotted path it hands
    on (``weenv_tokenizer="tests.…"``) may point into tests/."""
    problems = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            else:
                continue
            problems += [f"{path.name}:{node.lineno} imports {m}" for m in mods if m == "tests" or m.startswith("tests.")]
        problems += [f"{path.name}: names a tests module ({m.group()}…)" for m in _TESTS_MODULE.finditer(source)]
    import weenv.testing

    harness = pathlib.Path(weenv.testing.__file__).parent
    for path in sorted(harness.rglob("*.py")):
        problems += [f"weenv/testing/{path.name}: names a tests module" for _ in _TESTS_MODULE.finditer(path.read_text())]
        problems += [f"weenv/testing/{path.name}: imports {m}" for m in re.findall(r"^\s*(?:from|import) ((?:tests|benchmarks|pytest)\b\S*)",
                                                                               path.read_text(), re.M)]
    assert not problems, problems
