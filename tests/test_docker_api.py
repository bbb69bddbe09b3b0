"""The unmodified docker package (docker-py, PyPI) against ``weenv serve --docker`` in front of a
real daemon: task images from the test registry (tests/fixtures_docker.py), real crun envs; a few
answers compared field by field with Debian's dockerd on the same calls."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from weenv.testing import DaemonHandle, Dockerd

from .fixtures_api import Served, start_serve, stop_serve
from .fixtures_docker import Corpus

docker = pytest.importorskip("docker")

pytestmark = [pytest.mark.integration]

API = "1.45"


@dataclass
class DockerServed:
    served: Served
    socket: str
    image: str
    config_dir: str

    @property
    def tcp(self) -> str:
        return "tcp://" + self.served.url.split("://", 1)[1]

    def client(self, key: str = "dk-alice", *, version: str = "auto") -> "docker.DockerClient":
        """docker-py on the TCP listen, the key sent as ``Authorization: Bearer`` through the
        ``HttpHeaders`` of a Docker config file (what a user writes into ~/.docker/config.json)."""
        path = os.path.join(self.config_dir, key)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"HttpHeaders": {"Authorization": f"Bearer {self.served.keys[key]}"}}, f)
        with _env(DOCKER_CONFIG=path):
            return docker.DockerClient(base_url=self.tcp, version=version, timeout=120)


@contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def serve_docker(daemon: DaemonHandle, corpus: Corpus, registry, prefix: str,  # type: ignore[no-untyped-def]
                 env: dict[str, str] | None = None) -> Iterator[DockerServed]:
    """``weenv serve --docker`` on a socket of its own before ``daemon``: keys dk-alice and dk-bob
    (tenants) and root (admin), made anew; ``env``: the serve process's extra environment."""
    from weenv.api import KeyStore

    store = KeyStore(os.path.join(daemon.home, "api"))
    keys = {}
    for name, admin in (("dk-alice", False), ("dk-bob", False), ("root", True)):
        if any(k.name == name for k in store.list()):
            store.revoke(name, envs="keep")
        keys[name] = store.create(name, admin=admin)
    work = tempfile.mkdtemp(prefix=prefix)
    sock = os.path.join(work, "run", "docker.sock")
    served = start_serve(daemon, keys, args=["--docker", f"unix://{sock}", "--registry", registry.host],
                         env=env)
    try:
        yield DockerServed(served, sock, corpus.tasks[0].ref, os.path.join(work, "config"))
    finally:
        stop_serve(served)
    assert not os.path.exists(sock), "the Docker socket outlived weenv serve"
    shutil.rmtree(work, ignore_errors=True)  # the clients' config files


@pytest.fixture(scope="module")
def dk(weenv_daemon: DaemonHandle, docker_corpus: Corpus, registry) -> Iterator[DockerServed]:  # type: ignore[no-untyped-def]
    with serve_docker(weenv_daemon, docker_corpus, registry, "weenv-docker-api-") as served:
        yield served


@pytest.fixture
def alice(dk: DockerServed, daemon: DaemonHandle) -> Iterator["docker.DockerClient"]:
    c = dk.client("dk-alice")
    yield c
    for ct in c.containers.list(all=True):
        ct.remove(force=True)
    c.close()


@pytest.fixture(scope="module")
def real(dockerd: Dockerd) -> Iterator["docker.DockerClient"]:
    c = docker.DockerClient(base_url=f"unix://{dockerd.sock}", version="1.41", timeout=120)
    yield c
    for ct in c.containers.list(all=True, filters={"label": "weenv-test=docker-api"}):
        ct.remove(force=True)
    c.close()


LABEL = {"weenv-test": "docker-api"}


