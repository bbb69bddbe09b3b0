"""A simulated slime rollout step through ``slime_plugin.rollout.generate``: fresh env per sample vs
one prepared env per group, snapshotted and forked.

    python -m benchmarks.rollout [--quick] [--tasks 16] [--samples 8] [--calls 5] [--gen-latency-ms 200]

16 tasks × 8 samples (a group per task, all groups in flight at once as slime submits them), each
sample 5 tool calls then an answer, then grading in its env. The model is the fake SGLang server of
the tests (scripted replies after ``--gen-latency-ms``); the envs are real (a private daemon, busybox
plan). Each task's setup writes a small repository (200 files, 4 MiB) and waits ``--install-s``
(5 s: a network-bound dependency install) — the work a fork saves.

At most ``--max-envs`` (32) envs are alive at once (``weenv_max_envs``), at most 16 being created.

(a) baseline: ``weenv_group_fork: false`` — every sample creates an env and runs the setup.
(b) weenv: ``weenv_group_fork: true`` — the first sample of a group sets up, commits; all 8 start
    from the snapshot.

Reported per mode: wall time of the step, env-seconds per sample (time a sample spends in env
operations: create — including waiting for a creation slot —, setup, commit, waiting for its group,
tool calls, grading, kill), and the share of sample time spent in env operations.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from slime_plugin import rollout as plugin_rollout
from weenv.testing import FakeSGLang, Sample, sampling_params, slime_args, turns

from ._daemon import bench_daemon
from ._util import Report, arg_parser

def setup_commands(install_s: float, cpu_loops: int) -> list[str]:
    """A task's preparation: a small repository, plus ``install_s`` of waiting that stands for a
    network-bound dependency install (pip/npm/apt downloads), plus ``cpu_loops`` iterations of a
    shell loop that stand for CPU-bound preparation (building)."""
    commands = [
        "mkdir -p /task/src && cd /task/src && i=0; while [ $i -lt 200 ]; do echo \"def f$i(): return $i\" > m$i.py; "
        "i=$((i+1)); done",
        "dd if=/dev/urandom of=/task/blob bs=1M count=4 2>/dev/null && echo 'x = 1' > /task/src/main.py",
        f"sleep {install_s:g}",
    ]
    if cpu_loops:
        commands.append(f"i=0; while [ $i -lt {cpu_loops} ]; do i=$((i+1)); done")
    return commands
CALLS = [
    "ls /task/src | wc -l",
    "echo 'x = 2' > /task/src/main.py && echo edited",
    "cat /task/src/main.py",
    "grep -l 'return 1' /task/src/*.py | head -3",
    "wc -c /task/blob",
    "sed -n 1p /task/src/m7.py",
    "find /task -name '*.py' | wc -l",
]
EVALUATOR = "grep -q 'x = 2' /task/src/main.py"


def script(n_calls: int) -> list[str]:
    return [f"Step {i}.\n<bash>{CALLS[i % len(CALLS)]}</bash>" for i in range(n_calls)] + ["<answer>done</answer>"]


async def rollout_step(args: Any, tasks: int, samples: int) -> tuple[float, list[Any], dict[str, int]]:
    groups = [[Sample(index=t * samples + k, group_index=t, prompt=f"Task {t}: edit main.py.\n")
               for k in range(samples)] for t in range(tasks)]
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(plugin_rollout.generate(args, s, sampling_params()) for g in groups for s in g))
        wall_s = time.perf_counter() - t0
        return wall_s, [s for g in groups for s in g], plugin_rollout.statistics()
    finally:
        await plugin_rollout.aclose()


def summarize(samples: list[Any]) -> dict[str, float]:
    runs = [s.metadata["weenv_run"] for s in samples]
    ops: dict[str, float] = {}
    for r in runs:
        for k, v in r["env_ops_s"].items():
            ops[k] = ops.get(k, 0.0) + v
    calls: dict[str, list[float]] = {}
    for r in runs:
        for t in r["turns"]:
            for c in t["calls"]:
                calls.setdefault(c["command"], []).append(c["duration_s"])
    return {
        "env_s_per_sample": statistics.mean(r["env_s"] for r in runs),
        "env_s_per_sample_unqueued": statistics.mean(
            r["env_s"] - r["env_ops_s"].get("env_slot_wait", 0.0) for r in runs),
        "tool_call_s": statistics.mean(d for ds in calls.values() for d in ds),
        "tool_call_s_by_command": {k: statistics.mean(v) for k, v in calls.items()},
        "gen_s_per_sample": statistics.mean(r["gen_s"] for r in runs),
        "wall_s_per_sample": statistics.mean(r["wall_s"] for r in runs),
        "env_share": sum(r["env_s"] for r in runs) / sum(r["wall_s"] for r in runs),
        "aborted": sum(s.status is Sample.Status.ABORTED for s in samples),
        "ok": sum(s.reward == 1.0 for s in samples),
        **{f"op_{k}_s_per_sample": v / len(runs) for k, v in sorted(ops.items())},
    }


def main() -> None:
    p = arg_parser(__doc__ or "")
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--gen-latency-ms", type=float, default=200.0)
    p.add_argument("--create-concurrency", type=int, default=16)
    p.add_argument("--max-envs", type=int, default=32, help="envs alive at once (weenv_max_envs)")
    p.add_argument("--install-s", type=float, default=5.0, help="simulated dependency install in the setup")
    p.add_argument("--setup-cpu-loops", type=int, default=0, help="CPU-bound setup work (shell loop iterations)")
    p.add_argument("--name", default="rollout", help="results file name (for variants of the scenario)")
    opts = p.parse_args()
    if opts.quick:
        opts.tasks, opts.samples, opts.calls, opts.install_s = 2, 4, 2, 0.2
    setup_kind = (f", CPU-bound setup ({opts.setup_cpu_loops} shell loop iterations)" if opts.setup_cpu_loops
                  else f", setup waits {opts.install_s:g} s")
    report = Report(opts.name, f"slime rollout step: fork per group vs fresh env per sample{setup_kind}", opts.quick)
    server = FakeSGLang(latency_s=opts.gen_latency_ms / 1000)
    server.reply = turns(script(opts.calls))
    results: dict[str, dict[str, Any]] = {}
    try:
        with bench_daemon("rollout") as d:
            for mode, fork in (("fresh", False), ("fork", True)):
                args = slime_args(server, weenv_socket=d.socket, weenv_plan=d.plan_lock, weenv_setup=setup_commands(opts.install_s, opts.setup_cpu_loops),
                                  weenv_evaluator={"command": EVALUATOR}, weenv_group_fork=fork,
                                  weenv_create_concurrency=opts.create_concurrency, weenv_max_envs=opts.max_envs,
                                  n_samples_per_prompt=opts.samples, weenv_command_timeout_s=60)
                wall_s, samples, stats = asyncio.run(rollout_step(args, opts.tasks, opts.samples))
                results[mode] = {"wall_s": wall_s, **summarize(samples), "stats": stats}
                reasons = {s.metadata.get("abort_reason") for s in samples if s.status is Sample.Status.ABORTED}
                print(f"{mode}: wall {wall_s:.2f} s, {results[mode]}", *(f"\n  aborted: {r}" for r in reasons))
                with d.client() as c:
                    assert not c.list(), "envs left behind"
    finally:
        server.close()
    fresh, fork = results["fresh"], results["fork"]
    n = opts.tasks * opts.samples
    report.add(f"step wall time ({opts.tasks} tasks × {opts.samples} samples, {opts.calls} calls + grade)",
               fork["wall_s"], "s", baseline=fresh["wall_s"], baseline_label="fresh env per sample")
    report.add("env-seconds per sample", fork["env_s_per_sample"], "s", baseline=fresh["env_s_per_sample"],
               baseline_label="fresh env per sample")
    report.add("env-seconds per sample, not counting the wait for an env slot (max_envs)",
               fork["env_s_per_sample_unqueued"], "s", baseline=fresh["env_s_per_sample_unqueued"],
               baseline_label="fresh env per sample")
    report.add("tool call duration (mean)", fork["tool_call_s"] * 1000, "ms", baseline=fresh["tool_call_s"] * 1000,
               baseline_label="fresh env per sample",
               note="forked envs read the task files from the committed layer through the envlet; "
                    "fresh envs from their own upper")
    report.add("share of sample time in env operations, fork per group", fork["env_share"] * 100, "%")
    report.add("share of sample time in env operations, fresh env per sample", fresh["env_share"] * 100, "%")
    for mode, r in results.items():
        ops = ", ".join(f"{k[3:-len('_s_per_sample')]} {v * 1000:.0f}" for k, v in r.items()
                        if k.startswith("op_"))
        by_command = ", ".join(f"`{k}` {v * 1000:.0f}" for k, v in r["tool_call_s_by_command"].items())
        report.notes.append(f"{mode}: per sample ms — {ops}; generation {r['gen_s_per_sample'] * 1000:.0f} ms "
                            f"(fake model, {opts.gen_latency_ms:g} ms per turn); env ops {dict(r['stats'])}; "
                            f"tool calls ms: {by_command}")
        report.add(f"samples graded 1.0 / aborted, {mode}", r["ok"], f"of {n}", note=f"{r['aborted']} aborted",
                   ok=r["ok"] == n and r["aborted"] == 0)
    report.series = {mode: [r["wall_s"], r["env_s_per_sample"], r["env_share"]] for mode, r in results.items()}
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
