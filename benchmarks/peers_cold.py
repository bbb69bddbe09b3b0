"""Cold start from a registry: weenv lazy (with and without a recorded prefetch list) vs
``docker pull`` + ``docker run``, the same image in the same ``docker-registry``.

    python -m benchmarks.peers_cold [--quick]

The image is the cached Debian bookworm minbase + python3 tar (``--quick``: a busybox tree and a
shell command: a smoke run, not a measurement). It is published twice into one loopback
``docker-registry``: as a weenv ``os`` group (tail-TOC layer; once more with the prefetch list one
run of the command recorded, ``weenv envlet trace``) and, by a private dockerd
(:func:`weenv.testing.start_dockerd`), as a Docker image (``docker import`` + ``docker push``:
gzip layers, as every Docker image). Every pull goes through a throttling proxy in front of that
registry, 100 MB/s + 1 ms per request (and loopback, unthrottled, as a second profile), so
bytes on the wire cost what a fast datacenter link costs.

Each round, in random order, with empty caches on every side:

- **weenv lazy**: a fresh private daemon (its own ``$WEENV_HOME``: empty chunk cache and store;
  started before the clock) creates an env from the lock and runs the command through the Python
  client: create → first output;
- **weenv lazy + prefetch list**: the same from the group published with the recorded list;
- **docker**: ``docker rmi`` of everything the last round pulled (untimed), then ``docker pull``
  through the proxy and ``docker run --rm --network none IMAGE CMD``: pull start → output.

Reported: time to first output and the bytes each pulled through the proxy; the goal (issue 32):
weenv lazy ≥ 5x faster than ``docker pull`` + ``docker run`` at 100 MB/s.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from weenv.testing import DaemonHandle, HostUnsupported, cache_root, start_dockerd, start_registry, stop_dockerd
from weenv.testing import stop_registry, teardown_private_daemon

from ._throttle import ThrottleProxy
from ._util import Report, arg_parser, median
from .envlet_lazy_start import PY_CMD, SH_CMD, layer_file, record_trace, source_image

GOAL_VS_DOCKER = 5.0
PROFILES_FULL = [("100 MB/s + 1 ms", 100e6, 0.001), ("loopback", None, 0.0)]
PROFILES_QUICK = [("100 MB/s + 1 ms", 100e6, 0.001)]
PLAN = ('name = "cold"\n\n[[groups]]\nname = "os"\nref = "{ref}"\nclass = "os"\n\n'
        '[resources]\npids = 256\ndisk = "64MiB"\n\n[resources.cpu]\nmin = 0.1\nmax = 2.0\n\n'
        '[resources.memory]\nmin = "64MiB"\nmax = "512MiB"\n')


def _lock(work: Path, name: str, ref: str) -> str:
    """A lock of the one-group plan on ``ref`` (resolved before any clock runs)."""
    from weenv.plan import load_plan, lock_plan, write_plan
    from weenv.registry import resolve_group

    plan = work / f"{name}.toml"
    plan.write_text(PLAN.format(ref=ref))
    lock = work / f"{name}.lock.toml"
    write_plan(lock_plan(load_plan(str(plan)), resolve_group), str(lock))
    return str(lock)


def weenv_cold(work: Path, proxy: ThrottleProxy, lock: str, cmd: list[str]) -> tuple[float, int]:
    """A fresh daemon (empty caches) creates from ``lock`` and runs ``cmd``: (seconds, bytes pulled)."""
    home = tempfile.mkdtemp(dir=work, prefix="home-")
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-bench-cold-{os.getpid()}",
                     lock, lock, os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.start()
    try:
        with d.client() as c:
            proxy.reset_counters()
            t0 = time.perf_counter()
            env = c.create(lock)
            r = env.exec(cmd, timeout_s=300)
            took = time.perf_counter() - t0
            if r.exit_code != 0 or b"ready" not in r.stdout:
                raise RuntimeError(f"weenv: {cmd} exited {r.exit_code}: {r.stderr[-500:]!r}")
            pulled = proxy.bytes_down
            env.kill()
        return took, pulled
    finally:
        left = teardown_private_daemon(d)
        if left:
            print(f"weenv cold start left: {left}", file=sys.stderr)


class _Docker:
    def __init__(self, tar: Path, push_ref: str) -> None:
        self.d = start_dockerd()
        try:
            self.version = self.d.cli("version", "--format", "{{.Server.Version}}").stdout.strip()
            with open(tar, "rb") as f:
                subprocess.run([*self._base(), "import", "-", push_ref], stdin=f, env=self._env(), check=True,
                               capture_output=True, timeout=600)
            self.d.cli("push", push_ref, timeout_s=600)
            self.d.cli("rmi", push_ref)
        except BaseException:
            stop_dockerd(self.d)
            raise

    def _base(self) -> list[str]:
        from weenv.testing._docker import DOCKER

        return [DOCKER, "-H", f"unix://{self.d.sock}"]

    def _env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_CONFIG": os.path.join(self.d.root, "config")}

    def cold(self, proxy: ThrottleProxy, ref: str, cmd: list[str]) -> tuple[float, int]:
        self.d.cli("rmi", "-f", ref, check=False)
        self.d.cli("image", "prune", "-a", "-f", check=False)
        proxy.reset_counters()
        t0 = time.perf_counter()
        self.d.cli("pull", "-q", ref, timeout_s=600)
        out = self.d.cli("run", "--rm", "--network", "none", ref, *cmd, timeout_s=300).stdout
        took = time.perf_counter() - t0
        if "ready" not in out:
            raise RuntimeError(f"docker run printed {out!r}")
        return took, proxy.bytes_down

    def close(self) -> list[str]:
        return stop_dockerd(self.d)


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    report = Report("peers_cold", "Cold start from a registry: weenv lazy vs docker pull + run", args.quick)
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as t:
        work = Path(t)
        os.chmod(work, 0o755)  # the envs' user namespace range walks into the homes below
        source_tar, label = source_image(work, args.quick)
        cmd, repeat, profiles = (SH_CMD, 1, PROFILES_QUICK) if args.quick else (PY_CMD, 3, PROFILES_FULL)
        reg = start_registry(str(work / "registry"))
        docker: _Docker | None = None
        try:
            from weenv.registry import publish_layer_file, resolve_group

            lf = layer_file(source_tar)
            publish_layer_file(str(lf), f"{reg.host}/bench/cold:v1", group="os", group_class="os")
            g = resolve_group(f"{reg.host}/bench/cold:v1")
            trace = record_trace(work, reg.host, g, cmd)
            publish_layer_file(str(layer_file(source_tar, trace)), f"{reg.host}/bench/cold:prefetch", group="os",
                               group_class="os")
            try:
                docker = _Docker(source_tar, f"{reg.host}/bench/cold-docker:v1")
                report.peers["docker"] = {"version": docker.version, "how": "a private dockerd (runc, overlay2), "
                                          "pulling through the same throttling proxy"}
            except (HostUnsupported, subprocess.CalledProcessError, AssertionError) as e:
                msg = f"docker skipped: {e}"
                print(msg, file=sys.stderr)
                report.notes.append(msg)
            report.notes.append(f"{label}: weenv layer {g.layer_size / 1e6:.1f} MB (zstd chunks); command "
                                f"{' '.join(cmd)!r}; prefetch list: {len(trace)} files recorded by one run")
            for name, rate, latency in profiles:
                with ThrottleProxy(reg.host, rate_bytes_s=rate, latency_s=latency) as proxy:
                    # the refs name the proxy: every byte a puller reads goes through it
                    locks = {"weenv lazy": _lock(work, "lazy", f"{proxy.host}/bench/cold:v1"),
                             "weenv lazy + prefetch list": _lock(work, "prefetch", f"{proxy.host}/bench/cold:prefetch")}
                    runs: dict[str, list[tuple[float, int]]] = {k: [] for k in [*locks, *(["docker"] if docker else [])]}
                    for _ in range(repeat):
                        order = list(runs)
                        random.shuffle(order)  # interleaved, so noise hits all alike
                        for kind in order:
                            if kind == "docker":
                                assert docker is not None
                                runs[kind].append(docker.cold(proxy, f"{proxy.host}/bench/cold-docker:v1", cmd))
                            else:
                                runs[kind].append(weenv_cold(work, proxy, locks[kind], cmd))
                    dt = median([x for x, _ in runs["docker"]]) if docker else None
                    if docker:
                        report.add(f"{name}: docker pull + docker run: time to first output", dt, "s")
                        report.add(f"{name}: docker pull: bytes pulled", median([b for _, b in runs["docker"]]) / 1e6,
                                   "MB")
                        report.series[f"{name}|docker|seconds"] = [x for x, _ in runs["docker"]]
                    for kind in locks:
                        lt = median([x for x, _ in runs[kind]])
                        report.series[f"{name}|{kind}|seconds"] = [x for x, _ in runs[kind]]
                        if dt is not None and rate is not None:
                            report.add(f"{name}: {kind}: create → first output", lt, "s", baseline=dt,
                                       baseline_label="docker pull + docker run",
                                       goal=f"≥ {GOAL_VS_DOCKER:g}x faster", ok=dt / lt >= GOAL_VS_DOCKER)
                        else:
                            report.add(f"{name}: {kind}: create → first output", lt, "s", baseline=dt,
                                       baseline_label="docker pull + docker run" if dt else None)
                        report.add(f"{name}: {kind}: bytes pulled", median([b for _, b in runs[kind]]) / 1e6, "MB",
                                   baseline=median([b for _, b in runs["docker"]]) / 1e6 if docker else None,
                                   baseline_label="docker pull" if docker else None)
                    if dt is not None:
                        lt = median([x for x, _ in runs["weenv lazy"]])
                        print(f"goal {name}: weenv lazy vs docker pull + run: {dt / lt:.2f}x faster "
                              f"(docker {dt:.2f} s / weenv {lt:.2f} s; goal ≥ {GOAL_VS_DOCKER:g}x"
                              f"{'' if rate else ', loopback: no goal'}): "
                              f"{'ok' if dt / lt >= GOAL_VS_DOCKER or not rate else 'MISSED'}")
        finally:
            if docker is not None:
                left = docker.close()
                if left:
                    report.notes.append(f"LEAKS (docker): {left}")
            stop_registry(reg)
            shutil.rmtree(work / "registry", ignore_errors=True)
    report.notes.append("load average at the end (1, 5, 15 min): " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
