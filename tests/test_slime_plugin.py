"""slime plugin: parsers, settings, token bookkeeping (pure); the sandbox and whole episodes against a
real weenv daemon with a fake SGLang server; slime's own code when it is importable."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

import slime_plugin
from slime_plugin import (
    BashBlockParser,
    CallResult,
    CommandFailedError,
    ConfigError,
    HermesToolCallParser,
    WeenvSandbox,
    load_parser,
    resolve_env_spec,
    resolve_rollout_settings,
)
from slime_plugin import rollout as plugin_rollout
from slime_plugin._episode import append_tokens, clip_output, evaluator_reward, mark_aborted, merge_stop, reset_response
from slime_plugin._groups import GroupTemplates
from slime_plugin._sglang import parse_generate_response
from tests.fixtures_slime import LegacySample, Reply, Sample, sampling_params, slime_args, train_side_checks, turns


def run(coro):
    """Run a coroutine on a fresh loop and close the plugin's clients of that loop afterwards."""

    async def main():
        try:
            return await coro
        finally:
            await plugin_rollout.aclose()

    return asyncio.run(main())


# =========================================================================== public surface


def test_public_api_is_pinned():
    assert sorted(n for n in dir(slime_plugin) if not n.startswith("_") and n[0].isupper() or n in (
        "load_parser", "resolve_env_spec", "resolve_rollout_settings")) == sorted([
        "Action", "BashBlockParser", "CallResult", "CapacityError", "CommandFailedError", "ConfigError", "EnvSpec",
        "EvaluatorSpec", "GenerationAborted", "GenerationError", "GradingError", "HermesToolCallParser",
        "RolloutSettings", "SandboxError", "SandboxNotStartedError", "SlimePluginError", "SnapshotUnavailableError",
        "ToolCall", "ToolCallParser", "WeenvSandbox", "load_parser", "resolve_env_spec", "resolve_rollout_settings"])
    assert plugin_rollout.__all__ == ["RUN_KEY", "aclose", "generate", "reward", "statistics"]
    import inspect

    from slime_plugin import sandbox

    assert list(inspect.signature(sandbox.WeenvSandbox.exec).parameters) == [
        "self", "cmd", "user", "env", "timeout", "check", "idempotent"]
    assert list(inspect.signature(plugin_rollout.generate).parameters) == ["args", "sample", "sampling_params",
                                                                          "evaluation"]


# =========================================================================== parsers (pure)


def test_bash_parser_calls_answer_and_errors():
    p = BashBlockParser()
    a = p.parse("I will look.\n<bash>ls -la /tmp</bash>")
    assert [c.command for c in a.calls] == ["ls -la /tmp"] and a.answer is None and a.error is None
    a = p.parse("<bash>echo 1</bash> then <bash>echo 2</bash>")
    assert [c.command for c in a.calls] == ["echo 1", "echo 2"]
    a = p.parse("done <answer> 42 </answer>")
    assert a.calls == () and a.answer == "42"
    assert p.parse("<bash>   </bash>").error is not None
    assert p.parse("<bash>ls -la").error is not None
    assert p.parse("just talking").calls == () and p.parse("just talking").answer is None
    many = "".join(f"<bash>echo {i}</bash>" for i in range(9))
    assert p.parse(many).calls == () and "at most 8" in p.parse(many).error
    assert set(p.stop) == {"</bash>", "</answer>"}


def test_bash_parser_renders_exit_code_output_and_timeout():
    p = BashBlockParser()
    text = p.render_observation([CallResult("ls", 0, "a\nb"), CallResult("sleep 9", 137, "", timed_out=True,
                                                                       timeout_s=2.0)])
    assert '<output exit_code="0">\na\nb\n</output>' in text
    assert '<output exit_code="137">\n[command timed out after 2 s and was killed]\n</output>' in text
    assert p.render_observation([], error="bad").strip() == "<error>bad</error>"


def test_hermes_parser():
    p = HermesToolCallParser()
    a = p.parse('<tool_call>{"name": "bash", "arguments": {"command": "pwd"}}</tool_call>')
    assert [c.command for c in a.calls] == ["pwd"]
    a = p.parse('<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"id\\"}"}</tool_call>')
    assert [c.command for c in a.calls] == ["id"]
    a = p.parse('<tool_call>{"name": "submit", "arguments": {"answer": "7"}}</tool_call>')
    assert a.answer == "7" and a.calls == ()
    assert "not valid JSON" in p.parse("<tool_call>{nope}</tool_call>").error
    assert "unknown tool" in p.parse('<tool_call>{"name": "browse", "arguments": {}}</tool_call>').error
    assert "command" in p.parse('<tool_call>{"name": "bash", "arguments": {}}</tool_call>').error
    assert "<tool_response>\nexit_code: 3\nx\n</tool_response>" in p.render_observation([CallResult("c", 3, "x")])


class _EchoParser:
    stop = ()

    def parse(self, text):
        return slime_plugin.Action()

    def render_observation(self, results, *, error=None):
        return ""


def make_echo_parser():
    return _EchoParser()


def make_not_a_parser():
    return object()


def test_load_parser_builtin_dotted_and_errors():
    assert isinstance(load_parser("bash"), BashBlockParser)
    assert isinstance(load_parser("tests.test_slime_plugin.make_echo_parser"), _EchoParser)
    with pytest.raises(ValueError, match="unknown parser"):
        load_parser("nope")
    with pytest.raises(ValueError, match="cannot load"):
        load_parser("tests.no_such_module.factory")
    with pytest.raises(ValueError, match="has no parse, render_observation"):
        load_parser("tests.test_slime_plugin.make_not_a_parser")
    with pytest.raises(ValueError, match="factory .* failed"):
        load_parser("tests.test_slime_plugin.run")  # needs an argument


# =========================================================================== settings (pure)


