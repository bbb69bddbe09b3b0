"""The I/O-free parts of the Docker API's image routes: Docker's reference grammar for tags,
``changes`` of a commit read by weenv's Dockerfile reader, and HostConfig binds as plan mounts."""

from __future__ import annotations

import pytest

from weenv.api._common import HttpError
from weenv.api._docker_commit import apply_changes
from weenv.api._docker_create import HostConfigBody, host_binds
from weenv.api._docker_images import normalized, tag_ref


@pytest.mark.parametrize(("repo", "tag", "want"), [
    ("x", "", "x:latest"), ("weenv-test/x", "v1", "weenv-test/x:v1"), ("127.0.0.1:5000/a/b", "1.0", "127.0.0.1:5000/a/b:1.0"),
    ("a/b:v2", "", "a/b:v2"), ("a__b/c-d.e", "T_1", "a__b/c-d.e:T_1"), ("localhost:5000/x", "", "localhost:5000/x:latest"),
])
def test_tags_docker_takes(repo: str, tag: str, want: str) -> None:
    assert tag_ref(repo, tag) == want


@pytest.mark.parametrize(("repo", "tag", "words"), [
    ("Upper/x", "v1", "must be lowercase"), ("a b", "", "invalid reference format"), ("a/", "", "invalid reference"),
    ("x", "bad tag", "invalid tag format"), ("x", ".v", "invalid tag format"), ("x", "t" * 129, "invalid tag format"),
    ("x@sha256:" + "0" * 64, "", "digest"), ("Host.example/x", "", ""), ("localhost/Up", "", "lowercase"), ("", "v1", "repository name is required"), ("a//b", "", "invalid reference"),
])
def test_tags_docker_refuses_are_400_naming_why(repo: str, tag: str, words: str) -> None:
    if repo == "Host.example/x":  # a host may have capitals (only the path must be lowercase)
        assert tag_ref(repo, tag) == "Host.example/x:latest"
        return
    with pytest.raises(HttpError) as e:
        tag_ref(repo, tag)
    assert e.value.status == 400 and words in e.value.message


def test_a_repo_alone_means_latest() -> None:
    assert normalized("a/b") == "a/b:latest" and normalized("h:5000/a") == "h:5000/a:latest"
    assert normalized("a:1") == "a:1" and normalized("a@sha256:00") == "a@sha256:00"


def test_changes_are_read_as_dockerfile_lines() -> None:
    base = {"Env": ["PATH=/bin", "A=1"], "Cmd": ["sh"], "WorkingDir": "/w", "Labels": {"old": "1"}}
    got = apply_changes(base, ["ENV B=$A-two C=3", 'CMD ["cat", "/f"]', "ENTRYPOINT /bin/run now", "WORKDIR sub",
                               "USER 1000:1000", "LABEL new=\"a b\"", "EXPOSE 8080 53/udp", "STOPSIGNAL SIGINT"])
    assert got["Env"] == ["PATH=/bin", "A=1", "B=1-two", "C=3"]
    assert got["Cmd"] == ["cat", "/f"] and got["Entrypoint"] == ["/bin/sh", "-c", "/bin/run now"]
    assert got["WorkingDir"] == "/w/sub" and got["User"] == "1000:1000" and got["StopSignal"] == "SIGINT"
    assert got["Labels"] == {"old": "1", "new": "a b"} and got["ExposedPorts"] == {"8080/tcp": {}, "53/udp": {}}
    assert base["Env"] == ["PATH=/bin", "A=1"]  # not changed in place
    assert apply_changes(base, []) == base and apply_changes(base, ["ENV X=1\nCMD true"])["Cmd"] == ["/bin/sh", "-c", "true"]


@pytest.mark.parametrize(("change", "words"), [
    ("RUN echo", "changes:2: RUN: not a change"), ("VOLUME /data", "VOLUME is not supported"),
    ("FROM other", "FROM is not a change"), ("EXPOSE nope", "is not PORT"), ("NOSUCH x", "unknown instruction"),
    ("ENV", "expected NAME=VALUE"),
])
def test_changes_that_are_not_ones_are_400_naming_the_line(change: str, words: str) -> None:
    with pytest.raises(HttpError) as e:
        apply_changes({}, ["ENV A=1", change, "CMD x"] if change != "FROM other" else [change])
    assert e.value.status == 400 and words in e.value.message, e.value.message


def test_binds_are_read_only_plan_mounts() -> None:
    hc = HostConfigBody(Binds=["/srv/data:/data:ro", "/srv/b:/b:ro,rprivate"],
                        Mounts=[{"Type": "bind", "Source": "/srv/c", "Target": "/c", "ReadOnly": True}])
    assert host_binds(hc) == [{"source": "/srv/data", "target": "/data"}, {"source": "/srv/b", "target": "/b"},
                              {"source": "/srv/c", "target": "/c"}]
    for binds, status, words in ((["/srv:/x"], 501, "writable"), (["/srv:/x:rw"], 501, "writable"),
                                 (["/srv:/x:ro,rw"], 501, "writable"), (["vol:/x:ro"], 501, "named volumes"),
                                 (["/srv:x:ro"], 400, "absolute"), (["/srv"], 400, "expected"),
                                 (["/srv:/x:ro,bogus"], 400, "unknown option")):
        with pytest.raises(HttpError) as e:
            host_binds(HostConfigBody(Binds=binds))
        assert e.value.status == status and words in e.value.message and "Binds[0]" in e.value.message, binds
    for mount, status in (({"Type": "tmpfs", "Target": "/t"}, 501), ({"Type": "bind", "Source": "/s", "Target": "/t"}, 501),
                          ({"Type": "bind", "Target": "/t", "ReadOnly": True}, 400), ("x", 400)):
        with pytest.raises(HttpError) as e:
            host_binds(HostConfigBody(Mounts=[mount]))
        assert e.value.status == status, mount
