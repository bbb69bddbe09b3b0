"""The image-side Docker routes through the unmodified docker package (docker-py): tag, remove,
commit, export and build, against ``weenv serve --docker`` in front of a real daemon, compared
with Debian's dockerd on the same calls where the answers are Docker's (tests/fixtures_docker.py)."""

from __future__ import annotations

import http.client
import io
import json
import os
import stat
import tarfile
import tempfile
import time
from collections.abc import Iterator

import pytest

from weenv.testing import DaemonHandle

from .fixtures_docker import INIT_LAYER_PATHS, Corpus
from .test_docker_api import IMAGE_CONFIG_KEYS, LABEL, DockerServed, real, serve_docker  # noqa: F401 - a fixture

docker = pytest.importorskip("docker")

pytestmark = [pytest.mark.integration]

CONTEXT_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def dk(weenv_daemon: DaemonHandle, docker_corpus: Corpus, registry) -> Iterator[DockerServed]:  # type: ignore[no-untyped-def]
    with serve_docker(weenv_daemon, docker_corpus, registry, "weenv-docker-images2-",
                      env={"WEENV_DOCKER_BUILD_CONTEXT_BYTES": str(CONTEXT_LIMIT)}) as served:
        yield served


@pytest.fixture
def alice(dk: DockerServed, daemon: DaemonHandle) -> Iterator["docker.DockerClient"]:
    c = dk.client("dk-alice")
    yield c
    for ct in c.containers.list(all=True):
        ct.remove(force=True)
    c.close()


@pytest.fixture
def bob(dk: DockerServed) -> Iterator["docker.DockerClient"]:
    c = dk.client("dk-bob")
    yield c
    for ct in c.containers.list(all=True):
        ct.remove(force=True)
    c.close()


def _status(call) -> int:  # type: ignore[no-untyped-def]
    with pytest.raises(docker.errors.APIError) as e:
        call()
    return e.value.status_code  # type: ignore[no-any-return]


def _clean_real(real, *refs: str) -> None:  # type: ignore[no-untyped-def]
    for ref in refs:
        try:
            real.images.remove(ref, force=True)
        except docker.errors.ImageNotFound:
            pass


# -- tag and remove ----------------------------------------------------------------------------------