def test_settings_lookup_order_metadata_args_env_default():
    args = SimpleNamespace(weenv_plan="args.lock", weenv_max_turns=5, weenv_command_timeout_s=3.0,
                           weenv_evaluator={"command": "true", "timeout_s": 9})
    sample = Sample(metadata={"weenv": {"max_turns": 2, "evaluator": {"command": "test -f /x"}}})
    spec = resolve_env_spec(args, sample, environ={"WEENV_MAX_OBSERVATION_BYTES": "100", "WEENV_MAX_TURNS": "99",
                                                   "WEENV_SETUP": '["echo a"]'})
    assert spec.plan == "args.lock"  # args
    assert spec.max_turns == 2  # metadata beats args and env
    assert spec.command_timeout_s == 3.0
    assert spec.max_observation_bytes == 100  # env var, converted to int
    assert spec.setup == ["echo a"]  # env var as JSON
    assert spec.evaluator.command == "test -f /x" and spec.evaluator.timeout_s == 9  # merged key by key
    assert spec.user == "root" and spec.group_fork is True  # defaults
    # metadata given as a JSON string (datasets often store it so)
    spec = resolve_env_spec(SimpleNamespace(), Sample(metadata={"weenv": json.dumps({"snapshot": "snap-1"})}),
                            environ={})
    assert spec.snapshot == "snap-1"


@pytest.mark.parametrize("args, metadata, environ, location", [
    (SimpleNamespace(weenv_plan="p", weenv_max_turn=3), {}, {}, "args.weenv_max_turn"),
    (SimpleNamespace(weenv_plan="p"), {"max_turns": "many"}, {}, "metadata.weenv.max_turns"),
    (SimpleNamespace(weenv_plan="p"), {"max_turns": 0}, {}, "metadata.weenv.max_turns"),
    (SimpleNamespace(weenv_plan="p"), {"setpu": []}, {}, "metadata.weenv.setpu"),
    (SimpleNamespace(weenv_plan="p"), {"evaluator": {"timeout_s": 3}}, {}, "metadata.weenv.evaluator"),
    (SimpleNamespace(), {}, {"WEENV_COMMAND_TIMEOUT_S": "soon", "WEENV_PLAN": "p"}, "env WEENV_COMMAND_TIMEOUT_S"),
    (SimpleNamespace(), {}, {}, "metadata.weenv.plan"),
])
def test_settings_errors_name_where_the_value_came_from(args, metadata, environ, location):
    with pytest.raises(ConfigError) as info:
        resolve_env_spec(args, Sample(metadata={"weenv": metadata}), environ=environ)
    assert info.value.location.startswith(location), info.value


def test_rollout_settings():
    s = resolve_rollout_settings(SimpleNamespace(weenv_create_concurrency=4), environ={"WEENV_SOCKET": "/s.sock"})
    assert (s.create_concurrency, s.socket, s.tokenizer) == (4, "/s.sock", None)
    with pytest.raises(ConfigError, match="args.weenv_create_concurrency"):
        resolve_rollout_settings(SimpleNamespace(weenv_create_concurrency=0), environ={})


