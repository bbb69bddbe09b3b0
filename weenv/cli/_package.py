"""``weenv package``: repositories at commits become ``task`` groups (one, a batch, or a check)."""

from __future__ import annotations

import sys
from typing import Any

import click

from . import main
from ._common import human_bytes, print_json, stderr, stdout


def _env_pairs(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"expected KEY=VALUE, got {v!r}", param_hint="--env")
        out[k] = val
    return out


def _owner(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    uid, _, gid = value.partition(":")
    try:
        return int(uid), int(gid or uid)
    except ValueError:
        raise click.BadParameter(f"expected numeric UID[:GID], got {value!r}", param_hint="--chown") from None


@main.command("package")
@click.argument("repo", required=False)
@click.option("--base", help="Plan or lock of the base groups (os, toolchain, harness, evaluator).")
@click.option("--ref", help="Publish the task group here (REF with a tag).")
@click.option("--commit", help="Commit to package (default HEAD, and the work tree must be clean).")
@click.option("--setup", "setup", multiple=True, metavar="CMD",
              help="Setup command run in the workdir over base + repository (repeatable, in order).")
@click.option("--workdir", default="/repo", show_default=True, help="Where the repository goes in the env.")
@click.option("--env", "env_vars", multiple=True, metavar="KEY=VALUE", help="Environment of setup and of the task.")
@click.option("--gitignore", is_flag=True, help="Leave out tracked files the commit's .gitignore rules match.")
@click.option("--include-git", is_flag=True, help="Include a .git checked out at the commit (git diff works).")
@click.option("--chown", "chown", metavar="UID[:GID]", help="Owner of the repository files (default root).")
@click.option("--name", help="Plan name of the task lock (default: from the ref's tag).")
@click.option("--lock-out", type=click.Path(dir_okay=False), help="Task lock path (default ./NAME.lock.toml).")
@click.option("--setup-timeout", "setup_timeout_s", type=click.FloatRange(min=0, min_open=True), default=1800.0,
              show_default=True, help="Seconds each setup command may run.")
@click.option("--keep-snapshots", is_flag=True, help="Keep the setup step snapshots (faster setup iteration).")
@click.option("--network", type=click.Choice(["none", "loopback", "host"]), default=None,
              help="Network of the setup commands: 'host' lets them download (pip, apt). The task lock keeps the "
                   "base's network.")
@click.option("--tasks", "tasks_path", type=click.Path(dir_okay=False), help="Batch: a JSONL file of tasks.")
@click.option("--ref-template", help="Batch: the ref of each task, e.g. 'reg.example/tasks:{id}'.")
@click.option("--jobs", type=click.IntRange(1, 256), default=4, show_default=True, help="Batch: tasks in parallel.")
@click.option("--results", "results_path", type=click.Path(dir_okay=False),
              help="Batch: results JSONL (default TASKS.results.jsonl); ids finished OK there are skipped.")
@click.option("--locks-dir", type=click.Path(file_okay=False), help="Batch: where ID.lock.toml go (default locks/).")
@click.option("--check", "check_lock", type=click.Path(dir_okay=False), metavar="LOCK",
              help="Start an env from LOCK (and run --smoke); exit with the smoke command's code.")
@click.option("--smoke", metavar="CMD", help="With --check: a command to run in the env (/bin/sh -c).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (no progress display).")
def package_cmd(repo: str | None, base: str | None, ref: str | None, commit: str | None, setup: tuple[str, ...],
                workdir: str, env_vars: tuple[str, ...], gitignore: bool, include_git: bool, chown: str | None,
                name: str | None, lock_out: str | None, setup_timeout_s: float, keep_snapshots: bool,
                network: str | None, tasks_path: str | None, ref_template: str | None, jobs: int, results_path: str | None,
                locks_dir: str | None, check_lock: str | None, smoke: str | None, as_json: bool) -> None:
    """Package REPO at a commit (plus setup) as a thin task group over --base.

    \b
    weenv package ./repo --base base.lock.toml --ref REG/tasks:t1 --setup 'make deps'
    weenv package --tasks tasks.jsonl --base base.lock.toml --ref-template 'REG/tasks:{id}' --jobs 8
    weenv package --check locks/t1.lock.toml --smoke 'cd /repo && make test'

    Each tasks.jsonl line: {"id", "repo" (path or git URL), "commit", "setup": [...], "env"?, "workdir"?}.
    """
    from .._client import WeenvError

    try:
        if check_lock is not None:
            if repo or tasks_path:
                raise click.UsageError("--check takes a lock only (no REPO, no --tasks)")
            _check(check_lock, smoke, as_json)
            return
        if smoke is not None:
            raise click.UsageError("--smoke goes with --check")
        if base is None:
            raise click.UsageError("--base is required")
        if tasks_path is not None:
            if repo or ref:
                raise click.UsageError("--tasks packages the file's tasks: give --ref-template, not REPO or --ref")
            if not ref_template:
                raise click.UsageError("--tasks needs --ref-template (e.g. 'REG/tasks:{id}')")
            _batch(tasks_path, base=base, ref_template=ref_template, jobs=jobs, results_path=results_path,
                   locks_dir=locks_dir, setup=setup, workdir=workdir, include_git=include_git, gitignore=gitignore,
                   setup_timeout_s=setup_timeout_s, keep_snapshots=keep_snapshots, network=network, as_json=as_json)
            return
        if not repo:
            raise click.UsageError("give REPO (or --tasks FILE, or --check LOCK)")
        if not ref:
            raise click.UsageError("--ref is required")
        _single(repo, base=base, ref=ref, commit=commit, setup=setup, workdir=workdir, env=_env_pairs(env_vars),
                gitignore=gitignore, include_git=include_git, chown=_owner(chown), name=name, lock_out=lock_out,
                setup_timeout_s=setup_timeout_s, keep_snapshots=keep_snapshots, network=network, as_json=as_json)
    except WeenvError as e:  # PackageError and whatever the daemon client raised
        raise click.ClickException(str(e)) from None


def _single(repo: str, *, as_json: bool, **kw: Any) -> None:
    from ..build import package

    def on_stage(text: str) -> None:
        if not as_json:
            stderr.print(f"[dim]{text}[/]")

    res = package(repo, on_stage=on_stage, **kw)
    if as_json:
        print_json(res.to_json())
        return
    for w in res.warnings:
        stderr.print(f"[yellow]warning:[/] {w}")
    how = "cached" if res.cached else f"built in {res.seconds:.1f}s"
    stdout.print(f"published {res.ref} ({res.digest}), {how}, uploaded {human_bytes(res.uploaded_bytes)}; "
                 f"lock: {res.lock}")


def _check(lock: str, smoke: str | None, as_json: bool) -> None:
    from ..build import check_lock

    res = check_lock(lock, smoke)
    if as_json:
        print_json(res.to_json())
    else:
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        if smoke is None:
            stderr.print(f"{lock}: env {res.env_id} started in {res.start_seconds:.2f}s")
        elif res.exit_code != 0:
            stderr.print(f"[red]smoke command exited with {res.exit_code}{' (timed out)' if res.timed_out else ''}[/]")
    sys.exit(res.exit_code)


def _batch(tasks_path: str, *, as_json: bool, **kw: Any) -> None:
    from ..build import load_tasks, package_tasks

    live = not as_json and stderr.is_terminal
    total = len(load_tasks(tasks_path))  # a malformed file fails here, before any progress display

    if not live:
        def on_event(kind: str, task_id: str, data: Any) -> None:
            if kind == "done" and not as_json:
                _print_record(data)

        res = package_tasks(tasks_path, on_event=on_event, **kw)
    else:
        res = _with_progress(tasks_path, total, kw)
    if as_json:
        print_json(res.to_json())
    else:
        stdout.print(f"{res.ok} packaged, {res.failed} failed, {res.skipped} skipped (done before) of {res.total} "
                     f"in {res.seconds:.1f}s; uploaded {human_bytes(res.uploaded_bytes)}; results: {res.results}")
        if res.failed_ids:
            stdout.print("failed: " + ", ".join(res.failed_ids))
    if res.failed:
        sys.exit(1)


def _print_record(rec: Any) -> None:
    if rec.status == "ok":
        stdout.print(f"ok      {rec.id}  {rec.ref}  {human_bytes(rec.uploaded_bytes)} uploaded  {rec.seconds:.1f}s"
                     f"{'  (cached)' if rec.cached else ''}")
    else:
        first = (rec.error or "").strip().splitlines()[0] if rec.error else ""
        stdout.print(f"FAILED  {rec.id}  {first}")


def _with_progress(tasks_path: str, total: int, kw: dict[str, Any]) -> Any:
    """Run the batch under a live display: an overall bar, then one line per running task."""
    import threading

    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..build import default_results_path, package_tasks, read_results

    already = read_results(kw.get("results_path") or default_results_path(tasks_path))
    lock = threading.Lock()
    counts = {"ok": 0, "failed": 0, "bytes": 0}
    rows: dict[str, Any] = {}
    overall = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=stderr)
    running = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=stderr)
    done_before = sum(1 for r in already.values() if r.status == "ok")
    bar = overall.add_task("packaging", total=total, completed=min(done_before, total))

    def describe() -> str:
        return (f"packaging: [green]{counts['ok']} ok[/] [red]{counts['failed']} failed[/] "
                f"{human_bytes(counts['bytes'])} uploaded")

    def on_event(kind: str, task_id: str, data: Any) -> None:
        with lock:
            if kind == "start":
                rows[task_id] = running.add_task(f"{task_id}: starting")
            elif kind == "stage" and task_id in rows:
                running.update(rows[task_id], description=f"{task_id}: {data}")
            elif kind == "done":
                row = rows.pop(task_id, None)
                if row is not None:
                    running.remove_task(row)
                counts["ok" if data.status == "ok" else "failed"] += 1
                counts["bytes"] += data.uploaded_bytes
                if data.status != "ok":
                    first = (data.error or "").strip().splitlines()[0] if data.error else ""
                    live.console.print(f"[red]FAILED[/] {task_id}: {first}")
                overall.update(bar, advance=1, description=describe())

    with Live(Group(overall, running), console=stderr, refresh_per_second=8) as live:
        return package_tasks(tasks_path, on_event=on_event, **kw)