def test_tag_and_remove_as_dockerd_answers(dk: DockerServed, alice, bob, real, docker_corpus: Corpus) -> None:  # type: ignore[no-untyped-def]
    ref = dk.image
    other = docker_corpus.tasks[-1].ref  # another repo's image, in the same registry
    mine, theirs = alice.images.pull(ref), real.images.get(ref)
    _clean_real(real, "weenv-test/tagged:v1", "weenv-test/tagged:latest")
    try:
        for img in (mine, theirs):
            assert img.tag("weenv-test/tagged", "v1") is True
            assert img.tag("weenv-test/tagged") is True  # no tag: latest
        for c in (alice, real):
            got = c.images.get("weenv-test/tagged:v1")
            assert got.id == theirs.id
            assert {ref, "weenv-test/tagged:v1", "weenv-test/tagged:latest"} <= set(got.tags)
            assert c.images.get("weenv-test/tagged").id == theirs.id  # repo alone: :latest
        # bad names: refused on both with dockerd's words (dockerd 20.10 says 500, later ones 400: weenv 400)
        for args, words in ((("Weenv-Test/UPPER", "v1"), "invalid reference format"),
                            (("weenv-test/x", "bad tag!"), "invalid tag format"),
                            (("weenv test", "v1"), "invalid reference format"),
                            (("weenv-test/x", ".dot"), "invalid tag format")):
            errors = []
            for c in (alice, real):
                with pytest.raises(docker.errors.APIError) as e:
                    c.api.tag(ref, *args)
                errors.append(e.value)
            assert errors[0].status_code == 400 and errors[1].status_code in (400, 500), args
            assert all(words in str(err.explanation) for err in errors), (args, errors)
        assert _status(lambda: alice.api.tag("nope/nope:1", "weenv-test/x", "v1")) == 404
        assert _status(lambda: real.api.tag("nope/nope:1", "weenv-test/x", "v1")) == 404
        # a key's tags are its own: bob's names mean what they meant before alice's tag
        assert alice.images.get(ref).tag(other) is True  # alice's name for repo-b's REF is repo-a's image
        assert alice.images.get(other).id == theirs.id
        assert bob.images.get(other).id == real.images.get(other).id != theirs.id
        with pytest.raises(docker.errors.ImageNotFound):
            bob.images.get("weenv-test/tagged:v1")
        with pytest.raises(docker.errors.ImageNotFound):
            bob.containers.create("weenv-test/tagged:v1", "true")
        assert _status(lambda: bob.images.remove("weenv-test/tagged:v1")) == 404
        # a container from a tag: the image it names
        ct = alice.containers.create("weenv-test/tagged:v1", "true", labels=LABEL)
        assert ct.attrs["Image"] == theirs.id and ct.attrs["Config"]["Image"] == "weenv-test/tagged:v1"
        rct = real.containers.create("weenv-test/tagged:v1", "true", labels=LABEL)
        # removing a tag that is not the last: untagged, on both
        for c in (alice, real):
            assert c.api.remove_image("weenv-test/tagged:v1") == [{"Untagged": "weenv-test/tagged:v1"}]
            with pytest.raises(docker.errors.ImageNotFound):
                c.images.get("weenv-test/tagged:v1")
        # by id, with several names: 409 (must be forced), on both
        for c in (alice, real):
            with pytest.raises(docker.errors.APIError) as e:
                c.images.remove(theirs.id)
            assert e.value.status_code == 409 and "referenced in multiple repositories" in str(e.value), str(e.value)
        with pytest.raises(docker.errors.ImageNotFound):
            alice.images.remove("nope/nope:1")
        with pytest.raises(docker.errors.ImageNotFound):
            real.images.remove("nope/nope:1")
        rct.remove()
        # weenv only (the corpus's images stay in that dockerd): the last names of an image in use
        alice.api.remove_image("weenv-test/tagged:latest")
        assert alice.api.remove_image(other) == [{"Untagged": other}]
        with pytest.raises(docker.errors.APIError) as e:
            alice.images.remove(ref)
        assert e.value.status_code == 409 and f"container {ct.id[:12]} is using its referenced image" in str(e.value)
        ct.start()
        ct.wait()
        answer = alice.api.remove_image(ref, force=True)  # a stopped container's image: forced, deleted
        assert answer == [{"Untagged": ref}, {"Deleted": theirs.id}]
        assert alice.images.list() == [] and ct.attrs["Image"] == theirs.id
        ct.remove()
        assert bob.images.get(other).id == real.images.get(other).id  # what bob saw never changed
    finally:
        _clean_real(real, "weenv-test/tagged:v1", "weenv-test/tagged:latest")


# -- commit --------------------------------------------------------------------------------------------

CHANGES = ["ENV FOO=bar", 'CMD ["cat", "/work/committed.txt"]', "WORKDIR /tmp", "LABEL weenv.committed=yes",
           "USER root", "EXPOSE 8080"]


def _commit_round(c, image: str):  # type: ignore[no-untyped-def]
    ct = c.containers.run(image, "sleep 300", detach=True, labels=LABEL, network_mode="none")
    ct.exec_run(["sh", "-c", "mkdir -p /work && echo committed-content > /work/committed.txt"])
    ct.pause()
    t = time.monotonic()
    img = ct.commit(repository="weenv-test/committed", tag="v1", message="a message", author="weenv test",
                    changes=CHANGES)  # a paused container: commit keeps it as it is
    print(f"commit ({'weenv' if '127.0.0.1' in str(c.api.base_url) else 'dockerd'}) "
          f"{time.monotonic() - t:.3f} s")
    ct.reload()
    assert ct.status == "paused"
    ct.unpause()
    out = c.containers.run("weenv-test/committed:v1", remove=True, network_mode="none")
    return ct, img, out