def test_docs_yaml_example_is_valid():
    """The YAML in docs/slime.md parses (as slime would: top-level keys become args attributes)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (slime itself needs it)")
    text = Path(__file__).parent.parent.joinpath("docs/slime.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    args = SimpleNamespace()
    for k, v in yaml.safe_load(block).items():
        setattr(args, k, v)
    spec = resolve_env_spec(args, Sample(), environ={})
    assert spec.evaluator is not None and spec.setup
    resolve_rollout_settings(args, environ={})


# =========================================================================== token bookkeeping (pure)


@pytest.mark.parametrize("cls", [Sample, LegacySample])
def test_append_tokens_masks_observations(cls):
    s = cls(tokens=[1, 2, 3])
    append_tokens(s, None, tokens=[10, 11], log_probs=[-0.5, -0.25], trainable=True,
                  meta_info={"finish_reason": {"type": "stop"}}, text="ab")
    append_tokens(s, None, tokens=[20, 21, 22], log_probs=None, trainable=False, meta_info=None, text="obs")
    append_tokens(s, None, tokens=[12], log_probs=[-1.0], trainable=True, meta_info=None, text="c")
    assert s.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert s.response == "abobsc" and s.response_length == 6
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]


def test_reset_and_abort_keep_shapes_consistent():
    s = Sample(tokens=[1, 2], metadata={"weenv": {"plan": "p"}, "weenv_run": {}, "abort_reason": "x"})
    append_tokens(s, None, tokens=[5, 6], log_probs=[-1.0, -1.0], trainable=True, meta_info=None, text="hi")
    s.status = Sample.Status.ABORTED
    reset_response(s)
    assert (s.tokens, s.response, s.response_length, s.loss_mask, s.status) == ([1, 2], "", 0, None,
                                                                                   Sample.Status.PENDING)
    assert s.metadata == {"weenv": {"plan": "p"}}
    mark_aborted(s, SimpleNamespace(reward_key=None), "sandbox: boom")
    assert s.status is Sample.Status.ABORTED and s.reward == 0.0 and s.remove_sample
    assert s.response_length == 1 and s.loss_mask == [0] and s.rollout_log_probs == [0.0] and len(s.tokens) == 3
    assert s.metadata["abort_reason"] == "sandbox: boom"
    s2 = Sample(tokens=[1])
    mark_aborted(s2, SimpleNamespace(reward_key="score"), "r")
    assert s2.reward == {"score": 0.0}


def test_mark_aborted_leaves_top_p_spans_the_train_side_accepts():
    """With top-p replay on (``rollout_top_p != 1``) slime asserts on every sample it trains on,
    removed ones too: ids and offsets set, ``len(offsets) == response_length + 1``,
    ``offsets[-1] == len(ids)``."""
    replay = SimpleNamespace(reward_key=None, rollout_top_p=0.9)
    fresh = Sample(tokens=[1, 2])
    mark_aborted(fresh, replay, "create/sandbox: boom")  # before any generation
    assert (fresh.rollout_top_p_token_ids, fresh.rollout_top_p_token_offsets) == ([], [0, 0])
    train_side_checks(fresh, replay)
    fresh._validate_response_metadata_lengths()
    # spans that cover the response are kept as they are
    covered = Sample(tokens=[1, 7, 8], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-1.0, -1.0],
                     rollout_top_p_token_ids=[7, 9, 8], rollout_top_p_token_offsets=[0, 2, 3])
    mark_aborted(covered, replay, "generate/sglang_abort: x")
    assert covered.rollout_top_p_token_offsets == [0, 2, 3] and covered.rollout_top_p_token_ids == [7, 9, 8]
    # spans that do not (an aborted turn's tokens came without them) become empty spans
    short = Sample(tokens=[1, 7, 8], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-1.0, -1.0],
                   rollout_top_p_token_ids=[7, 9], rollout_top_p_token_offsets=[0, 2])
    mark_aborted(short, replay, "generate/internal: x")
    assert (short.rollout_top_p_token_ids, short.rollout_top_p_token_offsets) == ([], [0, 0, 0])
    train_side_checks(short, replay)
    # without replay nothing is invented
    plain = Sample(tokens=[1, 2])
    mark_aborted(plain, SimpleNamespace(reward_key=None, rollout_top_p=1.0), "r")
    assert plain.rollout_top_p_token_ids is None and plain.rollout_top_p_token_offsets is None


def test_evaluator_reward_rules():
    assert evaluator_reward(0, b"all good\n", False) == (1.0, None)
    assert evaluator_reward(1, b"", False) == (0.0, None)
    assert evaluator_reward(0, b"log\n0.25\n\n", False) == (0.25, None)
    assert evaluator_reward(1, b'{"reward": 0.5, "passed": 3}\n', False) == (0.5, {"reward": 0.5, "passed": 3})
    assert evaluator_reward(0, b'{"passed": 3}\n', False) == (1.0, None)  # no reward key: exit code rules
    assert evaluator_reward(0, b"NaN\n", False) == (1.0, None)
    assert evaluator_reward(0, b"1.0\n", True) == (0.0, None)  # a timeout scores nothing


def test_clip_output_and_merge_stop():
    assert clip_output(b"short", 100) == ("short", 0)
    text, cut = clip_output(b"A" * 60 + b"B" * 60, 100)
    assert cut == 20 and text.startswith("A" * 50) and text.endswith("B" * 50) and "20 bytes" in text
    assert merge_stop(None, ("</bash>",)) == ["</bash>"]
    assert merge_stop("\n\n", ("</bash>",)) == ["\n\n", "</bash>"]
    assert merge_stop(["</bash>"], ("</bash>", "</answer>")) == ["</bash>", "</answer>"]


def test_parse_generate_response():
    t = parse_generate_response({"text": "hi", "meta_info": {"finish_reason": {"type": "stop"},
                                                              "output_token_logprobs": [[-0.1, 104, None],
                                                                                        [-0.2, 105, None]]}})
    assert (t.token_ids, t.log_probs, t.finish_reason) == ([104, 105], [-0.1, -0.2], "stop")
    assert parse_generate_response({"text": "", "meta_info": {"finish_reason": {"type": "abort"}}}).token_ids == []
    with pytest.raises(slime_plugin.GenerationError, match="output_token_logprobs"):
        parse_generate_response({"text": "x", "meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(slime_plugin.GenerationError, match="meta_info"):
        parse_generate_response({"text": "x"})


def test_group_templates_leader_followers_release():
    async def main():
        t = GroupTemplates()
        e1, lead1 = t.claim("g", 3)
        e2, lead2 = t.claim("g", 3)
        assert lead1 and not lead2 and e1 is e2
        t.publish(e1, "snap-1")
        e3, lead3 = t.claim("g", 3)
        assert not lead3 and len(t) == 0  # all three claimed: the entry left the table
        assert [t.release("g", e1), t.release("g", e2), t.release("g", e3)] == [False, False, True]
        # a group of unknown size leaves when its last user is done; a late sibling leads anew
        u1, _ = t.claim("u", None)
        u2, _ = t.claim("u", None)
        assert [t.release("u", u1), t.release("u", u2), len(t)] == [False, True, 0]
        assert t.claim("u", None)[1]
        # a failed leader: waiting siblings see the error, the next arrival leads again
        f1, _ = t.claim("h", 4)
        f2, _ = t.claim("h", 4)
        t.fail("h", f1, RuntimeError("setup failed"))
        with pytest.raises(RuntimeError):
            await f2.future
        f3, lead = t.claim("h", 4)
        assert lead and f3 is not f1
        # bounded table
        small = GroupTemplates(max_entries=2)
        for k in range(5):
            small.claim(k, None)
        assert len(small) == 2

    asyncio.run(main())


# =========================================================================== generate() without weenv


def test_bad_settings_abort_the_sample_without_raising(fake_sglang):
    args = slime_args(fake_sglang)
    sample = Sample(index=0, prompt="hi", metadata={"weenv": {"max_turns": "lots", "plan": "x"}})
    out = run(plugin_rollout.generate(args, sample, sampling_params()))
    assert out is sample and sample.status is Sample.Status.ABORTED and sample.remove_sample
    assert sample.reward == 0.0 and sample.metadata["abort_reason"].startswith("config/config: metadata.weenv.max_turns")
    assert fake_sglang.requests == []


def test_unreachable_daemon_aborts_the_sample(fake_sglang, tmp_path):
    plan = tmp_path / "p.toml"
    plan.write_text('name = "p"\n')
    args = slime_args(fake_sglang, weenv_socket=str(tmp_path / "run" / "none.sock"), weenv_plan=str(plan))
    sample = Sample(index=0, prompt="hi")
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.ABORTED and sample.remove_sample and sample.reward == 0.0
    assert sample.metadata["abort_reason"].startswith("create/sandbox")
    assert "not running" in sample.metadata["abort_reason"]  # and no daemon was started for it
    assert not (tmp_path / "daemon.log").exists()
    assert sample.loss_mask == [0] * sample.response_length


# =========================================================================== the sandbox on a real daemon


@pytest.mark.integration
def test_sandbox_protocol(daemon, tmp_path):
    host_file = tmp_path / "blob.bin"
    host_file.write_bytes(bytes(range(256)) * 4)

    async def main():
        async with WeenvSandbox(plan=daemon.plan_lock, socket_path=daemon.socket, autostart=False) as sb:
            assert sb.sandbox_id == sb.env.id and sb.sandbox_id
            assert await sb.exec("echo out; echo err >&2; exit 3") == (3, "out\n", "err\n")
            assert (await sb.exec("id -u", user="user"))[1] == "1000\n"
            assert (await sb.exec("echo $GREETING", env={"GREETING": "hi"}))[1] == "hi\n"
            with pytest.raises(CommandFailedError) as info:
                await sb.exec("echo nope >&2; exit 4", check=True)
            assert isinstance(info.value, RuntimeError) and info.value.exit_code == 4 and "nope" in info.value.stderr
            code, _, err = await sb.exec("sleep 30", timeout=1)
            assert code != 0 and "timed out after 1 s" in err
            await sb.write_file("/tmp/t.txt", "text ✓")
            await sb.write_file("/tmp/b.bin", b"\x00\x01")
            await sb.write_file("/tmp/h.bin", host_file)
            assert await sb.read_file("/tmp/t.txt") == "text ✓"
            assert (await sb.exec("wc -c < /tmp/b.bin; wc -c < /tmp/h.bin"))[1].split() == ["2", "1024"]
            assert await sb.read_file("/tmp/missing") == ""
            await sb.write_file("/home/user/mine", "x", user="user")
            assert (await sb.exec("stat -c %u /home/user/mine"))[1] == "1000\n"
            env_id = sb.sandbox_id
        with daemon.client() as c:
            assert env_id not in [e["id"] for e in c.list()]
        with pytest.raises(slime_plugin.SandboxNotStartedError):
            await sb.exec("true")

    asyncio.run(main())


@pytest.mark.integration
def test_sandbox_detached_command_protocol(daemon):
    """The command sequence of slime's ``exec_and_wait``: write a launcher, spawn it with setsid in
    the background, let the spawning exec return, poll a marker file for the exit code."""

    async def main():
        async with WeenvSandbox(plan=daemon.plan_lock, socket_path=daemon.socket, autostart=False) as sb:
            await sb.write_file("/tmp/.job.sh", "#!/bin/sh\nsleep 1\necho working\nexit 7\n")
            await sb.exec("rm -rf /tmp/.job.spawned; rm -f /tmp/.job.out /tmp/.job.done", check=True)
            code, _, _ = await sb.exec(
                "chmod +x /tmp/.job.sh; mkdir /tmp/.job.spawned 2>/dev/null || exit 0; "
                "setsid sh -c '/tmp/.job.sh; echo $? > /tmp/.job.done' < /dev/null > /tmp/.job.out 2>&1 &",
                timeout=30, check=True)
            assert code == 0
            for _ in range(100):
                code, out, _ = await sb.exec("test -f /tmp/.job.done && cat /tmp/.job.done", timeout=15)
                if code == 0 and out.strip():
                    break
                await asyncio.sleep(0.1)
            assert out.strip() == "7"
            assert await sb.read_file("/tmp/.job.out") == "working\n"

    asyncio.run(main())


def _slime_agent_sandbox():
    try:
        from slime.agent import sandbox as slime_sandbox  # noqa: PLC0415
    except ImportError as e:
        pytest.skip(f"slime is not importable ({e}); put THUDM/slime on PYTHONPATH to run this")
    return slime_sandbox


@pytest.mark.integration
@pytest.mark.slow
def test_slime_exec_and_wait_with_weenv_sandbox(daemon):
    slime_sandbox = _slime_agent_sandbox()

    async def main():
        async with WeenvSandbox(plan=daemon.plan_lock, socket_path=daemon.socket, autostart=False) as sb:
            assert isinstance(sb, slime_sandbox.Sandbox)  # the runtime-checkable protocol
            # busybox has no bash; exec_and_wait's launcher needs one
            await sb.write_file("/bin/bash", "#!/bin/sh\nexec /bin/sh \"$@\"\n", mode=0o755)
            code, out = await slime_sandbox.exec_and_wait(sb, cmd="(echo from-slime; exit 5)", time_budget_sec=60,
                                                          tag="t1", want_output=True)
            assert (code, out) == (5, "from-slime\n")

    asyncio.run(main())


# =========================================================================== episodes on a real daemon


def _episode_args(fake_sglang, daemon, **kw):
    return slime_args(fake_sglang, weenv_socket=daemon.socket, weenv_plan=daemon.plan_lock, **kw)


def _envs(daemon):
    with daemon.client() as c:
        return [e["id"] for e in c.list()]


THREE_TURNS = [
    "Let me create the file.\n<bash>mkdir -p /work && echo hello > /work/out.txt && echo made</bash>",
    "Check it.\n<bash>cat /work/out.txt; ls /nope</bash>",
    "It says hello.\n<answer>hello</answer>",
]


@pytest.mark.integration
@pytest.mark.parametrize("cls", [Sample, LegacySample])
def test_three_turn_episode(daemon, fake_sglang, cls):
    fake_sglang.reply = turns(THREE_TURNS)
    args = _episode_args(fake_sglang, daemon, weenv_evaluator={
        "command": 'test "$(cat /work/out.txt)" = "$WEENV_ANSWER" && echo \'{"reward": 0.75}\''})
    prompt = "Write hello to /work/out.txt.\n"
    sample = cls(index=0, group_index=0, prompt=prompt)
    out = run(plugin_rollout.generate(args, sample, sampling_params()))

    assert out is sample
    assert sample.status is Sample.Status.COMPLETED, sample.metadata.get("abort_reason")
    assert sample.reward == 0.75 and not sample.remove_sample
    record = sample.metadata["weenv_run"]
    assert record["end"] == "answer" and record["answer"] == "hello"
    assert [[c["exit_code"] for c in t["calls"]] for t in record["turns"]] == [[0], [1], []]
    assert all(t["finish_reason"] == "stop" for t in record["turns"])
    assert record["grade"]["exit_code"] == 0 and record["env_s"] > 0 and record["wall_s"] >= record["env_s"]

    # the token stream: prompt, then model turns (trainable) and observations (masked)
    prompt_len = len(prompt.encode())
    assert bytes(sample.tokens[:prompt_len]).decode() == prompt
    response = bytes(sample.tokens[prompt_len:]).decode()
    assert response == sample.response and sample.response_length == len(sample.tokens) - prompt_len
    obs1 = '\n<output exit_code="0">\nmade\n</output>\n'
    assert obs1 in response and "<output exit_code=\"1\">\nhello\n" in response and "/nope" in response
    expected_mask = []
    for piece in _split_turns(response, THREE_TURNS):
        expected_mask += [1 if piece[1] else 0] * len(piece[0].encode())
    assert sample.loss_mask == expected_mask
    assert sample.rollout_log_probs == [-0.25 if m else 0.0 for m in expected_mask]
    # the stop strings of the parser went to SGLang; the budget shrank turn by turn
    assert all("</bash>" in r["sampling_params"]["stop"] for r in fake_sglang.requests)
    budgets = [r["sampling_params"]["max_new_tokens"] for r in fake_sglang.requests]
    assert budgets[0] == 4096 and budgets == sorted(budgets, reverse=True) and len(set(budgets)) == 3
    assert _envs(daemon) == []
    # the reward function returns what the episode computed, one or a list
    assert run(plugin_rollout.reward(args, sample)) == 0.75
    assert run(plugin_rollout.reward(args, [sample, sample])) == [0.75, 0.75]


def _split_turns(response: str, replies: list[str]) -> list[tuple[str, bool]]:
    """Cut the response into (text, is_model_turn) pieces by the scripted replies."""
    pieces, pos = [], 0
    for reply in replies:
        start = response.index(reply, pos)
        if start > pos:
            pieces.append((response[pos:start], False))
        pieces.append((reply, True))
        pos = start + len(reply)
    if pos < len(response):
        pieces.append((response[pos:], False))
    return pieces


@pytest.mark.integration
def test_command_timeout_is_an_observation_and_the_episode_goes_on(daemon, fake_sglang):
    fake_sglang.reply = turns(["<bash>sleep 30</bash>", "<bash>echo after</bash>", "<answer>ok</answer>"])
    args = _episode_args(fake_sglang, daemon, weenv_command_timeout_s=1, weenv_evaluator={"command": "true"})
    sample = Sample(index=0, prompt="p")
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.COMPLETED, sample.metadata.get("abort_reason")
    assert sample.reward == 1.0
    calls = [c for t in sample.metadata["weenv_run"]["turns"] for c in t["calls"]]
    assert calls[0]["timed_out"] and calls[0]["exit_code"] != 0 and not calls[1]["timed_out"]
    assert "[command timed out after 1 s and was killed]" in sample.response
    assert '<output exit_code="0">\nafter\n</output>' in sample.response
    assert _envs(daemon) == []


@pytest.mark.integration
def test_sglang_abort_gives_an_aborted_sample(daemon, fake_sglang):
    fake_sglang.reply = turns(["<bash>echo one</bash>", Reply("partial tex", finish="abort")])
    args = _episode_args(fake_sglang, daemon, weenv_evaluator={"command": "true"})
    sample = Sample(index=0, prompt="p")
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.ABORTED and sample.remove_sample and sample.reward == 0.0
    assert sample.metadata["abort_reason"].startswith("generate/sglang_abort")
    assert "grade" not in sample.metadata["weenv_run"]
    assert len(sample.loss_mask) == sample.response_length and not any(sample.loss_mask)
    assert _envs(daemon) == []
    # partial rollout hands it back: the episode restarts from the prompt
    fake_sglang.reply = turns(["<answer>fine</answer>"])
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.COMPLETED and not sample.remove_sample and sample.reward == 1.0
    assert sample.response == "<answer>fine</answer>" and "abort_reason" not in sample.metadata
    assert sample.weight_versions == ["default"]  # the dropped attempt's two turns are not counted


@pytest.mark.integration
def test_env_creation_failure_aborts_and_leaves_nothing(daemon, fake_sglang, tmp_path):
    bad_plan = tmp_path / "bad.toml"
    bad_plan.write_text('name = "bad"\n[[groups]]\nname = "os"\nref = "nosuch:tag"\nclass = "os"\n')
    fake_sglang.reply = turns(["<answer>x</answer>"])
    samples = [Sample(index=i, prompt="p", metadata={"weenv": {"plan": str(bad_plan)}}) for i in range(2)]
    samples.append(Sample(index=2, prompt="p", metadata={"weenv": {"plan": str(tmp_path / "missing.lock")}}))
    args = _episode_args(fake_sglang, daemon)

    async def main():
        return await asyncio.gather(*(plugin_rollout.generate(args, s, sampling_params()) for s in samples))

    run(main())
    for s in samples:
        assert s.status is Sample.Status.ABORTED and s.remove_sample and s.reward == 0.0
        assert s.metadata["abort_reason"].startswith("create/sandbox"), s.metadata["abort_reason"]
    assert fake_sglang.requests == [] and _envs(daemon) == []


@pytest.mark.integration
def test_setup_failure_aborts(daemon, fake_sglang):
    args = _episode_args(fake_sglang, daemon, weenv_setup=["echo preparing", "echo broken >&2; exit 9"])
    sample = Sample(index=0, group_index=None, prompt="p")
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.ABORTED
    assert sample.metadata["abort_reason"].startswith("setup/command_failed") and "broken" in \
        sample.metadata["abort_reason"]
    assert _envs(daemon) == []


@pytest.mark.integration
def test_max_turns_and_length_truncate(daemon, fake_sglang):
    fake_sglang.reply = turns(["<bash>echo again</bash>"])
    args = _episode_args(fake_sglang, daemon, weenv_max_turns=2, weenv_evaluator={"command": "exit 1"})
    sample = Sample(index=0, prompt="p")
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.TRUNCATED and sample.reward == 0.0
    assert sample.metadata["weenv_run"]["end"] == "max_turns" and len(fake_sglang.requests) == 2
    # a small response budget: SGLang stops at "length"
    sample = Sample(index=1, prompt="p")
    run(plugin_rollout.generate(args, sample, sampling_params(max_new_tokens=10)))
    assert sample.status is Sample.Status.TRUNCATED and sample.metadata["weenv_run"]["end"] == "length"
    assert sample.response_length == 10 and sample.response == "<bash>echo"
    # room for a turn but not for its observation: the observation is left out
    turn = len("<bash>echo again</bash>")
    sample = Sample(index=2, prompt="p")
    run(plugin_rollout.generate(args, sample, sampling_params(max_new_tokens=turn + 5)))
    assert sample.status is Sample.Status.TRUNCATED and sample.metadata["weenv_run"]["end"] == "response_budget"
    assert sample.response == "<bash>echo again</bash>" and sample.loss_mask == [1] * turn
    assert sample.metadata["weenv_run"]["turns"][0]["calls"][0]["exit_code"] == 0
    assert _envs(daemon) == []


@pytest.mark.integration
@pytest.mark.parametrize("setup", [[], ["mkdir -p /work && echo prepared > /work/ready"]])
def test_grading_in_a_clean_env_copies_only_the_named_paths(daemon, fake_sglang, setup):
    """The clean env is the plan itself, or (with setup) a snapshot taken after the setup."""
    fake_sglang.reply = turns(["<bash>mkdir -p /work && echo 42 > /work/answer && touch /work/junk "
                               "&& rm -f /work/ready</bash>", "<answer>done</answer>"])
    ready = "test -f /work/ready && " if setup else ""
    args = _episode_args(fake_sglang, daemon, weenv_setup=setup, weenv_evaluator={
        "command": f"{ready}test \"$(cat /work/answer)\" = 42 && test ! -e /work/junk && test \"$WEENV_LABEL\" = L",
        "grade_in_clean_env": True, "copy_paths": ["work/answer", "work/not-made"]})
    sample = Sample(index=0, prompt="p", label="L")
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.COMPLETED, sample.metadata.get("abort_reason")
    record = sample.metadata["weenv_run"]
    assert sample.reward == 1.0 and record["grade"]["clean_env"] and len(record["envs"]) == 2
    assert _envs(daemon) == [] and _snapshots(daemon) == []


def _snapshots(daemon):
    with daemon.client() as c:
        return [s["id"] for s in c.snapshots()]


def _daemon_can_snapshot(daemon) -> bool:
    import weenv

    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        try:
            c.delete_snapshot(env.commit())
            return True
        except weenv.ApiError as e:
            if e.status in (404, 405, 501):
                return False
            raise


@pytest.mark.integration
def test_group_prepares_once_and_forks(daemon, fake_sglang):
    """8 samples of one group: one task env is set up and snapshotted, each sample starts from the
    snapshot. Without snapshot support the group degrades to a set-up env per sample."""
    can_snapshot = _daemon_can_snapshot(daemon)
    fake_sglang.reply = turns(["<bash>cat /task/seed && echo $RANDOM > /task/mine</bash>", "<answer>ok</answer>"])
    args = _episode_args(fake_sglang, daemon, n_samples_per_prompt=8,
                         weenv_setup=["mkdir -p /task && echo seeded > /task/seed"],
                         weenv_evaluator={"command": "grep -q seeded /task/seed"})
    samples = [Sample(index=i, group_index=7, prompt="p") for i in range(8)]

    async def main():
        await asyncio.gather(*(plugin_rollout.generate(args, s, sampling_params()) for s in samples))
        return plugin_rollout.statistics()

    stats = run(main())
    print("snapshots supported:", can_snapshot, dict(stats))
    for s in samples:
        assert s.status is Sample.Status.COMPLETED, s.metadata.get("abort_reason")
        assert s.reward == 1.0 and "seeded" in s.response
    assert stats["group_leaders"] == 1 and stats["group_followers"] == 7
    if can_snapshot:
        assert (stats["created_from_plan"], stats["commits"], stats["created_from_snapshot"]) == (1, 1, 8)
        assert stats["snapshots_deleted"] == 1 and _snapshots(daemon) == []
    else:
        assert stats["snapshot_unavailable"] == 1 and stats["created_from_plan"] == 8
        assert stats.get("created_from_snapshot", 0) == 0
    assert stats["kills"] == stats["created_from_plan"] + stats.get("created_from_snapshot", 0)
    assert _envs(daemon) == []


@pytest.mark.integration
def test_reward_computes_when_generation_did_not(daemon):
    args = slime_args(None, weenv_socket=daemon.socket, weenv_plan=daemon.plan_lock,
                      weenv_evaluator={"command": 'test "$WEENV_ANSWER" = "\\\\boxed{4}"'})
    right = Sample(index=0, response="\\boxed{4}", status=Sample.Status.COMPLETED)
    wrong = Sample(index=1, response="5", status=Sample.Status.COMPLETED)
    assert run(plugin_rollout.reward(args, [right, wrong])) == [1.0, 0.0]
    assert right.metadata["weenv_run"]["reward"] == 1.0
    no_eval = Sample(index=2, response="x")
    assert run(plugin_rollout.reward(slime_args(None, weenv_plan=daemon.plan_lock, weenv_socket=daemon.socket),
                                     no_eval)) == 0.0
    assert no_eval.remove_sample and "no evaluator" in no_eval.metadata["abort_reason"]
    assert _envs(daemon) == []


# =========================================================================== slime's own rollout path


@pytest.mark.integration
def test_slime_generate_and_rm_calls_the_plugin(daemon, fake_sglang, monkeypatch):
    """slime's ``generate_and_rm`` loads the plugin by its dotted path, as in a real run."""
    if importlib.util.find_spec("slime") is None:
        pytest.skip("slime is not importable (THUDM/slime is not on PyPI; it needs torch, sglang, ray)")
    try:
        from slime.rollout import sglang_rollout  # noqa: PLC0415
        from slime.utils.types import Sample as SlimeSample  # noqa: PLC0415
    except ImportError as e:
        pytest.skip(f"slime's rollout module cannot be imported here: {e}")
    fake_sglang.reply = turns(THREE_TURNS)
    args = _episode_args(fake_sglang, daemon, sglang_server_concurrency=4, rollout_num_gpus=1,
                         rollout_num_gpus_per_engine=1, sglang_dp_size=1, rollout_temperature=1.0, rollout_top_p=1.0,
                         rollout_top_k=-1, rollout_stop=None, rollout_stop_token_ids=None,
                         rollout_skip_special_tokens=False, mask_offpolicy_in_partial_rollout=False,
                         ci_test=False, rollout_seed=1, use_rollout_routing_replay=False, hf_checkpoint="unused",
                         weenv_evaluator={"command": "test -f /work/out.txt"})
    monkeypatch.setattr(type(sglang_rollout.GenerateState), "_instances", {})
    monkeypatch.setattr(sglang_rollout.GenerateState, "__init__", _light_state)  # no tokenizer download
    sample = SlimeSample(index=0, group_index=0, prompt="Write hello.\n", metadata={})
    out = run(sglang_rollout.generate_and_rm(args, sample, sampling_params()))
    assert out.status is SlimeSample.Status.COMPLETED and out.reward == 1.0
    assert len(out.loss_mask) == out.response_length and 0 in out.loss_mask
    # --group-rm: slime hands the whole group to --custom-rm-path
    from slime.rollout.rm_hub import batched_async_rm  # noqa: PLC0415

    assert run(batched_async_rm(args, [out, out])) == [1.0, 1.0]
    assert _envs(daemon) == []


