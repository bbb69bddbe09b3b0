"""docker-py through ``weenv serve --docker`` vs a private dockerd, on the same image, in the same run (issue 30).

    python -m benchmarks.docker_api [--quick]

A docker-registry on 127.0.0.1, a private weenv daemon with ``weenv serve --docker unix://SOCK`` in
front of it (the socket's key, an admin one), and a private dockerd (benchmarks/_peers.py: Debian's
docker.io, ``weenv.testing.start_dockerd``). The dockerd imports the benchmark's busybox tree, builds a
task image on it (a "repo" with a test script, as a SWE-bench task image has one: ``docker build``,
``--network none``) and pushes it to the registry. Both sides then run that one image by its registry
reference: dockerd from its own image store, weenv from the registry (its layers converted once, on the
warm-up). The unmodified docker package (PyPI) is the client of both, over their Unix sockets.

- **create → first exec output**: ``containers.run(IMAGE, "sleep 1000000", detach=True,
  network_mode="none")`` then ``exec_run("echo hi")`` until its output is back; the container removed
  after the clock stops. Pairs of one weenv and one docker run, in random order each pair, p50 over p50.
- **a 16-way SWE-style evaluation round**: 16 threads at once, each: ``containers.create(IMAGE, "tail -f
  /dev/null", nano_cpus=0.1 core, mem_limit=256m)`` + ``start``, ``put_archive`` of a patch and an eval
  script, ``exec_run("timeout 60 sh /eval.sh > /tmp/test_output.txt 2>&1; echo $?")`` (the tests fail
  before the patch and pass after it), the log read back with ``exec_run("cat ...")``, ``remove(force=True)``.
  The round's wall time, from the first create to the last remove; rounds alternate which system goes
  first. 0.1 core each because weenv guarantees each env its minimum cores and refuses what does not fit
  (docs/docker.md, "Admission"): 16 of the default 0.25 do not fit on a 2-core node.

Goals (issue 30): create → first output p50 ≤ 0.3x docker's; the 16-way round's wall time ≤ 0.5x
docker's (medians over the rounds). The ratio column is docker / weenv (> 1: weenv faster); the goal
lines print weenv / docker, as the issue states them.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from weenv.testing import DaemonHandle, start_registry, stop_registry

from ._daemon import bench_daemon
from ._peers import IMAGE as PEER_IMAGE
from ._peers import peers
from ._util import Report, arg_parser, median, percentile

GOAL_FIRST_OUTPUT = 0.3  # weenv p50 / docker p50, at most
GOAL_ROUND = 0.5  # weenv wall / docker wall, at most
ROUND_WIDTH = 16
ROUND_CPU_NANOS = 100_000_000  # 0.1 core each: 16 fit the guarantees of a 2-core node
ROUND_MEMORY = "256m"

TASK_DOCKERFILE = f"""\
FROM {PEER_IMAGE}
COPY repo/ /work/repo/
WORKDIR /work/repo
CMD ["sh"]
"""
RUN_TESTS = b"""\
cd /work/repo
failed=0
for t in tests/test_*.sh; do
    if sh "$t"; then echo "PASSED $t"; else echo "FAILED $t"; failed=$((failed + 1)); fi