def test_commit_as_dockerd_answers(dk: DockerServed, alice, bob, real) -> None:  # type: ignore[no-untyped-def]
    _clean_real(real, "weenv-test/committed:v1")
    try:
        mct, mine, mout = _commit_round(alice, dk.image)
        rct, theirs, rout = _commit_round(real, dk.image)
        assert mout == rout == b"committed-content\n"
        a, b = mine.attrs, theirs.attrs
        for k in IMAGE_CONFIG_KEYS:
            assert a["Config"].get(k) == b["Config"].get(k), (k, a["Config"].get(k), b["Config"].get(k))
        for k in ("Comment", "Author", "Os", "Architecture", "Parent"):
            assert a[k] == b[k], k
        assert mine.tags == theirs.tags == ["weenv-test/committed:v1"]
        assert len(a["RootFS"]["Layers"]) == len(b["RootFS"]["Layers"])  # one layer more than the image's
        assert alice.images.get(mine.id[:19]).id == mine.id
        # a change that is not one: 400 on both; no container: 404 on both
        for c, ct in ((alice, mct), (real, rct)):
            assert _status(lambda: c.api.commit(ct.id, changes=["RUN echo no"])) == 400
            assert _status(lambda: c.api.commit("no-such-container")) == 404
        with pytest.raises(docker.errors.APIError) as e:
            alice.api.commit(mct.id, repository="Weenv/UPPER")
        assert e.value.status_code == 400
        # a commit without a name: an image without tags, as dockerd's
        bare = alice.api.commit(mct.id)
        assert alice.images.get(bare["Id"]).tags == [] and bare["Id"] in [i.id for i in
                                                                            alice.images.list(filters={"dangling": True})]
        # another key: the container and the image do not exist
        assert _status(lambda: bob.api.commit(mct.id)) == 404
        with pytest.raises(docker.errors.ImageNotFound):
            bob.containers.create("weenv-test/committed:v1", "true")
        with pytest.raises(docker.errors.ImageNotFound):
            bob.images.get(mine.id)
        mct.remove(force=True)
        rct.remove(force=True)
        assert alice.api.remove_image("weenv-test/committed:v1") == [{"Untagged": "weenv-test/committed:v1"},
                                                                     {"Deleted": mine.id}]
        with pytest.raises(docker.errors.ImageNotFound):
            alice.containers.create("weenv-test/committed:v1", "true")
    finally:
        _clean_real(real, "weenv-test/committed:v1")


# -- export --------------------------------------------------------------------------------------------


def _exported(ct) -> dict[str, tarfile.TarInfo]:  # type: ignore[no-untyped-def]
    with tempfile.TemporaryFile() as f:
        for chunk in ct.export():
            f.write(chunk)
        f.seek(0)
        with tarfile.open(fileobj=f, mode="r|") as tar:
            return {m.name.removeprefix("./").rstrip("/"): m for m in tar if m.name not in (".", "./")}


def test_export_as_dockerd_answers(dk: DockerServed, alice, bob, real) -> None:  # type: ignore[no-untyped-def]
    got = {}
    for c in (alice, real):
        ct = c.containers.create(dk.image, "true", labels=LABEL, network_mode="none")
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w") as t:
            ti = tarfile.TarInfo("exported.txt")
            ti.size, ti.mode = 3, 0o640
            t.addfile(ti, io.BytesIO(b"hi\n"))
        ct.put_archive("/work", data.getvalue())
        t = time.monotonic()
        got[c] = _exported(ct)
        print(f"export ({'weenv' if c is alice else 'dockerd'}): {len(got[c])} members, {time.monotonic() - t:.2f} s")
        if c is alice:
            assert _status(lambda: b"".join(bob.api.export(ct.id))) == 404  # a stream: raised when read
        ct.remove()
    mine, theirs = got[alice], got[real]
    mode = lambda m: stat.S_IMODE(m.mode)  # noqa: E731 - Go's tar writes the type bits too
    assert mode(mine["work/exported.txt"]) == mode(theirs["work/exported.txt"]) == 0o640
    names = lambda d: {n for n in d if n.split("/", 1)[0] not in ("proc", "sys", "dev")} - INIT_LAYER_PATHS  # noqa: E731
    assert names(mine) == names(theirs), (sorted(names(mine) - names(theirs))[:20],
                                          sorted(names(theirs) - names(mine))[:20])
    for n in ("usr/bin/python3", "work/repo/task/__init__.py", "etc/passwd", "bin"):
        assert (mine[n].type, mode(mine[n]), mine[n].size, mine[n].linkname) == \
            (theirs[n].type, mode(theirs[n]), theirs[n].size, theirs[n].linkname), n
    assert _status(lambda: b"".join(alice.api.export("no-such-container"))) == 404