def _light_state(state, args):
    state.args = args
    state.semaphore = asyncio.Semaphore(4)
    state.dp_counts = [0]
    state.dp_rank = 0
    state.reset()


def _docs_blocks(kind: str) -> list[str]:
    text = Path(__file__).parent.parent.joinpath("docs/slime.md").read_text()
    return [part.split("```", 1)[0] for part in text.split(f"```{kind}\n")[1:]]


@pytest.mark.integration
def test_docs_worked_example_runs(daemon, fake_sglang):
    """The dataset row and YAML of docs/slime.md, on the busybox plan, with a scripted model."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (slime itself needs it)")
    row = json.loads(_docs_blocks("json")[0])
    args = _episode_args(fake_sglang, daemon)
    for k, v in yaml.safe_load(_docs_blocks("yaml")[0]).items():
        setattr(args, k, v)
    args.weenv_plan = daemon.plan_lock
    fake_sglang.reply = turns(["I'll look first.<bash>cat add.sh</bash>",
                               "<bash>printf '#!/bin/sh\\necho $(($1 + $2))\\n' > add.sh; echo ok > other</bash>",
                               "<answer>done</answer>"])
    samples = [Sample(index=i, group_index=0, prompt=row["prompt"], label=row["label"], metadata=row["metadata"])
               for i in range(2)]
    args.n_samples_per_prompt = 2

    async def main():
        return await asyncio.gather(*(plugin_rollout.generate(args, s, sampling_params()) for s in samples))

    run(main())
    for s in samples:
        assert s.status is Sample.Status.COMPLETED, s.metadata.get("abort_reason")
        assert s.reward == 1.0 and s.metadata["weenv_run"]["grade"]["clean_env"]
        assert '<output exit_code="0">\n#!/bin/sh\necho $(($1 - $2))\n</output>' in s.response
        assert s.response.startswith("I'll look first.<bash>cat add.sh</bash>")
        assert bytes(s.tokens[:len(s.tokens) - s.response_length]).decode().startswith("system: You can run")
    assert _envs(daemon) == [] and _snapshots(daemon) == []


@pytest.mark.integration
def test_node_capacity_is_waited_for_or_reported(daemon, fake_sglang):
    """Envs that each guarantee 0.9 cores: a 2-core node admits two at a time. Refused creations
    are retried until admission_timeout_s; with max_envs the process never asks for more."""
    fake_sglang.latency_s = 0.3  # keeps the admitted envs busy while the others ask
    fake_sglang.reply = turns(["<bash>echo hi</bash>", "<answer>ok</answer>"])

    def batch(**kw):
        args = _episode_args(fake_sglang, daemon, weenv_cpu="0.9-1", weenv_evaluator={"command": "true"}, **kw)
        samples = [Sample(index=i, prompt="p") for i in range(5)]

        async def main():
            await asyncio.gather(*(plugin_rollout.generate(args, s, sampling_params()) for s in samples))
            return plugin_rollout.statistics()

        return samples, run(main())

    # One creation at a time, so that the daemon's admission sees every env already started.
    samples, stats = batch(weenv_admission_timeout_s=0, weenv_create_concurrency=1)
    aborted = [s for s in samples if s.status is Sample.Status.ABORTED]
    assert len(aborted) == 3 and stats["admission_refusals"] == 3
    assert all(s.metadata["abort_reason"].startswith("create/capacity") for s in aborted)
    samples, stats = batch(weenv_admission_timeout_s=120, weenv_create_concurrency=1)
    assert all(s.status is Sample.Status.COMPLETED for s in samples) and stats["admission_refusals"] >= 1
    samples, stats = batch(weenv_max_envs=2)
    assert all(s.status is Sample.Status.COMPLETED for s in samples) and stats.get("admission_refusals", 0) == 0
    assert _envs(daemon) == []


class _FakeEnv:
    """An env of :class:`_FakeClient`: every command succeeds; commit is not supported."""

    def __init__(self, client, source):
        client.created.append(source)
        self.client, self.id = client, f"fake-{len(client.created)}"
        client.alive.add(self.id)

    async def exec(self, cmd, **kw):
        import weenv

        return weenv.ExecResult(exit_code=0, stdout=b"", duration_s=0.0)

    async def commit(self, **kw):
        import weenv

        raise weenv.ApiError(404, "no_route", "no API route POST /v1/envs/x/commit")

    async def kill(self):
        self.client.alive.discard(self.id)


class _FakeClient:
    def __init__(self, *a, **kw):
        self.created, self.alive = [], set()
        _FakeClient.last = self

    async def create(self, source, **kw):
        await asyncio.sleep(0)
        return _FakeEnv(self, source)

    async def aclose(self):
        pass


def test_group_without_snapshot_support_prepares_an_env_per_sample(fake_sglang, monkeypatch):
    """A daemon without commit: the leader keeps its env, each sibling sets up its own."""
    import weenv

    monkeypatch.setattr(weenv, "AsyncClient", _FakeClient)
    fake_sglang.reply = turns(["<answer>ok</answer>"])
    args = slime_args(fake_sglang, weenv_plan="plan.lock", weenv_setup=["prepare"], n_samples_per_prompt=4,
                      weenv_evaluator={"command": "true"}, weenv_socket="/fake.sock")
    samples = [Sample(index=i, group_index=3, prompt="p") for i in range(4)]

    async def main():
        await asyncio.gather(*(plugin_rollout.generate(args, s, sampling_params()) for s in samples))
        return plugin_rollout.statistics()

    stats = run(main())
    assert all(s.status is Sample.Status.COMPLETED and s.reward == 1.0 for s in samples)
    assert stats["snapshot_unavailable"] == 1 and stats["created_from_plan"] == 4 and stats["kills"] == 4
    assert _FakeClient.last.created == ["plan.lock"] * 4 and _FakeClient.last.alive == set()
    assert sorted(s.metadata["weenv_run"]["group_role"] for s in samples) == ["follower"] * 3 + ["leader"]


def test_sglang_retries_then_gives_up(fake_sglang):
    import httpx

    from slime_plugin import _sglang

    url = f"http://{fake_sglang.host}:{fake_sglang.port}/generate"
    fake_sglang.reply = turns(["fine"])

    async def call(retries):
        async with httpx.AsyncClient() as http:
            return await _sglang.generate(http, url, [1, 2], {"max_new_tokens": 8}, retries=retries)

    fake_sglang.fail_next = 2
    assert asyncio.run(call(2)).text == "fine"
    fake_sglang.fail_next = 2
    with pytest.raises(slime_plugin.GenerationError, match="failed 2 times; last: HTTP 503"):
        asyncio.run(call(1))
    assert fake_sglang.requests[-1]["return_logprob"] is True and fake_sglang.requests[-1]["input_ids"] == [1, 2]


def test_a_sample_aborted_before_generation_passes_the_train_side_top_p_checks(fake_sglang):
    args = slime_args(fake_sglang, rollout_top_p=0.9)
    sample = Sample(index=0, prompt="hi", metadata={"weenv": {"max_turns": "lots", "plan": "x"}})
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.ABORTED and sample.remove_sample and fake_sglang.requests == []
    assert sample.response_length == 1
    assert (sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets) == ([], [0, 0])
    train_side_checks(sample, args)
    sample._validate_response_metadata_lengths()


def _fake_env_args(fake_sglang, monkeypatch, **overrides):
    """``args`` for episodes in :class:`_FakeClient` envs (no daemon): every command succeeds."""
    import weenv

    monkeypatch.setattr(weenv, "AsyncClient", _FakeClient)
    return slime_args(fake_sglang, weenv_plan="plan.lock", weenv_socket="/fake.sock", **overrides)


def test_a_restarted_sample_reports_only_its_own_turns(fake_sglang, monkeypatch):
    """Partial rollout hands an ABORTED sample back and the episode restarts from the prompt: the
    dropped attempt's weight versions and prefix-cache / speculative counters go with it."""
    args = _fake_env_args(fake_sglang, monkeypatch, partial_rollout=True, sglang_speculative_algorithm="EAGLE")
    sample = Sample(index=0, prompt="p")
    fake_sglang.weight_version = "1"
    fake_sglang.reply = turns(["<bash>echo one</bash>", Reply("partial", finish="abort")])
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.ABORTED and sample.weight_versions == ["1", "1"]
    assert sample.prefix_cache_info.total_prompt_tokens > 0 and sample.spec_info.completion_token_num > 0
    sample.metadata["start_rollout_id"] = 3  # slime's abort() notes where the dropped response began

    fake_sglang.weight_version = "2"
    fake_sglang.reply = turns(["<bash>echo two</bash>", "<answer>ok</answer>"])
    first = len(fake_sglang.requests)
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.COMPLETED, sample.metadata.get("abort_reason")
    assert sample.weight_versions == ["2", "2"]
    assert sample.prefix_cache_info.total_prompt_tokens == sum(len(r["input_ids"])
                                                               for r in fake_sglang.requests[first:])
    assert sample.spec_info.completion_token_num == sum(t["new_tokens"] for t in sample.metadata["weenv_run"]["turns"])
    assert "start_rollout_id" not in sample.metadata


