"""Error kinds (weenv._wire.KIND_STATUS): one table of kind → HTTP status, checked row by row, and
every place in weenv that raises an error answer with a literal status and kind agrees with it;
the daemon's mapping of its own exceptions gives each its kind's status."""

from __future__ import annotations

import ast
import pathlib

import pytest

from weenv._wire import API_STATUS, KIND_STATUS, HttpError

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kind", sorted(KIND_STATUS))
def test_each_kind_has_one_status_and_errors_of_it_carry_it(kind: str) -> None:
    status = KIND_STATUS[kind]
    assert 400 <= status < 600
    err = HttpError.of(kind, "why")
    assert (err.status, err.kind, err.message) == (status, kind, "why")


def test_the_api_overrides_only_kinds_the_table_knows() -> None:
    assert set(API_STATUS) <= set(KIND_STATUS)
    assert API_STATUS == {"not_admitted": 429}


def _raised_pairs() -> list[tuple[str, int, int, str]]:
    out = []
    for path in (ROOT / "weenv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or len(node.args) < 2:
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            status, kind = node.args[0], node.args[1]
            if name in ("HttpError", "HTTPError", "error_response") and isinstance(status, ast.Constant) and \
                    isinstance(kind, ast.Constant) and isinstance(kind.value, str):
                out.append((str(path.relative_to(ROOT)), node.lineno, status.value, kind.value))
    return out


def test_every_literal_error_answer_agrees_with_the_table() -> None:
    pairs = _raised_pairs()
    assert len(pairs) > 100  # the scan sees the code base's errors
    wrong = [f"{p}:{line}: {status} {kind!r} (the table: {KIND_STATUS.get(kind)})" for p, line, status, kind in pairs
             if KIND_STATUS.get(kind) != status]
    assert not wrong, "\n".join(wrong)


def test_the_daemons_exceptions_map_to_their_kinds_status() -> None:
    from weenv.envlet import EnvletError
    from weenv.plan import PlanError
    from weenv.provision import _errors as e
    from weenv.provision.envs._snapshots import SnapshotNotFoundError
    from weenv.provision.server._routes import _error
    from weenv.registry import RegistryError

    cases = [(e.EnvNotFoundError("x"), "env_not_found"), (SnapshotNotFoundError("x"), "snapshot_not_found"),
             (e.EnvFileNotFoundError("x", path="/p"), "file_not_found"), (e.EnvStateError("x"), "wrong_state"),
             (e.ProcessNotFoundError("x"), "process_not_found"), (e.ProcessExitedError("x"), "process_exited"),
             (e.ProcessStateError("x"), "process_state"), (e.AdmissionError("x"), "not_admitted"),
             (PlanError("x"), "bad_plan"), (e.EnvFileError("x", path="/p"), "file_error"),
             (RegistryError("x"), "registry"), (e.EnvStartError("x"), "start_failed"), (e.ProvisionError("x"), "failed"),
             (EnvletError("x"), "failed")]
    for exc, kind in cases:
        err = _error(exc)
        assert (err.kind, err.status) == (kind, KIND_STATUS[kind]), exc