# -- build ---------------------------------------------------------------------------------------------

DOCKERFILE = """\
FROM {image}
ARG GREETING=hello
ENV BUILT_WITH=$GREETING
RUN echo "$GREETING from the build" > /built.txt && echo "run output"
WORKDIR /work/app
COPY app.txt ./
LABEL weenv.built=yes
CMD ["cat", "/built.txt", "/work/app/app.txt"]
"""


def _context(tmp: str, image: str, dockerfile: str = "Dockerfile") -> str:
    os.makedirs(os.path.join(tmp, os.path.dirname(dockerfile) or "."), exist_ok=True)
    with open(os.path.join(tmp, dockerfile), "w") as f:
        f.write(DOCKERFILE.format(image=image))
    with open(os.path.join(tmp, "app.txt"), "w") as f:
        f.write("the app\n")
    return tmp


def _tar_of(dockerfile: bytes) -> bytes:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as t:
        ti = tarfile.TarInfo("Dockerfile")
        ti.size = len(dockerfile)
        t.addfile(ti, io.BytesIO(dockerfile))
    return data.getvalue()


def test_build_as_dockerd_answers(dk: DockerServed, alice, bob, real, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctx = _context(str(tmp_path / "ctx"), dk.image, "sub/Dockerfile.alt")
    _clean_real(real, "weenv-test/built:1")
    try:
        built = {}
        for c in (alice, real):
            t = time.monotonic()
            img, logs = c.images.build(path=ctx, dockerfile="sub/Dockerfile.alt", tag="weenv-test/built:1",
                                       buildargs={"GREETING": "hi"}, network_mode="none")
            print(f"build ({'weenv' if c is alice else 'dockerd'}) {time.monotonic() - t:.2f} s")
            logs = list(logs)
            text = "".join(x.get("stream", "") for x in logs)
            assert "Step 1/8 : FROM" in text and "Step 4/8 : RUN" in text and "run output" in text, text
            assert f"Successfully built {img.short_id.split(':', 1)[1]}" in text, text
            assert "Successfully tagged weenv-test/built:1" in text
            assert {"aux": {"ID": img.id}} in logs
            out = c.containers.run("weenv-test/built:1", remove=True, network_mode="none")
            built[c] = (img, out)
        (mine, mout), (theirs, rout) = built[alice], built[real]
        assert mout == rout == b"hi from the build\nthe app\n"
        for k in IMAGE_CONFIG_KEYS:
            assert mine.attrs["Config"].get(k) == theirs.attrs["Config"].get(k), k
        assert mine.tags == theirs.tags == ["weenv-test/built:1"]
        # a Dockerfile alone (fileobj), FROM an image of the key's own (the build above), quiet
        fileobj = io.BytesIO(b'FROM weenv-test/built:1\nCMD ["cat", "/work/app/app.txt"]\n')
        img2, _ = alice.images.build(fileobj=fileobj, tag="weenv-test/built:2", quiet=True)
        assert alice.containers.run(img2.id, remove=True, network_mode="none") == b"the app\n"
        # errors, as docker-py raises them: a failing RUN, an instruction weenv does not build
        for c in (alice, real):
            with pytest.raises(docker.errors.BuildError):
                c.images.build(fileobj=io.BytesIO(f"FROM {dk.image}\nRUN exit 3\n".encode()), network_mode="none")
        with pytest.raises(docker.errors.BuildError, match="VOLUME"):
            alice.images.build(fileobj=io.BytesIO(f"FROM {dk.image}\nVOLUME /data\n".encode()))
        # a tenant builds from registry images and its own, not from the node
        for base in ("/etc", "snap-0123456789abcdef", "oci:/var/lib", "weenv-test/built:1x"):
            with pytest.raises(docker.errors.BuildError) as e:
                alice.images.build(fileobj=io.BytesIO(f"FROM {base}\n".encode()))
            assert base in str(e.value) or "not an admin" in str(e.value), str(e.value)
        with pytest.raises(docker.errors.BuildError):  # bob has no image of that name
            bob.images.build(fileobj=io.BytesIO(b"FROM weenv-test/built:1\n"))
        with pytest.raises(docker.errors.ImageNotFound):
            bob.images.get("weenv-test/built:1")
        # bad input before the build: a bad tag, a missing Dockerfile, a body that is no tar, a big context
        with pytest.raises(docker.errors.DockerException, match="invalid tag"):  # docker-py checks it first
            alice.images.build(fileobj=io.BytesIO(b"FROM x\n"), tag="Bad Tag")
        r = alice.api._post(alice.api._url("/build"), params={"t": "Bad Tag"}, data=_tar_of(b"FROM x\n"),
                            headers={"Content-Type": "application/x-tar"})  # the server checks it too
        assert r.status_code == 400 and "invalid reference format" in r.json()["message"]
        with pytest.raises(docker.errors.APIError, match="Cannot locate specified Dockerfile: nope"):
            alice.images.build(path=ctx, dockerfile="nope")
        with pytest.raises(docker.errors.APIError, match="not a tar"):
            alice.images.build(fileobj=io.BytesIO(b"not a tar at all" * 100), custom_context=True)
        with open(os.path.join(ctx, "big.bin"), "wb") as f:
            f.write(os.urandom(CONTEXT_LIMIT + 1))
        with pytest.raises(docker.errors.APIError) as e:
            alice.images.build(path=ctx, dockerfile="sub/Dockerfile.alt")
        assert e.value.status_code == 413 and str(CONTEXT_LIMIT) in str(e.value), str(e.value)
        host, port = dk.served.url.split("://", 1)[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)  # the length alone is enough
        conn.putrequest("POST", "/v1.45/build")
        conn.putheader("Authorization", f"Bearer {dk.served.keys['dk-alice']}")
        conn.putheader("Content-Type", "application/x-tar")
        conn.putheader("Content-Length", str(CONTEXT_LIMIT * 100))
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == 413 and str(CONTEXT_LIMIT) in json.loads(r.read())["message"]
        conn.close()
    finally:
        _clean_real(real, "weenv-test/built:1")


# -- host binds ----------------------------------------------------------------------------------------


def test_binds_for_an_admin_are_read_only_host_mounts(dk: DockerServed, alice, real) -> None:  # type: ignore[no-untyped-def]
    import shutil

    host = tempfile.mkdtemp(prefix="weenv-binds-", dir="/var/tmp")
    try:
        os.chmod(host, 0o755)  # the env's root (a mapped uid) walks to it
        with open(os.path.join(host, "data.txt"), "w") as f:
            f.write("from the host\n")
        os.chmod(os.path.join(host, "data.txt"), 0o644)
        root = dk.client("root")
        script = "cat /mnt/shared/data.txt; { echo x > /mnt/shared/new; } 2>/dev/null || echo read-only"
        mounts = {}
        for c in (root, real):
            ct = c.containers.run(dk.image, ["sh", "-c", script], volumes={host: {"bind": "/mnt/shared", "mode": "ro"}},
                                  detach=True, labels=LABEL, network_mode="none")
            assert ct.wait()["StatusCode"] == 0
            assert ct.logs() == b"from the host\nread-only\n"
            ct.reload()
            mounts[c] = [{k: m[k] for k in ("Type", "Source", "Destination", "RW")} for m in ct.attrs["Mounts"]]
            assert ct.attrs["HostConfig"]["Binds"] == [f"{host}:/mnt/shared:ro"]
            ct.remove()
        assert mounts[root] == mounts[real] == [{"Type": "bind", "Source": host, "Destination": "/mnt/shared",
                                                 "RW": False}]
        assert not os.path.exists(os.path.join(host, "new"))
        ct = root.containers.run(dk.image, "cat /mnt/m/data.txt", detach=True, network_mode="none",
                                 mounts=[docker.types.Mount("/mnt/m", host, type="bind", read_only=True)])
        assert ct.wait()["StatusCode"] == 0 and ct.logs() == b"from the host\n"
        ct.remove()
        # what weenv does not bind: writable, a named volume, tmpfs; what the plan refuses: the host's /etc
        for kwargs in ({"volumes": {host: {"bind": "/mnt/x", "mode": "rw"}}}, {"volumes": [f"{host}:/mnt/x"]},
                       {"volumes": ["named:/mnt/x"]}, {"mounts": [docker.types.Mount("/mnt/x", None, type="tmpfs")]}):
            with pytest.raises(docker.errors.APIError) as e:
                root.containers.create(dk.image, "true", **kwargs)
            assert e.value.status_code == 501 and "HostConfig" in str(e.value), str(e.value)
        with pytest.raises(docker.errors.APIError) as e:
            root.containers.create(dk.image, "true", volumes=["/etc:/mnt/etc:ro"])
        assert e.value.status_code == 400 and "exposes the host" in str(e.value), str(e.value)
        # a tenant: no host paths at all
        with pytest.raises(docker.errors.APIError) as e:
            alice.containers.create(dk.image, "true", volumes=[f"{host}:/mnt/x:ro"])
        assert e.value.status_code == 403
        assert alice.containers.list(all=True) == []
    finally:
        shutil.rmtree(host, ignore_errors=True)


# -- bounded memory, a build's client going away ----------------------------------------------------------


def _hwm_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_export_streams_a_gib_in_bounded_memory(dk: DockerServed, alice, docker_corpus: Corpus,  # type: ignore[no-untyped-def]
                                               weenv_daemon: DaemonHandle) -> None:
    from weenv.provision.envs._archive import ChunkReader

    ct = alice.containers.create(docker_corpus.hard, "true", network_mode="none")
    pids = {"serve": dk.served.proc.pid, "daemon": weenv_daemon.proc.pid}
    before = {k: _hwm_bytes(p) for k, p in pids.items()}
    t = time.monotonic()
    sizes = {}
    sent = [0]

    def chunks() -> Iterator[bytes]:
        for chunk in ct.export(chunk_size=1 << 20):
            sent[0] += len(chunk)
            yield chunk

    with tarfile.open(fileobj=io.BufferedReader(ChunkReader(chunks()), 1 << 20), mode="r|") as tar:
        for m in tar:
            sizes[m.name.removeprefix("./")] = m.size
    grew = {k: _hwm_bytes(p) - before[k] for k, p in pids.items()}
    print(f"export of the hard image: {sent[0] / 2**20:.0f} MiB in {time.monotonic() - t:.1f} s; peak RSS grew "
          + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in grew.items()))
    assert sizes["hard/sparse"] == 1 << 30 and sent[0] > 1 << 30
    assert all(v < 256 << 20 for v in grew.values()), grew  # streamed: the GiB was never held
    ct.remove()


