"""``weenv package --tasks FILE``: a tasks file (JSON lines) packaged in parallel, results recorded
as they come (a rerun skips what is done); and ``check_lock``, a task lock started and smoke-tested."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

import msgspec

from .._client import Client, WeenvError
from ._package import (
    DEFAULT_SETUP_TIMEOUT_S,
    DEFAULT_WORKDIR,
    TASK_ID_PATTERN,
    _load_base,
    package,
)
from ._package_errors import PackageError, TasksFileError

# =============================================================================== batch


class TaskSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One line of a tasks file. Unset options take the command line's values."""

    id: Annotated[str, msgspec.Meta(pattern=TASK_ID_PATTERN)]
    repo: Annotated[str, msgspec.Meta(min_length=1)]
    commit: str | None = None
    setup: list[str] = []
    env: dict[str, str] = {}
    workdir: Annotated[str, msgspec.Meta(pattern=r"^/[^\x00]*$")] | None = None
    include_git: bool | None = None
    gitignore: bool | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None


def load_tasks(path: str) -> list[TaskSpec]:
    """Every task of a JSONL file, checked before any runs; :class:`TasksFileError` names FILE:LINE."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        raise TasksFileError(f"cannot read tasks file {path}: {e.strerror}") from None
    decoder = msgspec.json.Decoder(TaskSpec)
    tasks: list[TaskSpec] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            task = decoder.decode(line)
        except msgspec.ValidationError as e:
            raise TasksFileError(f"{path}:{lineno}: {e}") from None
        except msgspec.DecodeError as e:
            raise TasksFileError(f"{path}:{lineno}: not a JSON object: {e}") from None
        if task.id in first_line:
            raise TasksFileError(f"{path}:{lineno}: duplicate task id {task.id!r} (first on line {first_line[task.id]})")
        first_line[task.id] = lineno
        tasks.append(task)
    if not tasks:
        raise TasksFileError(f"{path}: no tasks")
    return tasks


class TaskRecord(msgspec.Struct, kw_only=True):
    """One line of the results file: the outcome of one task (the latest line of an id wins)."""

    id: str
    status: str  # "ok" | "failed"
    ref: str | None = None
    digest: str | None = None
    lock: str | None = None
    uploaded_bytes: int = 0
    seconds: float = 0.0
    cached: bool = False
    commit: str | None = None
    error: str | None = None


def read_results(path: str) -> dict[str, TaskRecord]:
    """The latest record of each id in a results file (missing file: none; a torn last line is skipped)."""
    out: dict[str, TaskRecord] = {}
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return out
    except OSError as e:
        raise TasksFileError(f"cannot read results file {path}: {e.strerror}") from None
    decoder = msgspec.json.Decoder(TaskRecord)
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            rec = decoder.decode(line)
        except msgspec.MsgspecError:
            continue  # a line cut short by a crash: that task simply runs again
        out[rec.id] = rec
    return out


@dataclass
class BatchResult:
    total: int
    ok: int
    failed: int
    skipped: int  # finished OK in an earlier run
    uploaded_bytes: int
    seconds: float
    results: str  # path of the results file
    failed_ids: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


BatchEvent = Callable[[str, str, Any], Any]
"""``on_event(kind, task_id, data)``: kind "start" (data None), "stage" (text) or "done" (TaskRecord)."""


def default_results_path(tasks_path: str) -> str:
    stem = tasks_path[:-6] if tasks_path.endswith(".jsonl") else tasks_path
    return f"{stem}.results.jsonl"


def package_tasks(tasks_path: str, *, base: Any, ref_template: str, jobs: int = 4, results_path: str | None = None,
                  locks_dir: str | None = None, setup: list[str] | tuple[str, ...] = (),
                  workdir: str = DEFAULT_WORKDIR, include_git: bool = False, gitignore: bool = False,
                  setup_timeout_s: float | None = DEFAULT_SETUP_TIMEOUT_S, keep_snapshots: bool = False,
                  network: str | None = None,
                  client_factory: Callable[[], Client] | None = None,
                  on_event: BatchEvent | None = None) -> BatchResult:
    """Package every task of a JSONL file with ``jobs`` in parallel; resumable and failure-isolated.

    Each finished task appends one :class:`TaskRecord` line to ``results_path`` (default
    ``TASKS.results.jsonl``); ids whose latest record is "ok" are skipped. ``setup`` commands run
    before each task's own; ``workdir``/``include_git``/``gitignore`` are defaults a task may override.
    Locks go to ``locks_dir`` (default ``locks/`` next to the tasks file) as ``ID.lock.toml``.
    """
    if "{id}" not in ref_template:
        raise PackageError(f"--ref-template {ref_template!r} must contain {{id}}")
    try:
        ref_template.format(id="x")
    except (KeyError, IndexError, ValueError) as e:
        raise PackageError(f"--ref-template {ref_template!r}: only {{id}} may be substituted ({e})") from None
    tasks = load_tasks(tasks_path)
    tasks_dir = os.path.dirname(os.path.abspath(tasks_path))
    results_path = results_path or default_results_path(tasks_path)
    locks_dir = locks_dir or os.path.join(tasks_dir, "locks")
    emit = on_event or (lambda kind, task_id, data: None)
    t0 = time.perf_counter()
    previous = read_results(results_path)
    todo = [t for t in tasks if not (t.id in previous and previous[t.id].status == "ok")]
    skipped = len(tasks) - len(todo)
    base_lock = _load_base(base) if todo else None  # resolved once for every task
    write_lock = threading.Lock()
    records: list[TaskRecord] = []
    made: list[str] = []  # the setup steps' snapshots the tasks made (not taken from the step cache)
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    factory = client_factory or (lambda: Client(timeout_s=(setup_timeout_s or 24 * 3600.0) + 120.0))

    def one(task: TaskSpec) -> None:
        emit("start", task.id, None)
        started = time.perf_counter()
        ref = ref_template.format(id=task.id)
        try:
            with factory() as c:
                res = package(task.repo, base=base_lock, ref=ref, commit=task.commit, setup=[*setup, *task.setup],
                              workdir=task.workdir or workdir, env=task.env,
                              gitignore=gitignore if task.gitignore is None else task.gitignore,
                              include_git=include_git if task.include_git is None else task.include_git,
                              lock_out=os.path.join(locks_dir, f"{task.id}.lock.toml"), name=task.id,
                              # deleted once the batch is done: a task of the same repo running now may
                              # have one from the step cache (deleted under it: "No such file" of its blob)
                              setup_timeout_s=task.timeout_s or setup_timeout_s, keep_snapshots=True,
                              network=network,
                              base_dir=tasks_dir, client=c,
                              on_stage=lambda text: emit("stage", task.id, text))
            with write_lock:
                made.extend(st["snapshot"] for st in res.steps if not st["cached"] and st["snapshot"])
            rec = TaskRecord(id=task.id, status="ok", ref=res.ref, digest=res.digest, lock=res.lock,
                             uploaded_bytes=res.uploaded_bytes, seconds=round(time.perf_counter() - started, 3),
                             cached=res.cached, commit=res.commit)
        except Exception as e:  # one task's failure, whatever it is, must not stop the others
            msg = str(e) if isinstance(e, (WeenvError, OSError)) else f"{type(e).__name__}: {e}"
            rec = TaskRecord(id=task.id, status="failed", ref=ref, seconds=round(time.perf_counter() - started, 3),
                             error=msg or type(e).__name__)
        line = msgspec.json.encode(rec) + b"\n"
        with write_lock:
            with open(results_path, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            records.append(rec)
        emit("done", task.id, rec)

    if todo:
        with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="weenv-package") as pool:
            for fut in [pool.submit(one, t) for t in todo]:
                fut.result()
    if made and not keep_snapshots:
        with factory() as c:
            for snap in made:
                try:
                    c.delete_snapshot(snap)
                except WeenvError:
                    pass  # gone already; gc of the step cache is best effort
    failed = [r.id for r in records if r.status != "ok"]
    return BatchResult(total=len(tasks), ok=len(records) - len(failed), failed=len(failed), skipped=skipped,
                       uploaded_bytes=sum(r.uploaded_bytes for r in records), seconds=time.perf_counter() - t0,
                       results=os.path.abspath(results_path), failed_ids=sorted(failed))


# =============================================================================== check


@dataclass
class CheckResult:
    lock: str
    env_id: str
    start_seconds: float
    smoke: str | None = None
    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_lock(lock_path: str, smoke: str | None = None, *, timeout_s: float | None = 600.0,
               client: Client | None = None) -> CheckResult:
    """Start an env from a task lock and run ``smoke`` (``/bin/sh -c``) in it; the env is killed after.

    :class:`PackageError` when the lock cannot be read or the env does not start; the smoke
    command's own failure is its exit code in the result, not an error.
    """
    from ..plan import PlanError, load_any

    try:
        load_any(lock_path)
    except (PlanError, OSError) as e:
        raise PackageError(f"cannot check {lock_path}: {e}") from None
    own = client is None
    c = client or Client(timeout_s=(timeout_s or 24 * 3600.0) + 120.0)
    try:
        t0 = time.perf_counter()
        try:
            env = c.create(lock_path)
        except WeenvError as e:
            raise PackageError(f"cannot start an env from {lock_path}: {e}") from None
        with env:
            started = time.perf_counter() - t0
            result = CheckResult(lock=os.path.abspath(lock_path), env_id=env.id, start_seconds=round(started, 3),
                                 smoke=smoke)
            if smoke is not None:
                try:
                    r = env.exec(["/bin/sh", "-c", smoke], timeout_s=timeout_s)
                except WeenvError as e:
                    raise PackageError(f"cannot run the smoke command in {env.id}: {e}") from None
                result.exit_code = r.exit_code
                result.stdout = r.stdout.decode("utf-8", "replace")
                result.stderr = r.stderr.decode("utf-8", "replace")
                result.timed_out = r.timed_out
        return result
    finally:
        if own:
            c.close()
