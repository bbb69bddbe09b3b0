"""``weenv build -f Dockerfile CONTEXT`` (issue 28 item 3): parsed by dockerfile-parse, built in
real envs on the real daemon, one group per built layer, the step cache reused on rebuilds."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile

import pytest
from click.testing import CliRunner

import weenv.plan as wp
from weenv.build import DockerfileError, StepFailedError, build_dockerfile
from weenv.build._dockerfile import parse, words
from weenv.cli import main

# ------------------------------------------------------------------ parsing (no daemon)


@pytest.mark.parametrize("text,message", [
    ("FROM a\nVOLUME /data\n", "Dockerfile:2: VOLUME is not supported"),
    ("FROM a\nHEALTHCHECK CMD true\n", "Dockerfile:2: HEALTHCHECK is not supported"),
    ("FROM a\nONBUILD RUN x\n", "Dockerfile:2: ONBUILD is not supported"),
    ("FROM a\nRUN --mount=type=cache,target=/x true\n", "Dockerfile:2: RUN: flag --mount is not supported"),
    ("FROM a\nCOPY --frm=x a b\n", "Dockerfile:2: COPY: flag --frm is not supported"),
    ("RUN true\n", "Dockerfile:1: RUN: only ARG may come before the first FROM"),
    ("FROM a b\n", "Dockerfile:1: FROM: expected FROM IMAGE [AS NAME]"),
    ("FROM a\nSHELL /bin/bash -c\n", "Dockerfile:2: SHELL: SHELL takes a JSON array"),
    ("FROM a\nFROBNICATE x\n", "Dockerfile:2: FROBNICATE: unknown instruction"),
    ("# only a comment\n", "Dockerfile: no FROM instruction"),
])
def test_what_weenv_does_not_build_is_refused_naming_the_line(text, message):
    with pytest.raises(DockerfileError) as e:
        parse(text, "Dockerfile")
    assert str(e.value).startswith(message), str(e.value)


def test_stages_forms_flags_and_substitution():
    df = parse('ARG V=1\nFROM img:$V AS Base\nRUN echo a \\\n  && echo b\nCMD ["python3", "-m", "x"]\n'
               'COPY --chown=1:2 --from=base a b /d/\nFROM base\nENTRYPOINT not json [\n', "D")
    assert [(s.index, s.base, s.name, s.line) for s in df.stages] == [(0, "img:$V", "base", 2), (1, "base", None, 7)]
    run, cmd, cp = df.stages[0].instructions
    assert (run.line, run.exec_form) == (3, None) and "echo b" in run.value
    assert cmd.exec_form == ["python3", "-m", "x"]
    assert cp.flags == {"chown": "1:2", "from": "base"} and cp.value == "a b /d/"
    assert df.stages[1].instructions[0].exec_form is None  # not a JSON array: shell form, as Docker reads it
    assert words('$A/x ${B:-dflt} ${A:+set} "q q"', {"A": "a"}, {}) == ["a/x", "dflt", "set", "q q"]


# ------------------------------------------------------------------ builds on the real daemon


@pytest.fixture
def home_of(daemon, monkeypatch):
    """The client side of a build shares the daemon's $WEENV_HOME (its store holds the step layers)."""
    monkeypatch.setenv("WEENV_HOME", daemon.home)
    return daemon