def test_ping_version_and_negotiation(dk: DockerServed, daemon: DaemonHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    c = dk.client("dk-alice")
    assert c.ping() is True
    assert c.api.api_version == API  # version="auto": /version answered under the key
    v = c.version()
    assert v["ApiVersion"] == API and v["MinAPIVersion"] == "1.24" and v["Os"] == "linux" and v["Arch"]
    info = c.info()
    assert {"Containers", "ContainersRunning", "NCPU", "MemTotal", "OSType"} <= set(info)
    monkeypatch.setenv("DOCKER_HOST", dk.tcp)
    monkeypatch.setenv("DOCKER_CONFIG", os.path.join(dk.config_dir, "dk-alice"))
    assert docker.from_env(version="auto").ping() is True  # what a harness does with DOCKER_HOST alone
    pinned = docker.DockerClient(base_url=dk.tcp, version="1.41")  # no config file: the header by hand
    pinned.api.headers["Authorization"] = f"Bearer {dk.served.keys['dk-bob']}"
    assert pinned.ping() is True and pinned.containers.list() == []
    r = httpx.get(dk.served.url + "/_ping", headers={"Authorization": f"Bearer {dk.served.keys['dk-alice']}"})
    assert r.status_code == 200 and r.text == "OK" and r.headers["api-version"] == API
    r = httpx.get(dk.served.url + f"/v{API}/_ping")
    assert r.status_code == 401 and "Bearer" in r.json()["message"]
    r = httpx.get(dk.served.url + "/v1.99/version", headers={"Authorization": f"Bearer {dk.served.keys['root']}"})
    assert r.status_code == 400 and r.json() == {"message": f"client version 1.99 is too new. Maximum supported "
                                                            f"API version is {API}"}


def test_the_docker_socket(dk: DockerServed, daemon: DaemonHandle) -> None:
    st = os.stat(dk.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660 and st.st_uid == 0
    c = docker.DockerClient(base_url=f"unix://{dk.socket}", version="auto")
    assert c.ping() is True and c.api.api_version == API
    ct = c.containers.create(dk.image, "true", labels=LABEL)
    try:
        assert dk.client("root").containers.get(ct.id).id == ct.id  # an admin key sees the socket's
        with pytest.raises(docker.errors.NotFound):
            dk.client("dk-alice").containers.get(ct.id)
        with httpx.Client(transport=httpx.HTTPTransport(uds=dk.socket)) as raw:
            r = raw.get(f"http://d/v{API}/volumes")
        assert r.status_code == 501 and "GET /volumes" in r.json()["message"]  # Docker's, not E2B's, there
    finally:
        ct.remove(force=True)


def test_containers_run_answers_its_output(alice, dk: DockerServed) -> None:  # type: ignore[no-untyped-def]
    assert alice.containers.run(dk.image, "echo hi", remove=False) == b"hi\n"
    (ct,) = alice.containers.list(all=True)
    assert ct.status == "exited" and ct.attrs["State"]["ExitCode"] == 0
    assert ct.logs() == b"hi\n"
    out = alice.containers.run(dk.image, ["python3", "-m", "task"], remove=True)  # the image's workdir
    assert out == b"repo-a 0\n"
    assert len(alice.containers.list(all=True)) == 1  # remove=True removed it


def _flow(client, image: str) -> dict:  # type: ignore[no-untyped-def]
    ct = client.containers.create(image, ["sh", "-c", "echo out; echo err >&2; sleep 0.2; echo $A; pwd; exit 3"],
                                  environment={"A": "b"}, working_dir="/tmp", labels=LABEL, network_mode="none")
    created = client.api.inspect_container(ct.id)
    ct.start()
    result = ct.wait(timeout=60)
    done = client.api.inspect_container(ct.id)
    out = {"created": created, "done": done, "wait": result, "stdout": ct.logs(stdout=True, stderr=False),
           "stderr": ct.logs(stdout=False, stderr=True), "both": ct.logs(), "tail": ct.logs(tail=2, stderr=False),
           "tail_err": ct.logs(tail=2, stdout=False),
           "stamped": ct.logs(timestamps=True, stderr=False),
           "raw": client.api._get(client.api._url("/containers/{0}/logs", ct.id),  # the body as it came
                                  params={"stdout": 1, "stderr": 1}).content}
    ct.remove()
    return out


def test_create_start_wait_logs_as_dockerd_answers(alice, dk: DockerServed, real) -> None:  # type: ignore[no-untyped-def]
    mine, theirs = _flow(alice, dk.image), _flow(real, dk.image)
    for got in (mine, theirs):
        assert got["wait"] == {"StatusCode": 3, "Error": None}
        assert got["stdout"] == b"out\nb\n/tmp\n" and got["stderr"] == b"err\n"
        assert sorted(got["both"].splitlines()) == sorted(b"out\nerr\nb\n/tmp\n".splitlines())
        assert got["tail"] == b"b\n/tmp\n" and got["tail_err"] == b""  # the log's last lines, then the stream
        stamped = got["stamped"].splitlines(keepends=True)
        assert [line.split(b" ", 1)[1] for line in stamped] == [b"out\n", b"b\n", b"/tmp\n"]
        assert all(line[:4].isdigit() and line.split(b" ", 1)[0].endswith(b"Z") for line in stamped)
        assert got["created"]["State"]["Status"] == "created" and got["done"]["State"]["Status"] == "exited"
    for phase in ("created", "done"):
        a, b = mine[phase], theirs[phase]
        assert set(b["State"]) <= set(a["State"]), set(b["State"]) - set(a["State"])
        for k in ("Status", "Running", "Paused", "Restarting", "OOMKilled", "Dead", "ExitCode", "Error"):
            assert a["State"][k] == b["State"][k], (phase, k)
        assert (a["State"]["Pid"] == 0) == (b["State"]["Pid"] == 0)
        assert a["Path"] == b["Path"] and a["Args"] == b["Args"]
        for k in ("Image", "Cmd", "Entrypoint", "WorkingDir", "Tty", "Labels", "OpenStdin"):
            assert a["Config"][k] == b["Config"][k], k
        assert "A=b" in a["Config"]["Env"] and set(b["Config"]["Env"]) <= set(a["Config"]["Env"])
        assert a["Name"].startswith("/") and len(a["Id"]) == 64
    assert _frames(mine["raw"]) == _frames(theirs["raw"])  # the multiplexed frames, per stream (the order
    # between stdout and stderr is the order their pipes were read in, on both)


def _frames(raw: bytes) -> dict[int, list[bytes]]:
    """Docker's multiplexed stream read frame by frame (8-byte header: stream, 3 zero bytes, length)."""
    out: dict[int, list[bytes]] = {}
    while raw:
        assert raw[1:4] == b"\0\0\0", raw[:8]
        n = int.from_bytes(raw[4:8], "big")
        out.setdefault(raw[0], []).append(raw[8:8 + n])
        raw = raw[8 + n:]
    return {k: [b"".join(v)] for k, v in out.items()}


def _execs(client, image: str) -> dict:  # type: ignore[no-untyped-def]
    ct = client.containers.run(image, "sleep 300", detach=True, labels=LABEL, network_mode="none")
    try:
        plain = ct.exec_run("echo hi")
        demux = ct.exec_run(["sh", "-c", "echo a; echo b >&2; exit 4"], demux=True)
        env = ct.exec_run(["sh", "-c", "echo $X; pwd; id -u"], environment={"X": "y"}, workdir="/opt", user="1000")
        tty = ct.exec_run(["sh", "-c", "tty >/dev/null && echo term"], tty=True)
        streamed = ct.exec_run(["sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.2; done"], stream=True)
        chunks = list(streamed.output)
        eid = client.api.exec_create(ct.id, ["sh", "-c", "exit 7"])["Id"]
        client.api.exec_start(eid)
        inspected = client.api.exec_inspect(eid)
        return {"plain": tuple(plain), "demux": tuple(demux), "env": tuple(env), "tty": tuple(tty),
                "stream": (streamed.exit_code, b"".join(chunks), len(chunks)), "inspect": inspected}
    finally:
        ct.remove(force=True)


def test_exec_run_as_dockerd_answers(alice, dk: DockerServed, real) -> None:  # type: ignore[no-untyped-def]
    mine, theirs = _execs(alice, dk.image), _execs(real, dk.image)
    for got in (mine, theirs):
        assert got["plain"] == (0, b"hi\n")
        assert got["demux"] == (4, (b"a\n", b"b\n"))
        assert got["env"] == (0, b"y\n/opt\n1000\n")
        assert got["tty"] == (0, b"term\r\n")
        assert got["stream"][0] is None and got["stream"][1] == b"1\n2\n3\n"
        assert got["inspect"]["ExitCode"] == 7 and got["inspect"]["Running"] is False
    assert mine["stream"][2] >= 2  # it came as it was written, not at the end
    assert set(theirs["inspect"]) <= set(mine["inspect"]) | {"CanRemove"}, set(theirs["inspect"]) - set(mine["inspect"])
    for k in ("Running", "ExitCode", "OpenStdin", "OpenStdout", "OpenStderr"):
        assert mine["inspect"][k] == theirs["inspect"][k], k


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_put_and_get_archive(alice, dk: DockerServed) -> None:  # type: ignore[no-untyped-def]
    ct = alice.containers.create(dk.image, "sleep 300")
    assert ct.put_archive("/work/repo", _tar({"task/__main__.py": b"print('patched')\n"})) is True  # before start
    ct.start()
    assert ct.exec_run("python3 -m task") == (0, b"patched\n")
    stream, st = ct.get_archive("/work/repo/task/__main__.py")
    assert st["name"] == "__main__.py" and st["size"] == 17
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        assert tar.extractfile("__main__.py").read() == b"print('patched')\n"  # type: ignore[union-attr]
    _, st = ct.get_archive("/work/repo")
    assert st["mode"] & (1 << 31)  # Go's ModeDir
    with pytest.raises(docker.errors.NotFound, match="Could not find the file /nope"):
        ct.get_archive("/nope")
    with pytest.raises(docker.errors.NotFound):
        ct.put_archive("/nope", _tar({"a": b"a"}))
    with pytest.raises(docker.errors.APIError, match="not a directory"):
        ct.put_archive("/work/repo/README.md", _tar({"a": b"a"}))
    r = httpx.head(f"{dk.served.url}/v{API}/containers/{ct.id}/archive", params={"path": "/work/repo/README.md"},
                   headers={"Authorization": f"Bearer {dk.served.keys['dk-alice']}"})
    assert r.status_code == 200 and json.loads(base64.b64decode(r.headers["x-docker-container-path-stat"]))["name"] \
        == "README.md"


def test_list_filters_stop_kill_remove(alice, dk: DockerServed) -> None:  # type: ignore[no-untyped-def]
    a = alice.containers.run(dk.image, "sleep 300", detach=True, labels={"grp": "x", "n": "1"}, name="dk-a")
    b = alice.containers.run(dk.image, "sleep 300", detach=True, labels={"grp": "y"})
    c = alice.containers.create(dk.image, "true", labels={"grp": "x"})
    assert {x.id for x in alice.containers.list()} == {a.id, b.id}  # running only
    assert {x.id for x in alice.containers.list(all=True, filters={"label": "grp=x"})} == {a.id, c.id}
    assert [x.id for x in alice.containers.list(filters={"label": ["grp=x", "n"]})] == [a.id]
    assert [x.id for x in alice.containers.list(all=True, filters={"status": "created"})] == [c.id]
    assert alice.containers.get("dk-a").id == a.id and alice.containers.get(a.id[:12]).id == a.id
    with pytest.raises(docker.errors.APIError) as e:
        alice.containers.list(filters={"ancestor": "x"})
    assert e.value.status_code == 400 and "ancestor" in str(e.value)
    with pytest.raises(docker.errors.APIError) as e:
        a.remove()
    assert e.value.status_code == 409 and "running container" in str(e.value)
    a.kill()
    assert a.wait(timeout=30)["StatusCode"] == 137
    with pytest.raises(docker.errors.APIError) as e:
        a.kill()
    assert e.value.status_code == 409
    with pytest.raises(docker.errors.APIError) as e:
        a.exec_run("true")
    assert e.value.status_code == 409 and "is not running" in str(e.value)
    b.stop(timeout=5)  # sleep dies on SIGTERM
    b.reload()
    assert b.status == "exited" and b.attrs["State"]["ExitCode"] == 143
    for x in (a, b, c):
        x.remove()
    assert alice.containers.list(all=True) == []
    with pytest.raises(docker.errors.NotFound, match=f"No such container: {a.id}"):
        alice.containers.get(a.id)
    with pytest.raises(docker.errors.APIError) as e:
        alice.containers.run(dk.image, "true", name="dk/a")
    assert e.value.status_code == 400


def test_another_keys_containers_do_not_exist(dk: DockerServed, alice) -> None:  # type: ignore[no-untyped-def]
    bob = dk.client("dk-bob")
    ct = alice.containers.run(dk.image, "sleep 300", detach=True)
    eid = alice.api.exec_create(ct.id, "true")["Id"]
    assert bob.containers.list(all=True) == []
    for call in (lambda: bob.containers.get(ct.id), lambda: bob.api.exec_create(ct.id, "true"),
                 lambda: bob.api.exec_inspect(eid), lambda: bob.api.kill(ct.id),
                 lambda: bob.api.remove_container(ct.id),
                 lambda: bob.api.get_archive(ct.id, "/"), lambda: bob.api.logs(ct.id)):
        with pytest.raises(docker.errors.NotFound):
            call()
    assert alice.containers.get(ct.id).status == "running"
    with pytest.raises(docker.errors.APIError) as e:
        bob.containers.create(dk.image, "true", volumes={"/etc": {"bind": "/host-etc", "mode": "ro"}})
    assert e.value.status_code == 403 and "admin" in str(e.value)
    headers = {"Authorization": f"Bearer {dk.served.keys['dk-alice']}"}
    r = httpx.get(f"{dk.served.url}/v{API}/containers/{ct.id[:8]}%2F..%2F{ct.id[8:]}/json", headers=headers)
    assert r.status_code == 400 and "message" in r.json()


def test_what_is_not_served_says_so(alice, dk: DockerServed) -> None:  # type: ignore[no-untyped-def]
    for call, what in ((alice.networks.list, "GET /networks"), (lambda: alice.api.push("x/y"),
                                                                 "POST /images/x/y/push")):
        with pytest.raises(docker.errors.APIError) as e:
            call()
        assert e.value.status_code == 501 and what in str(e.value), str(e.value)
    with pytest.raises(docker.errors.NotFound, match="No such container: nope"):
        alice.containers.get("nope")
    with pytest.raises(docker.errors.APIError) as e:
        alice.containers.create(dk.image, "true", stdin_open=True, privileged=True)
    assert e.value.status_code == 501 and "Privileged" in str(e.value)
    with pytest.raises(docker.errors.NotFound, match="No such image"):
        alice.containers.create(dk.image.rsplit(":", 1)[0] + ":no-such-tag", "true")


def test_a_swe_bench_style_round(alice, dk: DockerServed) -> None:  # type: ignore[no-untyped-def]
    """As the SWE-bench harness does it: a container from the task image that idles, the patch
    copied in, applied, the tests run under a timeout into a log, the log read, kill, remove."""
    ct = alice.containers.create(dk.image, command="tail -f /dev/null", name="sweb.eval.t1", detach=True,
                                 mem_limit="512m", nano_cpus=1_000_000_000, labels={"swe": "1"})
    ct.start()
    patch = b"from task import REPO\nprint(REPO, 'fixed')\n"
    ct.put_archive("/tmp", _tar({"patch/__main__.py": patch, "eval.sh": b"cd /work/repo && python3 -m task\n"}))
    assert ct.exec_run("cp /tmp/patch/__main__.py /work/repo/task/__main__.py").exit_code == 0
    res = ct.exec_run(["sh", "-c", "timeout 30 sh /tmp/eval.sh > /tmp/test_output.txt 2>&1; echo $?"])
    assert res == (0, b"0\n")
    assert ct.exec_run("cat /tmp/test_output.txt").output == b"repo-a fixed\n"
    slow = ct.exec_run(["sh", "-c", "timeout 1 sleep 30; echo $?"])
    assert slow.output == b"124\n"
    env_id = ct.attrs["GraphDriver"]["Data"]["EnvId"]  # the weenv env under it, as /v1 shows it
    env = httpx.get(f"{dk.served.url}/v1/envs/{env_id}",
                    headers={"Authorization": f"Bearer {dk.served.keys['dk-alice']}"}).json()
    print(env.get("resources"))
    assert str(512 << 20) in json.dumps(env["resources"]), env["resources"]
    ct.kill()
    ct.remove()
    with pytest.raises(docker.errors.NotFound):
        alice.containers.get("sweb.eval.t1")



IMAGE_CONFIG_KEYS = ("Cmd", "Entrypoint", "Env", "WorkingDir", "User", "ExposedPorts", "Labels")


def test_images_pull_get_list_history_as_dockerd_answers(dk: DockerServed, alice, real) -> None:  # type: ignore[no-untyped-def]
    import time

    ref = dk.image
    t = time.monotonic()
    pulled = alice.images.pull(ref.rsplit(":", 1)[0], tag=ref.rsplit(":", 1)[1])
    print(f"pull {time.monotonic() - t:.3f} s")
    theirs = real.images.get(ref)  # built and pushed by that dockerd: in its store
    assert pulled.id == theirs.id  # the config digest, on both
    mine = alice.images.get(ref)
    assert mine.id == theirs.id and ref in mine.tags
    a, b = mine.attrs, theirs.attrs
    for k in IMAGE_CONFIG_KEYS:
        assert a["Config"].get(k) == b["Config"].get(k), k  # dockerd 20.10 leaves out an empty ExposedPorts
    for k in ("Os", "Architecture", "Created", "Author"):
        assert a[k] == b[k], k
    assert a["RootFS"] == b["RootFS"] and a["Size"] > 0
    assert [h["CreatedBy"] for h in mine.history()] == [h["CreatedBy"] for h in theirs.history()]
    assert [i.id for i in alice.images.list()] == [theirs.id]
    assert alice.images.list(name="nope/*") == []
    t = time.monotonic()
    lines = list(alice.api.pull(ref, stream=True, decode=True))
    print(f"second pull {time.monotonic() - t:.3f} s")
    assert lines[-1] == {"status": f"Status: Image is up to date for {ref}"}, lines
    t = time.monotonic()
    ct = alice.containers.create(ref, "true")  # a create after the pull: the same image id
    print(f"create after the pull {time.monotonic() - t:.3f} s")
    assert ct.attrs["Image"] == theirs.id and ct.image.id == theirs.id
    ct.remove()
    assert dk.client("dk-bob").images.list() == []  # another key's images are not listed
    for missing in (ref.rsplit(":", 1)[0] + ":no-such-tag", "sha256:" + "0" * 64):
        with pytest.raises(docker.errors.ImageNotFound, match=f"No such image: {missing}"):
            alice.images.get(missing)
    with pytest.raises(docker.errors.NotFound):
        alice.images.pull(ref.rsplit(":", 1)[0], tag="no-such-tag")


def _lifecycle(client, image: str) -> dict:  # type: ignore[no-untyped-def]
    ct = client.containers.run(image, "sleep 300", detach=True, labels=LABEL, network_mode="none")
    try:
        top = ct.top()
        ct.pause()
        ct.reload()
        paused = dict(ct.attrs["State"])
        with pytest.raises(docker.errors.APIError) as e:
            ct.exec_run("true")
        paused_exec = e.value.status_code
        listed = [x.status for x in client.containers.list(filters={"status": "paused", "label": "weenv-test"})]
        ct.unpause()
        ct.reload()
        unpaused = dict(ct.attrs["State"])
        stats = ct.stats(stream=False)
        started = ct.attrs["State"]["StartedAt"]
        ct.restart(timeout=2)
        ct.reload()
        restarted = (ct.status, ct.attrs["State"]["StartedAt"] != started, ct.exec_run("echo up").output)
        ct.rename(f"renamed-{ct.id[:8]}")
        renamed = client.containers.get(f"renamed-{ct.id[:8]}").id == ct.id
        return {"top": top, "paused": paused, "paused_exec": paused_exec, "listed": listed, "unpaused": unpaused,
                "stats": stats, "restarted": restarted, "renamed": renamed}
    finally:
        ct.remove(force=True)


def test_pause_top_stats_restart_rename_as_dockerd_answers(dk: DockerServed, alice, real) -> None:  # type: ignore[no-untyped-def]
    mine, theirs = _lifecycle(alice, dk.image), _lifecycle(real, dk.image)
    print(mine["top"], mine["stats"])
    for got in (mine, theirs):
        assert got["paused"]["Status"] == "paused" and got["paused"]["Paused"] is True and got["paused"]["Running"]
        assert got["unpaused"]["Status"] == "running" and got["unpaused"]["Paused"] is False
        assert got["paused_exec"] == 409 and got["listed"] == ["paused"]
        assert got["restarted"] == ("running", True, b"up\n") and got["renamed"]
        assert got["stats"]["memory_stats"]["usage"] > 0 and got["stats"]["memory_stats"]["limit"] > 0
        assert got["stats"]["pids_stats"]["current"] >= 1
        assert isinstance(got["stats"]["cpu_stats"]["cpu_usage"]["total_usage"], int)
    assert mine["top"]["Titles"] == theirs["top"]["Titles"]
    cmd = mine["top"]["Titles"].index("CMD")
    assert "sleep 300" in [p[cmd] for p in mine["top"]["Processes"]]
    assert "sleep 300" in [p[cmd] for p in theirs["top"]["Processes"]]
    assert set(theirs["stats"]) <= set(mine["stats"]) | {"networks"}, set(theirs["stats"]) - set(mine["stats"])


def test_another_keys_container_is_404_on_the_lifecycle_routes(dk: DockerServed, alice) -> None:  # type: ignore[no-untyped-def]
    bob = dk.client("dk-bob")
    ct = alice.containers.run(dk.image, "sleep 300", detach=True, name="dk-life")
    for call in (lambda: bob.api.pause(ct.id), lambda: bob.api.unpause(ct.id), lambda: bob.api.top(ct.id),
                 lambda: bob.api.stats(ct.id, stream=False), lambda: bob.api.restart(ct.id),
                 lambda: bob.api.rename(ct.id, "stolen"), lambda: bob.api.top("dk-life")):
        with pytest.raises(docker.errors.NotFound):
            call()
    assert alice.containers.get(ct.id).name == "dk-life" and alice.containers.get(ct.id).status == "running"
    other = alice.containers.create(dk.image, "true")
    with pytest.raises(docker.errors.APIError) as e:
        other.rename("dk-life")
    assert e.value.status_code == 409 and "already in use" in str(e.value)
    with pytest.raises(docker.errors.APIError) as e:
        other.pause()
    assert e.value.status_code == 409 and "is not running" in str(e.value)


def _events(client, image: str) -> dict:  # type: ignore[no-untyped-def]
    import time

    t0 = time.time()
    ct = client.containers.create(image, ["sh", "-c", "exit 2"], labels=LABEL, network_mode="none")
    live = client.events(decode=True, filters={"container": ct.id, "event": "start"})
    ct.start()
    first = next(live)
    live.close()
    ct.wait(timeout=30)
    ct.remove()
    time.sleep(0.1)
    until = time.time() + 0.5
    got = list(client.events(since=t0, until=until, decode=True, filters={"container": ct.id}))
    return {"id": ct.id, "live": first, "all": got}


def test_events_as_dockerd_answers(dk: DockerServed, alice, real) -> None:  # type: ignore[no-untyped-def]
    import time

    t0 = time.time()
    mine, theirs = _events(alice, dk.image), _events(real, dk.image)
    for got in (mine, theirs):
        assert got["live"]["Action"] == "start" and got["live"]["id"] == got["id"]
        assert [e["Action"] for e in got["all"]] == ["create", "start", "die", "destroy"], got["all"]
        die = got["all"][2]["Actor"]["Attributes"]
        assert die["exitCode"] == "2" and die["weenv-test"] == "docker-api" and die["image"] == dk.image
    for a, b in zip(mine["all"], theirs["all"]):
        assert set(b) <= set(a), set(b) - set(a)
        assert set(b["Actor"]["Attributes"]) <= set(a["Actor"]["Attributes"]) | {"execDuration"}
    bob = dk.client("dk-bob")
    assert [e for e in bob.events(since=t0, until=time.time() + 0.2, decode=True)
            if e.get("id") == mine["id"]] == []  # another key's containers' events are not shown


def test_every_container_route_wants_a_key_and_reads_a_twice_encoded_id_as_refused(  # type: ignore[no-untyped-def]
        dk: DockerServed, alice) -> None:
    """No key: 401 on every route (even /_ping). An id whose separators are percent-encoded twice
    (`%252F`) is one segment naming no container: 400 or 404, never alice's container through it."""
    ct = alice.containers.run(dk.image, "sleep 300", detach=True)
    eid = alice.api.exec_create(ct.id, "true")["Id"]
    routes = [("GET", "/_ping"), ("GET", "/version"), ("GET", "/containers/json"), ("GET", "/images/json"),
              ("GET", "/events"), ("POST", "/containers/create"), ("POST", "/commit"), ("POST", "/build")]
    per_id = [("GET", "/containers/{}/json"), ("GET", "/containers/{}/logs"), ("POST", "/containers/{}/kill"),
              ("POST", "/containers/{}/stop"), ("POST", "/containers/{}/restart"), ("POST", "/containers/{}/pause"),
              ("POST", "/containers/{}/unpause"), ("GET", "/containers/{}/top"), ("GET", "/containers/{}/stats"),
              ("POST", "/containers/{}/rename"), ("GET", "/containers/{}/archive"), ("PUT", "/containers/{}/archive"),
              ("POST", "/containers/{}/exec"), ("DELETE", "/containers/{}"), ("GET", "/exec/{}/json"),
              ("POST", "/containers/{}/attach"), ("POST", "/containers/{}/resize"), ("GET", "/containers/{}/export"),
              ("POST", "/exec/{}/start"), ("POST", "/exec/{}/resize")]
    with httpx.Client(timeout=30) as h:
        for method, path in [*routes, *((m, p.format(ct.id)) for m, p in per_id)]:
            for prefix in ("", f"/v{API}"):
                r = h.request(method, dk.served.url + prefix + path)
                assert r.status_code == 401 and "message" in r.json(), (method, prefix + path, r.status_code)
        key = {"Authorization": f"Bearer {dk.served.keys['dk-alice']}"}
        for method, path in per_id:
            target = eid if path.startswith("/exec") else ct.id
            for twice in (f"x%252F..%252F{target}", f"{target[:6]}%252F{target[6:]}", f"%252E%252E%252F{target}"):
                r = h.request(method, f"{dk.served.url}/v{API}" + path.format(twice), headers=key,
                              params={"path": "/", "name": "n"})
                assert r.status_code in (400, 404), (method, path.format(twice), r.status_code, r.text[:200])
    assert alice.containers.get(ct.id).status == "running"  # nothing above reached it
    ct.kill()


def test_exec_output_waits_until_the_client_read_the_101_on_the_socket(dk: DockerServed, daemon: DaemonHandle) -> None:
    """docker-py reads the 101's headers through a buffered reader and the output from the socket
    under it: output already on the socket when it reads the headers is lost to it (docker-py
    #3332). A client that reads nothing for a while after its exec start must find only the
    headers in its first read, the output after them."""
    import socket
    import time

    from docker.utils.socket import frames_iter

    client = docker.DockerClient(base_url=f"unix://{dk.socket}", version=API, timeout=60)
    ct = client.containers.run(dk.image, "sleep 300", detach=True, labels=LABEL)
    try:
        exec_id = client.api.exec_create(ct.id, ["echo", "hi"])["Id"]
        body = b'{"Detach": false, "Tty": false}'
        s = socket.socket(socket.AF_UNIX)
        s.connect(dk.socket)
        with s:
            s.sendall(b"POST /v%s/exec/%s/start HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json\r\n"
                      b"Connection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: %d\r\n\r\n%s"
                      % (API.encode(), exec_id.encode(), len(body), body))
            time.sleep(0.5)  # echo ran and ended long since
            first = s.recv(1 << 16)
            assert first.startswith(b"HTTP/1.1 101") and first.endswith(b"\r\n\r\n"), first
            frames = [(stream, bytes(data)) for stream, data in frames_iter(s, tty=False) if data]
        assert frames == [(1, b"hi\n")], frames
        assert client.api.exec_inspect(exec_id)["ExitCode"] == 0
    finally:
        ct.remove(force=True)
        client.close()
