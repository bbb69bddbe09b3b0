"""A rollout-like workload as a static binary that runs in any env (busybox has no python).

``rollout run CYCLES THINK_MS BURST_MITERS ALLOC_MIN_MB ALLOC_MAX_MB HOLD_MS SEED`` repeats, per
cycle: think (sleep THINK_MS x U[0.5, 1.5): the model generating), a CPU burst (BURST_MITERS
million dependent multiply-adds: compiling, running tests), and a transient allocation of
U[ALLOC_MIN_MB, ALLOC_MAX_MB] MiB, every page written from user space, held HOLD_MS, freed. It
prints one line of ``key=value`` timings (milliseconds, CLOCK_MONOTONIC) at the end.

``rollout alloc MB HOLD_MS`` allocates and writes MB MiB once, holds it, frees it, prints ``ok``.

Pages are written from user space on purpose: on cgroup v1 with the OOM killer disabled below the
hard limit, a user-space page fault at the limit sleeps until the monitor raises the limit,
whereas a kernel-side charge (``read()`` from /dev/zero into a fresh buffer, a tmpfs ``write()``)
fails with a short read / ENOMEM instead of waiting.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from ._fixturecache import cached, check_executable

SOURCE = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(double ms) {
    struct timespec ts = {(time_t)(ms / 1000), (long)((ms - (time_t)(ms / 1000) * 1000) * 1e6)};
    while (nanosleep(&ts, &ts) != 0) {}
}

static unsigned long long rng;
static double uniform(void) { /* xorshift64*, [0, 1) */
    rng ^= rng >> 12; rng ^= rng << 25; rng ^= rng >> 27;
    return (double)((rng * 2685821657736338717ULL) >> 11) / 9007199254740992.0;
}

static volatile unsigned long long sink;
static void burst(double miters) {
    unsigned long long x = rng | 1, n = (unsigned long long)(miters * 1e6);
    for (unsigned long long i = 0; i < n; i++) x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    sink = x;
}

/* Writes every page from user space; returns the mapping (munmap'd by the caller). */
static char *touch(size_t bytes) {
    char *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(2); }
    for (size_t off = 0; off < bytes; off += 4096) p[off] = (char)off | 1;
    return p;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc == 4 && strcmp(argv[1], "alloc") == 0) {
        size_t bytes = (size_t)atol(argv[2]) << 20;
        char *p = touch(bytes);
        sleep_ms(atof(argv[3]));
        munmap(p, bytes);
        printf("ok\n");
        return 0;
    }
    if (argc == 9 && strcmp(argv[1], "run") == 0) {
        int cycles = atoi(argv[2]);
        double think = atof(argv[3]), miters = atof(argv[4]);
        double lo = atof(argv[5]), hi = atof(argv[6]), hold = atof(argv[7]);
        rng = strtoull(argv[8], NULL, 10) * 0x9E3779B97F4A7C15ULL + 1;
        double t_think = 0, t_burst = 0, t_alloc = 0, t_hold = 0, peak = 0, start = now_ms();
        for (int c = 0; c < cycles; c++) {
            double t = now_ms();
            sleep_ms(think * (0.5 + uniform()));
            double t1 = now_ms(); t_think += t1 - t;
            burst(miters);
            double t2 = now_ms(); t_burst += t2 - t1;
            double mb = lo + (hi - lo) * uniform();
            size_t bytes = ((size_t)(mb * 1048576.0) + 4095) & ~(size_t)4095;
            if (mb > peak) peak = mb;
            char *p = touch(bytes);
            double t3 = now_ms(); t_alloc += t3 - t2;
            sleep_ms(hold);
            munmap(p, bytes);
            t_hold += now_ms() - t3;
        }
        printf("cycles=%d total_ms=%.1f think_ms=%.1f burst_ms=%.1f alloc_ms=%.1f hold_ms=%.1f peak_mb=%.0f\n",
               cycles, now_ms() - start, t_think, t_burst, t_alloc, t_hold, peak);
        return 0;
    }
    fprintf(stderr, "usage: rollout alloc MB HOLD_MS | rollout run CYCLES THINK_MS BURST_MITERS "
                    "ALLOC_MIN_MB ALLOC_MAX_MB HOLD_MS SEED\n");
    return 64;
}
"""


def rollout_binary(cache: Path | None = None) -> Path:
    """The static ``rollout`` binary, built once with gcc and cached by its source."""
    key = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]

    def build(out: Path) -> None:
        src = out.parent / "rollout.c"
        src.write_text(SOURCE)
        subprocess.run(["gcc", "-O2", "-static", "-o", str(out), str(src)], check=True, capture_output=True)

    return cached(f"rollout-{key}", build, check_executable, root=cache)


def parse_rollout_result(line: str) -> dict[str, float]:
    """``key=value`` pairs of the last line ``rollout run`` printed."""
    return {k: float(v) for k, v in (item.split("=", 1) for item in line.strip().splitlines()[-1].split())}