def _context(tmp_path, last_run: str = "echo v1 > /app/last.txt", marker: str | None = None) -> tuple[str, str]:
    ctx = tmp_path / "ctx"
    (ctx / "src" / "pkg").mkdir(parents=True)
    (ctx / "src" / "pkg" / "mod.py").write_text("X = 1\n")
    (ctx / "src" / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(ctx / "src" / "run.sh", 0o755)
    (ctx / "src" / "debug.log").write_text("noise\n")
    (ctx / "notes.txt").write_text(f"notes of {marker or tmp_path.name}\n")  # each test's own content
    (ctx / "data").mkdir()
    for n in ("a.csv", "b.csv", "c.txt"):
        (ctx / "data" / n).write_text(n)
    (ctx / "secret.txt").write_text("do not ship\n")
    (ctx / ".dockerignore").write_text("# comments are ignored\nsecret.txt\n**/*.log\n")
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as t:
        info = tarfile.TarInfo("inner/hello.txt")
        info.size = 6
        t.addfile(info, io.BytesIO(b"hello\n"))
    (ctx / "bundle.tar.gz").write_bytes(buf.getvalue())
    (ctx / "Dockerfile").write_text(f"""\
ARG BASE
FROM ${{BASE}} AS build
USER 0:0
ARG GREETING=hello
ENV APP=/app PATH=/bin:/usr/bin
WORKDIR $APP
COPY --chown=1000:50 --chmod=640 src/ ./src/
COPY notes.txt data/*.csv ./
ADD bundle.tar.gz /opt/bundle/
RUN echo "$GREETING from $APP" > out.txt && ls -A src >> out.txt
RUN ["sh", "-c", "echo exec-form > exec.txt"]

FROM build
COPY --from=build /app/out.txt /final/
LABEL org.example.k=v
EXPOSE 8080 53/udp
CMD ["sh", "-c", "cat /final/out.txt"]
RUN {last_run}
""")
    return str(ctx), str(ctx / "Dockerfile")


def test_a_dockerfile_builds_into_a_lock_that_starts(home_of, busybox_oci, tmp_path):
    ctx, dockerfile = _context(tmp_path)
    out = str(tmp_path / "app.lock.toml")
    res = build_dockerfile(dockerfile, ctx, output=out, build_args={"BASE": f"oci:{busybox_oci}:bb"})
    lock = wp.load_lock(out)
    assert lock == res.lock and lock.name == "ctx"
    names = [g.name for g in lock.groups]
    assert names[:3] == ["layer0", "layer1", "layer2"] and names[3:] == [f"step{i}" for i in range(len(names) - 3)]
    assert len(names) - 3 == 7  # 3 copies + 2 runs, 1 copy --from + 1 run
    assert lock.env["APP"] == "/app" and lock.env["FOO"] == "bar" and "GREETING" not in lock.env  # ARGs never stay
    assert lock.workdir == "/app" and lock.user == "0:0"
    assert lock.image.cmd == ["sh", "-c", "cat /final/out.txt"] and lock.image.ports == ["8080/tcp", "53/udp"]
    assert lock.image.labels == {"org.example.k": "v"}
    assert lock.image.entrypoint == ["/bin/busybox"]  # the base image's, kept
    with home_of.client() as c:
        env = c.create(out)
        try:
            r = env.exec(["sh", "-c", "cat /final/out.txt; cat exec.txt last.txt /opt/bundle/inner/hello.txt; "
                                      "stat -c '%n %a %u:%g' src src/run.sh src/pkg/mod.py notes.txt a.csv; "
                                      "ls -A src; ls /app; ls /opt/bundle"])
            lines = r.stdout.decode().splitlines()
            assert lines[:5] == ["hello from /app", "pkg", "run.sh", "exec-form", "v1"], lines
            assert lines[5] == "hello"
            assert lines[6:11] == ["src 640 1000:50", "src/run.sh 640 1000:50", "src/pkg/mod.py 640 1000:50",
                                   "notes.txt 644 0:0", "a.csv 644 0:0"], lines
            assert "debug.log" not in r.stdout.decode()  # .dockerignore
            assert lines[11:13] == ["pkg", "run.sh"]
            app = lines[13:-1]
            assert "a.csv" in app and "b.csv" in app and "c.txt" not in app and "secret.txt" not in app, app
            assert lines[-1] == "inner"
        finally:
            env.kill()


def test_a_rebuild_reuses_every_step_and_a_changed_last_step_uploads_only_its_layer(home_of, busybox_oci, registry,
                                                                                   tmp_path):
    ctx, dockerfile = _context(tmp_path)
    args = {"BASE": f"oci:{busybox_oci}:bb"}
    store = f"{registry.host}/wb{os.getpid()}"  # a registry: what goes up is counted
    first = build_dockerfile(dockerfile, ctx, output=str(tmp_path / "a.lock"), build_args=args, store=store)
    assert not any(s.cached for s in first.steps) and first.uploaded_bytes > 0
    again = build_dockerfile(dockerfile, ctx, output=str(tmp_path / "b.lock"), build_args=args, store=store)
    assert all(s.cached for s in again.steps) and again.uploaded_bytes == 0
    assert again.lock.groups == first.lock.groups
    ctx2, dockerfile2 = _context(tmp_path / "v2", last_run="echo v2 > /app/last.txt", marker=tmp_path.name)
    changed = build_dockerfile(dockerfile2, ctx2, output=str(tmp_path / "c.lock"), build_args=args, store=store)
    assert [s.cached for s in changed.steps] == [True] * (len(changed.steps) - 1) + [False]
    assert changed.lock.groups[:-1] == first.lock.groups[:-1]  # every earlier group is the same artifact
    assert changed.lock.groups[-1].digest != first.lock.groups[-1].digest
    assert 0 < changed.uploaded_bytes <= changed.lock.groups[-1].layer_size  # only the last layer went up
    with home_of.client() as c:
        env = c.create(str(tmp_path / "c.lock"))
        try:
            assert env.exec(["cat", "/app/last.txt"]).stdout == b"v2\n"
        finally:
            env.kill()


def test_build_failures_name_the_line_and_leave_no_env(home_of, busybox_oci, tmp_path):
    ctx = tmp_path / "f"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM oci:{busybox_oci}:bb\nUSER 0\nRUN echo before\nRUN echo oops >&2; exit 3\n")
    with pytest.raises(StepFailedError) as e:
        build_dockerfile(str(ctx / "Dockerfile"), str(ctx))
    assert f"{ctx / 'Dockerfile'}:4: RUN" in str(e.value) and "exit code 3" in str(e.value) and "oops" in str(e.value)
    (ctx / "Dockerfile").write_text(f"FROM oci:{busybox_oci}:bb\nCOPY missing.txt /x\n")
    with pytest.raises(DockerfileError, match=r"Dockerfile:2: COPY: 'missing.txt' is not in the build context"):
        build_dockerfile(str(ctx / "Dockerfile"), str(ctx))
    (ctx / "Dockerfile").write_text(f"FROM oci:{busybox_oci}:bb\nADD https://example.invalid/x.tgz /x\n")
    with pytest.raises(DockerfileError, match=r"Dockerfile:2: ADD: .*fetches nothing from the network"):
        build_dockerfile(str(ctx / "Dockerfile"), str(ctx))
    (ctx / "Dockerfile").write_text(f"FROM oci:{busybox_oci}:bb\nCOPY ../outside /x\n")
    with pytest.raises(DockerfileError, match="outside the build context"):
        build_dockerfile(str(ctx / "Dockerfile"), str(ctx))
    # the command line: exit code and the message, nothing else
    (ctx / "Dockerfile").write_text(f"FROM oci:{busybox_oci}:bb\nVOLUME /data\n")
    res = CliRunner().invoke(main, ["build", "-f", str(ctx / "Dockerfile"), str(ctx)])
    assert res.exit_code != 0 and f"{ctx / 'Dockerfile'}:2: VOLUME is not supported" in res.output, res.output
    with home_of.client() as c:
        assert c.list() == []


def test_the_cli_builds_a_context_directory(home_of, busybox_oci, tmp_path):
    ctx = tmp_path / "cli"
    ctx.mkdir()
    (ctx / "hello.txt").write_text("hi\n")
    (ctx / "Dockerfile").write_text("ARG BASE\nFROM $BASE\nCOPY hello.txt /srv/\n")
    res = CliRunner().invoke(main, ["build", str(ctx), "--build-arg", f"BASE=oci:{busybox_oci}:bb", "--json",
                                    "-o", str(tmp_path / "cli.lock")])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["lock"] == str(tmp_path / "cli.lock") and len(doc["groups"]) == 1
    lock = wp.load_lock(str(tmp_path / "cli.lock"))
    assert lock.groups[-1].ref.split(":")[0].endswith("build-layers")
