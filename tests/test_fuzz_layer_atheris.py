"""Coverage-guided fuzzing (atheris, libFuzzer) of the layer reader: footer, TOC, chunk reads and
verify, from a seed corpus of real layers (one from a tar, one from a tree with chunks, links,
whiteouts). The promise: only :class:`weenv.layerfmt.LayerError` for any bytes, no other exception,
no hang (libFuzzer's -timeout), memory under -rss_limit_mb.

The test runs this file as a script in a subprocess for a bounded time ($WEENV_ATHERIS_S, 10 s
by default; ``make soak`` gives it more) and records its runs in $WEENV_FUZZ_STATS. Skipped when
atheris is not installed (it is optional: ``pip install atheris``).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time

import pytest


def _seeds(out: str) -> None:
    from weenv.layerfmt import build_layer

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in (("a/x", b"hello" * 200), ("big", bytes(range(256)) * 40), (".wh.gone", b"")):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        ti = tarfile.TarInfo("a/y")
        ti.type, ti.linkname = tarfile.SYMTYPE, "x"
        tf.addfile(ti)
        ti = tarfile.TarInfo("a/z")
        ti.type, ti.linkname = tarfile.LNKTYPE, "a/x"
        tf.addfile(ti)
    buf.seek(0)
    with open(os.path.join(out, "from-tar"), "wb") as f:
        build_layer(buf, f, chunk_size=4096)
    with tempfile.TemporaryDirectory() as src:
        os.makedirs(os.path.join(src, "d/e"))
        with open(os.path.join(src, "d/e/f"), "wb") as f:
            f.write(os.urandom(9000))
        os.symlink("e/f", os.path.join(src, "d/link"))
        with open(os.path.join(out, "from-tree"), "wb") as f:
            build_layer(src, f, chunk_size=1024)


def fuzz_one(data: bytes) -> None:
    from weenv.layerfmt import BytesReader, Layer, LayerError

    try:
        layer = Layer.open(BytesReader(data))
        for e in layer.entries[:64]:
            if e.type in ("file", "hardlink"):
                try:
                    layer.read(e.path)
                except LayerError:
                    pass
        layer.verify()
    except LayerError:
        pass


def _main() -> None:
    import atheris

    with atheris.instrument_imports():
        import weenv.layerfmt  # noqa: F401
    atheris.Setup(sys.argv, fuzz_one)
    atheris.Fuzz()


def test_atheris_on_the_layer_reader(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("atheris")
    seconds = int(os.environ.get("WEENV_ATHERIS_S", "10"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _seeds(str(corpus))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, __file__, str(corpus), f"-max_total_time={seconds}", "-timeout=10",
                        "-rss_limit_mb=1024", "-max_len=65536", f"-artifact_prefix={tmp_path}/"],
                       capture_output=True, text=True, timeout=seconds + 120)
    took = time.monotonic() - t0
    runs = re.findall(r"Done (\d+) runs", p.stderr)
    path = os.environ.get("WEENV_FUZZ_STATS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"target": "layer reader: footer, TOC, chunks, verify (atheris, coverage-guided)",
                                "test": "tests/test_fuzz_layer_atheris.py::test_atheris_on_the_layer_reader",
                                "examples": int(runs[-1]) if runs else 0, "duration_s": round(took, 1),
                                "findings": "" if p.returncode == 0 else "crash: see the test's output"}) + "\n")
    assert p.returncode == 0, p.stderr[-4000:]
    assert runs and int(runs[-1]) > 0, p.stderr[-2000:]


if __name__ == "__main__":
    _main()