done
echo "$failed failed"
[ "$failed" -eq 0 ]
"""
CALC_BROKEN = b"add() { echo $(($1 - $2)); }\nmul() { echo $(($1 * $2)); }\n"
CALC_FIXED = b"add() { echo $(($1 + $2)); }\nmul() { echo $(($1 * $2)); }\n"
TEST_STEPS = 10  # each step forks a subshell: light, so the round measures the API, not 0.1 core of shell
TESTS = {f"tests/test_{i}.sh": (f". /work/repo/calc.sh\ni=0; s=0\nwhile [ $i -lt {TEST_STEPS} ]; do i=$((i + 1)); "
                                f"s=$(add $s {i}); done\n[ $s -eq {TEST_STEPS * i} ]\n[ $(mul {i} 3) -eq {i * 3} ]\n"
                                ).encode() for i in range(1, 5)}
EVAL_SH = b"cp /tmp/patch/calc.sh /work/repo/calc.sh\ntimeout 60 sh /work/repo/run_tests.sh\n"
TAIL = b"0 failed\n"


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o755, 1_700_000_000
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


PATCH_TAR = _tar({"patch/calc.sh": CALC_FIXED, "eval.sh": EVAL_SH})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_task_image(peer: Any, registry_host: str, work: str) -> str:
    """The task image, built by dockerd on the busybox import and pushed to the registry: its REF."""
    ctx = os.path.join(work, "task-ctx")
    files = {"repo/run_tests.sh": RUN_TESTS, "repo/calc.sh": CALC_BROKEN, **{f"repo/{k}": v for k, v in TESTS.items()}}
    for name, data in files.items():
        path = os.path.join(ctx, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    with open(os.path.join(ctx, "Dockerfile"), "w") as f:
        f.write(TASK_DOCKERFILE)
    ref = f"{registry_host}/bench/swe-task:1"
    peer.cli("build", "-q", "--network", "none", "-t", ref, ctx, timeout_s=300)
    peer.cli("push", ref, timeout_s=300)
    return ref


def start_serve(d: DaemonHandle, sock: str, registry_host: str) -> subprocess.Popen:  # type: ignore[type-arg]
    """``weenv serve --docker unix://SOCK`` in front of ``d``, once docker-py's ping answers on the socket."""
    import docker

    log = open(os.path.join(d.home, "serve.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "weenv", "serve", "--listen", f"127.0.0.1:{_free_port()}",
                             "--socket", d.socket, "--docker", f"unix://{sock}", "--registry", registry_host],
                            env=d.env_vars(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weenv serve exited with {proc.returncode}: {_tail(d.home, 'serve.log')}")
        if os.path.exists(sock):
            try:
                c = docker.DockerClient(base_url=f"unix://{sock}", version="1.45", timeout=5)
                c.ping()
                c.close()
                return proc
            except Exception:
                pass
        if time.monotonic() > deadline:
            stop_serve(proc)
            raise RuntimeError(f"weenv serve --docker did not answer within 30 s: {_tail(d.home, 'serve.log')}")
        time.sleep(0.05)


def stop_serve(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(home: str, name: str) -> str:
    try:
        with open(os.path.join(home, name), errors="replace") as f:
            return f.read()[-2000:]
    except OSError:
        return ""


def first_output(side: str, client: Any, image: str) -> float:
    """Seconds from ``containers.run`` to ``exec_run("echo hi")``'s output; the container removed after."""
    t0 = time.perf_counter()
    ct = client.containers.run(image, "sleep 1000000", detach=True, network_mode="none")
    try:
        res = ct.exec_run("echo hi")
        took = time.perf_counter() - t0
        assert (res.exit_code, res.output) == (0, b"hi\n"), f"{side}: exec_run('echo hi') gave {res}"
        return took
    finally:
        ct.remove(force=True)


def swe_task(side: str, client: Any, image: str) -> dict[str, float]:
    """One SWE-style evaluation; the seconds of each step."""
    steps: dict[str, float] = {}
    t = time.perf_counter()

    def step(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        steps[name] = now - t
        t = now

    ct = client.containers.create(image, "tail -f /dev/null", detach=True, network_mode="none",
                                  nano_cpus=ROUND_CPU_NANOS, mem_limit=ROUND_MEMORY)
    try:
        ct.start()
        step("create + start")
        assert ct.put_archive("/tmp", PATCH_TAR)
        step("put_archive")
        res = ct.exec_run(["sh", "-c", "timeout 60 sh /tmp/eval.sh > /tmp/test_output.txt 2>&1; echo $?"])
        assert res.output == b"0\n", f"{side}: the tests' exec_run gave {res}"
        step("run the tests")
        out = ct.exec_run("cat /tmp/test_output.txt").output
        if not (out.endswith(TAIL) and out.count(b"PASSED") == len(TESTS)):
            raise AssertionError(f"{side}: exec_run('cat /tmp/test_output.txt') gave {out!r}; the file, by "
                                 f"get_archive: {_file(ct, '/tmp/test_output.txt')!r}")
        step("read the log")
    finally:
        ct.remove(force=True)
    step("remove")
    return steps


def _file(ct: Any, path: str) -> bytes:
    stream, _stat = ct.get_archive(path)
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as t:
        f = t.extractfile(os.path.basename(path))
        return f.read() if f is not None else b""


def swe_round(side: str, client: Any, image: str, width: int) -> tuple[float, list[dict[str, float]]]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(width) as pool:
        each = list(pool.map(lambda _: swe_task(side, client, image), range(width)))
    return time.perf_counter() - t0, each


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min), {five:.1f} (5 min)"


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    pairs, rounds, width = (4, 1, 8) if args.quick else (40, 6, ROUND_WIDTH)
    report = Report("docker_api", "docker-py through weenv serve --docker vs a private dockerd", args.quick)
    import docker

    work = tempfile.mkdtemp(prefix="weenv-bench-dockerapi-")
    reg = start_registry(work)
    serve = None
    load_before = _load()
    try:
        with bench_daemon("dockerapi") as d, peers(f"{d.home}/src-busybox", report, names=("docker",)) as ps:
            if "docker" not in ps:
                raise SystemExit("docker_api: dockerd cannot run here (see the note above): nothing to compare")
            image = build_task_image(ps["docker"], reg.host, work)
            from weenv.api import KeyStore

            KeyStore(os.path.join(d.home, "api")).create("bench", admin=True)  # the API store exists
            sock = os.path.join(work, "docker.sock")
            serve = start_serve(d, sock, reg.host)
            clients = {"weenv": docker.DockerClient(base_url=f"unix://{sock}", version="1.45", timeout=120,
                                                    max_pool_size=2 * ROUND_WIDTH),
                       "docker": docker.DockerClient(base_url=f"unix://{ps['docker'].d.sock}", version="1.41",
                                                     timeout=120, max_pool_size=2 * ROUND_WIDTH)}
            first: dict[str, list[float]] = {n: [] for n in clients}
            walls: dict[str, list[float]] = {n: [] for n in clients}
            steps: dict[str, list[dict[str, float]]] = {n: [] for n in clients}
            for name, c in clients.items():  # warm: weenv converts the image's layers; code paths; page cache
                for _ in range(3):
                    first_output(name, c, image)
                swe_task(name, c, image)
                swe_round(name, c, image, min(4, width))
            for i in range(pairs):
                for name in random.sample(list(clients), len(clients)):
                    first[name].append(first_output(name, clients[name], image))
            for i in range(rounds):
                order = list(clients) if i % 2 == 0 else list(reversed(clients))
                for name in order:
                    time.sleep(1.0)  # the last round's removals settle
                    wall, each = swe_round(name, clients[name], image, width)
                    walls[name].append(wall)
                    steps[name] += each
            for c in clients.values():
                c.close()
    finally:
        if serve is not None:
            stop_serve(serve)
        stop_registry(reg)
        shutil.rmtree(work, ignore_errors=True)
    load_after = _load()

    w50, k50 = median(first["weenv"]) * 1000, median(first["docker"]) * 1000
    ratio = w50 / k50
    ok_first = ratio <= GOAL_FIRST_OUTPUT
    report.add("create → first exec output, docker-py → dockerd", k50, "ms",
               p99=percentile(first["docker"], 99) * 1000)
    report.add("create → first exec output, docker-py → weenv serve --docker", w50, "ms",
               p99=percentile(first["weenv"], 99) * 1000, baseline=k50, baseline_label="dockerd p50, same run",
               goal=f"≤ {GOAL_FIRST_OUTPUT}x docker's p50 (ratio ≥ {1 / GOAL_FIRST_OUTPUT:.2f}x)", ok=ok_first,
               note=f"create → first output: {pairs} pairs, random order in each; weenv / docker = {ratio:.2f}x")
    ww, kw = median(walls["weenv"]), median(walls["docker"])
    rratio = ww / kw
    ok_round = rratio <= GOAL_ROUND
    report.add(f"{width}-way SWE-style round, dockerd (wall)", kw * 1000, "ms")
    report.add(f"{width}-way SWE-style round, weenv serve --docker (wall)", ww * 1000, "ms", baseline=kw * 1000,
               baseline_label="dockerd, median round", goal=f"≤ {GOAL_ROUND}x docker's wall (ratio ≥ "
               f"{1 / GOAL_ROUND:.2f}x)", ok=ok_round,
               note=f"round: {rounds} rounds of {width} each, alternating who goes first; weenv / docker = "
                    f"{rratio:.2f}x; per round weenv {', '.join(f'{x:.2f}' for x in walls['weenv'])} s, "
                    f"docker {', '.join(f'{x:.2f}' for x in walls['docker'])} s")
    for step_name in steps["weenv"][0]:
        sw = median([s[step_name] for s in steps["weenv"]]) * 1000
        sk = median([s[step_name] for s in steps["docker"]]) * 1000
        report.add(f"round step: {step_name} (p50 of each task)", sw, "ms", baseline=sk,
                   baseline_label="dockerd p50")
    report.series["first_output_weenv_ms"] = [x * 1000 for x in first["weenv"]]
    report.series["first_output_docker_ms"] = [x * 1000 for x in first["docker"]]
    report.series["round_wall_weenv_s"] = walls["weenv"]
    report.series["round_wall_docker_s"] = walls["docker"]
    lines = [f"goal create → first exec output: weenv / docker = {ratio:.2f}x (weenv p50 {w50:.0f} ms, docker p50 "
             f"{k50:.0f} ms; ≤ {GOAL_FIRST_OUTPUT}x): {'ok' if ok_first else 'MISSED'}",
             f"goal {width}-way SWE-style round: weenv / docker = {rratio:.2f}x (weenv {ww:.2f} s, docker {kw:.2f} s; "
             f"≤ {GOAL_ROUND}x): {'ok' if ok_round else 'MISSED'}"]
    report.notes.append(f"load average before {load_before}, after {load_after} (a shared 2-core machine)")
    report.notes.append(f"one image for both (built by dockerd, pushed to a registry on 127.0.0.1): {_image_note()}")
    report.notes += lines
    report.print()
    for line in lines:
        print(line)
    print("results:", report.save())


def _image_note() -> str:
    return (f"busybox tree + a repo layer ({len(TESTS)} shell tests that fail before the patch); the patch and "
            "eval script go in by put_archive, the tests run under timeout 60")


if __name__ == "__main__":
    main()