def test_a_build_whose_client_goes_away_stops(dk: DockerServed, alice) -> None:  # type: ignore[no-untyped-def]
    token = os.urandom(6).hex()
    dockerfile = f"FROM {dk.image}\nRUN echo first-{token} && sleep 2\nRUN echo second-{token}\n".encode()
    steps = os.path.join(dk.served.home, "cache", "docker-steps")
    cached = lambda: sum(len(fs) for _, _, fs in os.walk(steps))  # noqa: E731
    before = cached()
    with dk.served.daemon.client() as c:
        envs_before = {e.id for e in c.list()}
    host, port = dk.served.url.split("://", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = _tar_of(dockerfile)
    conn.request("POST", "/v1.45/build?networkmode=none", body=body,
                 headers={"Authorization": f"Bearer {dk.served.keys['dk-alice']}", "Content-Type": "application/x-tar"})
    r = conn.getresponse()
    assert r.status == 200
    seen = b""
    while b"first-" + token.encode() not in seen:  # RUN's output of the first step: the client goes
        line = r.readline()
        assert line, seen
        seen += line
    conn.close()
    for _ in range(600):  # the server says so once the first step ends
        if "its client went away" in dk.served.log():
            break
        time.sleep(0.2)
    assert "its client went away" in dk.served.log()
    assert cached() - before in (0, 1)  # the first RUN cut short at its next output, or built; never the second
    with dk.served.daemon.client() as c:
        assert {e.id for e in c.list()} <= envs_before  # the step's env killed, no other started
