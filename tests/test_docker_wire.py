"""The Docker API's I/O-free parts: the multiplexed stream framing, the path parse, signals."""

from __future__ import annotations

import socket

import pytest

from weenv.api._common import HttpError
from weenv.api._docker import API_VERSION, frame, is_docker_path, parse
from weenv.api._docker_containers import docker_time, signal_number


def test_frames_are_what_docker_py_reads() -> None:
    from docker.utils.socket import frames_iter

    raw = frame(1, b"out\n") + frame(2, b"err\n") + frame(1, b"") + frame(1, b"x" * 70000)
    a, b = socket.socketpair()
    try:
        a.sendall(raw)
        a.close()
        got = list(frames_iter(b, tty=False))
    finally:
        b.close()
    assert [(s, bytes(d)) for s, d in got if d] == [(1, b"out\n"), (2, b"err\n"), (1, b"x" * 70000)]
    assert frame(2, b"ab") == b"\x02\x00\x00\x00\x00\x00\x00\x02ab"


@pytest.mark.parametrize(("path", "docker"), [
    ("/v1.41/containers/json", True), ("/v1.45/_ping", True), ("/_ping", True), ("/containers/x/json", True),
    ("/exec/x/start", True), ("/version", True), ("/v1/envs", False), ("/v1", False), ("/sandboxes", False),
    ("/volumes", False), ("/templates/x", False), ("/health", False),
])
def test_which_paths_are_docker_s_on_the_tcp_listen(path: str, docker: bool) -> None:
    assert is_docker_path(path) is docker


def test_the_path_is_read_once() -> None:
    assert parse("/v1.41/containers/abc/json?x=1") == ((1, 41), ("containers", "abc", "json"))
    assert parse("/containers/a%3Ab/json") == (None, ("containers", "a:b", "json"))
    for bad in ("/v1.41/containers/a%2Fb/json", "/v1.41/containers/%2E%2E/json", "/v1.41/containers//json",
                "/v1.41/containers/a%00/json"):
        with pytest.raises(HttpError) as e:
            parse(bad)
        assert e.value.status == 400
    with pytest.raises(HttpError, match=f"too new. Maximum supported API version is {API_VERSION}"):
        parse("/v1.99/info")
    with pytest.raises(HttpError, match="too old"):
        parse("/v1.12/info")


def test_signals_and_times_as_docker_spells_them() -> None:
    assert signal_number("SIGKILL") == signal_number("KILL") == signal_number("9") == 9
    assert signal_number("term") == 15
    with pytest.raises(HttpError, match="Invalid signal: NOPE"):
        signal_number("NOPE")
    assert docker_time(0) == "0001-01-01T00:00:00Z"
    assert docker_time(1.5) == "1970-01-01T00:00:01.500000000Z"


def test_an_image_name_takes_the_segments_between_its_route_s_fixed_ones() -> None:
    from weenv.api._docker import DockerRoute

    async def handler(request, params):  # type: ignore[no-untyped-def]
        raise AssertionError

    inspect = DockerRoute("GET", ("images", "{name*}", "json"), handler)
    _, segments = parse("/v1.45/images/127.0.0.1:5000/corpus/repo-a:abc/json")
    assert inspect.match("GET", segments) == {"name": "127.0.0.1:5000/corpus/repo-a:abc"}
    assert inspect.match("GET", parse("/images/alpine/json")[1]) == {"name": "alpine"}
    assert inspect.match("GET", ("images", "json")) is None  # the list, not an image named ""
    assert inspect.match("GET", ("images", "a", "history")) is None
    assert inspect.match("POST", ("images", "a", "json")) is None
    with pytest.raises(HttpError):  # an encoded "/" is still refused: segments are joined only by the route
        parse("/images/a%2F..%2Fb/json")


def test_a_pull_s_ref_is_docker_s() -> None:
    from starlette.requests import Request

    from weenv.api._docker_images import _pull_ref

    def ref(query: str) -> str:
        return _pull_ref(Request({"type": "http", "query_string": query.encode(), "headers": []}))

    assert ref("fromImage=h:5000/a/b&tag=t1") == "h:5000/a/b:t1"
    assert ref("fromImage=h:5000/a/b") == "h:5000/a/b:latest"
    assert ref("fromImage=h:5000/a/b:t2") == "h:5000/a/b:t2"
    assert ref("fromImage=h/a&tag=sha256:" + "1" * 64) == "h/a@sha256:" + "1" * 64
    with pytest.raises(HttpError) as e:
        ref("fromSrc=-")
    assert e.value.status == 501