def _fake_slime_http_utils(monkeypatch, *, fail: bool = False, client: object = "set"):
    """``slime.utils.http_utils`` with slime's ``post`` signature; records each call and forwards it
    to the URL (``fail``: raises as slime's ``post`` does once its retries are spent)."""
    import httpx

    calls = []

    async def post(url, payload, max_retries=60, headers=None):  # as in slime/utils/http_utils.py
        calls.append({"url": url, "payload": payload, "max_retries": max_retries, "headers": headers})
        if fail:
            raise httpx.ConnectError("All connection attempts failed")
        async with httpx.AsyncClient() as http:
            resp = await http.post(url, json=payload or {}, headers=headers)
            resp.raise_for_status()
            return resp.json()

    module = ModuleType("slime.utils.http_utils")
    module.post = post
    module._http_client = client  # what init_http_client sets in slime's rollout manager
    for name, value in (("slime", ModuleType("slime")), ("slime.utils", ModuleType("slime.utils")),
                        ("slime.utils.http_utils", module)):
        monkeypatch.setitem(sys.modules, name, value)
    return calls


def test_posts_go_through_slimes_http_utils_post_when_importable(fake_sglang, monkeypatch):
    """So that ``--use-distributed-post`` (Ray actors per node) and slime's retry policy apply."""
    calls = _fake_slime_http_utils(monkeypatch)
    assert list(inspect.signature(sys.modules["slime.utils.http_utils"].post).parameters) == [
        "url", "payload", "max_retries", "headers"]
    args = _fake_env_args(fake_sglang, monkeypatch, router_policy="consistent_hashing")
    fake_sglang.reply = turns(["<bash>echo one</bash>", "<answer>ok</answer>"])
    sample = Sample(index=0, prompt="p", session_id="session-1")
    run(plugin_rollout.generate(args, sample, sampling_params()))
    assert sample.status is Sample.Status.COMPLETED, sample.metadata.get("abort_reason")
    assert len(calls) == 2 == len(fake_sglang.requests)
    url = f"http://{fake_sglang.host}:{fake_sglang.port}/generate"
    for call, seen in zip(calls, fake_sglang.requests):
        assert call["url"] == url and call["payload"] == seen and call["max_retries"] == 60
        assert call["headers"] == {"X-SMG-Routing-Key": "session-1"}
        assert set(call["payload"]) == {"input_ids", "sampling_params", "return_logprob"}

    # slime's post gives up (its retries spent): the sample aborts, naming the path it took
    _fake_slime_http_utils(monkeypatch, fail=True)
    failed = Sample(index=1, prompt="p")
    run(plugin_rollout.generate(args, failed, sampling_params()))
    assert failed.status is Sample.Status.ABORTED
    assert failed.metadata["abort_reason"].startswith("generate/sglang: POST ")
    assert "slime.utils.http_utils.post" in failed.metadata["abort_reason"]
    assert "ConnectError" in failed.metadata["abort_reason"]

    # slime importable but its client never set up in this process: the plugin's own client posts
    calls = _fake_slime_http_utils(monkeypatch, client=None)
    before = len(fake_sglang.requests)
    own = Sample(index=2, prompt="p")
    run(plugin_rollout.generate(args, own, sampling_params()))
    assert own.status is Sample.Status.COMPLETED and calls == [] and len(fake_sglang.requests) == before + 2


@pytest.mark.integration
def test_cancelled_sample_still_kills_its_env(daemon, fake_sglang):
    """slime cancels in-flight tasks (abort at the end of a step): the env must not outlive them."""
    fake_sglang.latency_s = 3.0
    fake_sglang.reply = turns(["<answer>late</answer>"])
    args = _episode_args(fake_sglang, daemon)
    sample = Sample(index=0, prompt="p")

    async def main():
        task = asyncio.create_task(plugin_rollout.generate(args, sample, sampling_params()))
        while not fake_sglang.requests:  # the env exists once the model is asked
            await asyncio.sleep(0.02)
        assert len(_envs(daemon)) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert _envs(daemon) == []
    assert sample.metadata["weenv_run"]["failed_phase"] == "generate"
