"""One sample's episode: task env → model/tool turns → grading, and the sample bookkeeping.

The helpers at the top are pure (token accounting, rewards, truncation); :class:`Episode` does
the I/O. Sample fields are touched only through the sample's own ``append_response_tokens``
(when it has one) and its own ``Status`` enum, so this works with slime's ``Sample`` as is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import shlex
import time
from typing import Any

from . import _sglang
from ._config import EnvSpec, spec_fingerprint
from ._errors import CapacityError, CommandFailedError, GenerationAborted, GradingError, SandboxError, SnapshotUnavailableError
from ._parsers import CallResult, ToolCall, ToolCallParser
from ._state import LoopState, encode
from .sandbox import WeenvSandbox

logger = logging.getLogger(__name__)

#: ``sample.metadata[RUN_KEY]`` holds what happened (see docs/slime.md, "What a sample carries").
RUN_KEY = "weenv_run"
#: Environment variables for the evaluator are cut to this many characters.
MAX_EVALUATOR_VAR_CHARS = 16384


# ---------------------------------------------------------------------------------- pure helpers


def append_tokens(sample: Any, args: Any, *, tokens: list[int], log_probs: list[float] | None, trainable: bool,
                  meta_info: dict | None, text: str) -> None:
    """Append response tokens, keeping ``loss_mask`` and ``rollout_log_probs`` aligned: through
    ``sample.append_response_tokens`` when the Sample has it, else by hand (older slime)."""
    append = getattr(sample, "append_response_tokens", None)
    if callable(append):
        append(args, tokens=tokens, log_probs=log_probs if trainable else None, trainable=trainable,
               meta_info=meta_info, text=text)
        return
    previous = sample.response_length
    sample.tokens = list(sample.tokens) + list(tokens)
    sample.response = (sample.response or "") + text
    sample.response_length = previous + len(tokens)
    if sample.loss_mask is None:
        sample.loss_mask = [1] * previous
    sample.loss_mask = list(sample.loss_mask) + [1 if trainable else 0] * len(tokens)
    if sample.rollout_log_probs is None:
        sample.rollout_log_probs = [0.0] * previous
    sample.rollout_log_probs = list(sample.rollout_log_probs) + (
        list(log_probs) if trainable and log_probs is not None else [0.0] * len(tokens))


#: What an earlier attempt leaves in ``sample.metadata``: the plugin's record and abort reason, and
#: the rollout slime's partial-rollout abort noted the dropped response started in.
_ATTEMPT_METADATA = (RUN_KEY, "abort_reason", "start_rollout_id")


def reset_response(sample: Any) -> None:
    """Drop an earlier attempt's response (partial rollout hands ABORTED samples back; their env
    is gone, so the episode restarts from the prompt), with everything slime accumulated over it:
    ``weight_versions`` and the ``prefix_cache_info`` / ``spec_info`` counters, which
    ``append_response_tokens`` adds to on every turn."""
    if sample.response_length:
        keep = len(sample.tokens) - sample.response_length
        sample.tokens = list(sample.tokens[:max(keep, 0)])
    sample.response = ""
    sample.response_length = 0
    sample.loss_mask = None
    sample.rollout_log_probs = None
    for name in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts"):
        if hasattr(sample, name):
            setattr(sample, name, None)
    if hasattr(sample, "weight_versions"):
        sample.weight_versions = []
    for name in ("prefix_cache_info", "spec_info"):  # slime's Sample.PrefixCacheInfo / Sample.SpecInfo
        counters = getattr(sample, name, None)
        if counters is not None:
            setattr(sample, name, type(counters)())
    sample.reward = None
    sample.remove_sample = False
    sample.status = type(sample).Status.PENDING
    if isinstance(sample.metadata, dict) and any(k in sample.metadata for k in _ATTEMPT_METADATA):
        sample.metadata = {k: v for k, v in sample.metadata.items() if k not in _ATTEMPT_METADATA}


def reward_value(args: Any, value: float, detail: dict | None = None) -> float | dict:
    """``value`` in the shape slime reads: a float, or a dict when ``args.reward_key`` is set."""
    key = getattr(args, "reward_key", None)
    if not key:
        return value
    out = dict(detail or {})
    out.setdefault(key, value)
    return out


def mark_aborted(sample: Any, args: Any, reason: str) -> None:
    """ABORTED, reward 0, ``remove_sample``; the response keeps at least one (masked) token so
    slime's training-side shape checks hold (top-p replay spans included, see
    :func:`_align_top_p_spans`)."""
    sample.status = type(sample).Status.ABORTED
    sample.reward = reward_value(args, 0.0)
    sample.remove_sample = True
    if sample.response_length == 0:
        sample.tokens = list(sample.tokens) + [sample.tokens[-1] if sample.tokens else 0]
        sample.response_length = 1
    sample.loss_mask = [0] * sample.response_length
    log_probs = list(sample.rollout_log_probs or [])
    sample.rollout_log_probs = (log_probs + [0.0] * sample.response_length)[:sample.response_length]
    _align_top_p_spans(sample, args)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    sample.metadata = {**metadata, "abort_reason": reason}


def _align_top_p_spans(sample: Any, args: Any) -> None:
    """With top-p replay on (``args.rollout_top_p != 1``), slime's ``_convert_samples_to_train_data``
    asserts on every sample, removed ones too: ``rollout_top_p_token_ids`` and ``..._offsets`` set,
    ``len(offsets) == response_length + 1``, ``offsets[-1] == len(ids)``. Spans that do not cover an
    aborted sample's response (none were made, or the last turn came without them) become empty
    ones, as slime gives tool tokens; the sample's loss is masked, so only their shape matters."""
    if not hasattr(sample, "rollout_top_p_token_offsets"):
        return
    ids, offsets = sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets
    replay = getattr(args, "rollout_top_p", 1.0) not in (None, 1.0)
    if ids is None and offsets is None and not replay:
        return
    n = sample.response_length
    if ids is not None and offsets is not None and len(offsets) == n + 1 and int(offsets[0]) == 0 \
            and int(offsets[-1]) == len(ids):
        return  # lists or slime's int32 tensors; both have len() and int() of an element
    sample.rollout_top_p_token_ids = []
    sample.rollout_top_p_token_offsets = [0] * (n + 1)


def evaluator_reward(exit_code: int, stdout: bytes, timed_out: bool) -> tuple[float, dict | None]:
    """Exit 0 → 1.0, else 0.0; unless the last non-empty stdout line is JSON: a number, or an
    object with a numeric ``reward`` (returned as the detail too). A timeout scores 0.0."""
    if timed_out:
        return 0.0, None
    lines = [line for line in stdout.decode("utf-8", "replace").splitlines() if line.strip()]
    if lines:
        try:
            value = json.loads(lines[-1])
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("reward"), (int, float)) \
                and math.isfinite(value["reward"]):
            return float(value["reward"]), value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value), None
    return (1.0 if exit_code == 0 else 0.0), None


def clip_output(data: bytes, limit_bytes: int) -> tuple[str, int]:
    """Head and tail of ``data`` within ``limit_bytes``, with a marker; and how many bytes were cut."""
    if len(data) <= limit_bytes:
        return data.decode("utf-8", "replace"), 0
    cut = len(data) - limit_bytes
    half = limit_bytes // 2
    head = data[:half].decode("utf-8", "ignore")
    tail = data[len(data) - (limit_bytes - half):].decode("utf-8", "ignore")
    return f"{head}\n[... {cut} bytes of output cut ...]\n{tail}", cut


def merge_stop(stop: Any, extra: tuple[str, ...]) -> list[str] | Any:
    if not extra:
        return stop
    current = [stop] if isinstance(stop, str) else list(stop or [])
    return list(dict.fromkeys([*current, *extra]))


# ---------------------------------------------------------------------------------- the episode


class _Finished(Exception):
    """Internal: the episode ended early with ``status`` (a Status member name)."""

    def __init__(self, status: str, why: str):
        self.status, self.why = status, why


class Episode:
    """Runs one sample. ``run`` leaves ``sample`` COMPLETED/TRUNCATED (graded when an evaluator is
    configured) or raises; the caller turns errors into an ABORTED sample. Envs are always killed."""

    def __init__(self, *, args: Any, sample: Any, sampling_params: dict[str, Any], spec: EnvSpec,
                 parser: ToolCallParser, state: LoopState, tokenizer: Any, evaluation: bool, record: dict):
        self.args, self.sample, self.spec, self.parser = args, sample, spec, parser
        self.sampling_params = dict(sampling_params)
        self.state, self.tokenizer, self.evaluation, self.record = state, tokenizer, evaluation, record
        self.answer: str | None = None
        self.last_text = ""
        self._holding: set[int] = set()  # ids of the sandboxes that hold an env slot

    # -- timing ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _env_op(self, what: str):
        self.record["phase"] = what
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.record["env_s"] += elapsed
            ops = self.record["env_ops_s"]
            ops[what] = ops.get(what, 0.0) + elapsed

    # -- envs -----------------------------------------------------------------------------------

    async def _create(self, source: Any, *, from_snapshot: bool) -> WeenvSandbox:
        """A started env (counted against ``max_envs`` until :meth:`_close`). A refusal for lack
        of node capacity is retried with backoff until ``admission_timeout_s``."""
        spec, state = self.spec, self.state
        settings = state.settings
        kwargs = dict(client=state.client, ttl_s=spec.ttl_s, cpu=spec.cpu, memory=spec.memory,
                      env=spec.env or None, workdir=spec.workdir, op_timeout_s=settings.client_timeout_s)
        if state.env_slots is not None:
            with self._env_op("env_slot_wait"):
                await state.env_slots.acquire()
        with self._env_op("create"):
            try:
                deadline = time.monotonic() + settings.admission_timeout_s
                delay_s = 0.25
                while True:
                    sb = WeenvSandbox(snapshot=source, **kwargs) if from_snapshot else WeenvSandbox(plan=source, **kwargs)
                    try:
                        async with state.create_slots:
                            await sb.__aenter__()
                        break
                    except CapacityError:
                        state.stats["admission_refusals"] += 1
                        if time.monotonic() + delay_s > deadline:
                            raise
                    # Envs of other samples end all the time; wait for one, not in lockstep.
                    await asyncio.sleep(random.uniform(delay_s / 2, delay_s))
                    delay_s = min(delay_s * 2, 5.0)
            except BaseException:
                if state.env_slots is not None:
                    state.env_slots.release()
                raise
        if state.env_slots is not None:
            self._holding.add(id(sb))
        state.stats["created_from_snapshot" if from_snapshot else "created_from_plan"] += 1
        self.record["envs"].append(sb.sandbox_id)
        return sb

    async def _close(self, sb: WeenvSandbox) -> None:
        if sb.closed:
            return
        try:
            with self._env_op("kill"):
                await sb.close()
            self.state.stats["kills"] += 1
        finally:
            if id(sb) in self._holding:
                self._holding.discard(id(sb))
                self.state.env_slots.release()

    async def _setup(self, sb: WeenvSandbox) -> None:
        for command in self.spec.setup:
            with self._env_op("setup"):
                result = await sb.run(command, user=self.spec.user, timeout_s=self.spec.setup_timeout_s)
            if result.exit_code != 0 or result.timed_out:
                raise CommandFailedError(command, result.exit_code, result.stdout.decode("utf-8", "replace"),
                                         result.stderr.decode("utf-8", "replace"), sandbox_id=sb.sandbox_id)

    async def _commit(self, sb: WeenvSandbox) -> str:
        with self._env_op("commit"):
            async with self.state.create_slots:
                snapshot = await sb.commit()
        self.state.stats["commits"] += 1
        return snapshot

    async def _fresh_task_env(self, source: Any, from_snapshot: bool, stack: contextlib.AsyncExitStack) \
            -> WeenvSandbox:
        sb = await self._create(source, from_snapshot=from_snapshot)
        stack.push_async_callback(self._close, sb)
        await self._setup(sb)
        return sb

    async def _open_task_env(self, stack: contextlib.AsyncExitStack) -> tuple[WeenvSandbox, Any, bool]:
        """The sample's task env (set up), and how to make a clean copy of its start state for
        grading: ``(sandbox, clean_source, clean_source_is_snapshot_needing_no_setup)``."""
        spec, sample = self.spec, self.sample
        from_snapshot = spec.snapshot is not None
        base = spec.snapshot if from_snapshot else spec.plan
        if not spec.setup:
            sb = await self._fresh_task_env(base, from_snapshot, stack)
            return sb, base, from_snapshot  # nothing to set up: the base is the clean state
        wants_clean = spec.evaluator is not None and spec.evaluator.grade_in_clean_env
        group_index = getattr(sample, "group_index", None)
        if not spec.group_fork or group_index is None:
            sb = await self._fresh_task_env(base, from_snapshot, stack)
            if wants_clean:
                try:
                    snapshot = await self._commit(sb)
                except SnapshotUnavailableError:
                    self.state.stats["snapshot_unavailable"] += 1
                else:
                    stack.push_async_callback(self._delete_snapshot, snapshot)
                    return sb, snapshot, True
            return sb, base, False
        return await self._open_from_group(stack, base, from_snapshot, group_index)

    async def _open_from_group(self, stack: contextlib.AsyncExitStack, base: Any, from_snapshot: bool,
                               group_index: Any) -> tuple[WeenvSandbox, Any, bool]:
        templates = self.state.templates
        key = (group_index, spec_fingerprint(self.spec), self.evaluation)
        expected = getattr(self.args, "n_samples_per_eval_prompt" if self.evaluation else "n_samples_per_prompt", None)
        entry, leader = templates.claim(key, expected if isinstance(expected, int) and expected > 0 else None)
        stack.push_async_callback(self._release_group, key, entry)
        self.record["group_role"] = "leader" if leader else "follower"
        if leader:
            try:
                template = await self._create(base, from_snapshot=from_snapshot)
            except BaseException as e:
                templates.fail(key, entry, e if isinstance(e, Exception) else SandboxError("the group leader was cancelled"))
                raise
            try:
                await self._setup(template)
                snapshot = await self._commit(template)
            except SnapshotUnavailableError:
                # No snapshots on this daemon: the leader keeps its env; siblings prepare their own.
                self.state.stats["snapshot_unavailable"] += 1
                templates.publish(entry, None)
                stack.push_async_callback(self._close, template)
                return template, base, False
            except BaseException as e:
                templates.fail(key, entry, e if isinstance(e, Exception) else SandboxError("the group leader was cancelled"))
                await self._close(template)
                raise
            templates.publish(entry, snapshot)
            # Every sample, the leader too, starts from the snapshot: commit keeps files, not
            # processes, and siblings should all see the same start state.
            await self._close(template)
        else:
            with self._env_op("wait_group"):
                try:
                    snapshot = await asyncio.shield(entry.future)
                except Exception as e:
                    raise SandboxError(f"the group's task env could not be prepared: {e}") from e
            if snapshot is None:
                return await self._fresh_task_env(base, from_snapshot, stack), base, False
        self.record["snapshot"] = snapshot
        sb = await self._create(snapshot, from_snapshot=True)
        stack.push_async_callback(self._close, sb)
        return sb, snapshot, True

    async def _release_group(self, key: Any, entry: Any) -> None:
        if not self.state.templates.release(key, entry) or not entry.future.done() or entry.future.exception():
            return
        if entry.future.result() is not None:
            await self._delete_snapshot(entry.future.result())

    async def _delete_snapshot(self, snapshot: str) -> None:
        client = self.state.client
        with self._env_op("delete_snapshot"):
            try:
                async with asyncio.timeout(self.state.settings.client_timeout_s):
                    if hasattr(client, "delete_snapshot"):
                        await client.delete_snapshot(snapshot)
                    else:  # the async client has no wrapper for this route yet
                        await client.delete_snapshot(snapshot)
                self.state.stats["snapshots_deleted"] += 1
            except Exception as e:  # noqa: BLE001 - a leftover snapshot costs disk, not the sample
                logger.warning("[weenv] could not delete snapshot %s: %s", snapshot, e)

    # -- the turns ------------------------------------------------------------------------------

    def _prompt_ids(self) -> list[int]:
        sample = self.sample
        if sample.tokens:
            return list(sample.tokens)
        prompt = sample.prompt
        if isinstance(prompt, list):
            prompt = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return encode(self.tokenizer, prompt)

    def _budget(self, max_new_tokens: Any) -> int | None:
        remaining = None if max_new_tokens is None else int(max_new_tokens) - self.sample.response_length
        context = getattr(self.args, "rollout_max_context_len", None)
        if context:
            left = int(context) - len(self.sample.tokens)
            remaining = left if remaining is None else min(remaining, left)
        return remaining

    async def _call(self, sb: WeenvSandbox, call: ToolCall, turn_record: dict) -> CallResult:
        spec = self.spec
        with self._env_op("tool"):
            # stderr joins stdout in one stream so the model sees them in the order they happened.
            result = await sb.run(f"exec 2>&1\n{call.command}", user=spec.user, timeout_s=spec.command_timeout_s)
        output, cut = clip_output(result.stdout + result.stderr, spec.max_observation_bytes)
        turn_record["calls"].append({"command": call.command[:500], "exit_code": result.exit_code,
                                     "duration_s": round(result.duration_s, 4), "timed_out": result.timed_out,
                                     "output_bytes": len(result.stdout) + len(result.stderr)})
        return CallResult(command=call.command, exit_code=result.exit_code, output=output,
                          timed_out=result.timed_out, timeout_s=spec.command_timeout_s, truncated_bytes=cut)

    async def _turns(self, sb: WeenvSandbox) -> None:
        """Model and tool turns until an end, which raises :class:`_Finished` (or max turns)."""
        args, sample, spec = self.args, self.sample, self.spec
        if not sample.tokens:
            sample.tokens = self._prompt_ids()
        url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
        headers = None
        if sample.session_id and getattr(args, "router_policy", None) == "consistent_hashing":
            headers = {"X-SMG-Routing-Key": sample.session_id}
        max_new_tokens = self.sampling_params.get("max_new_tokens")
        stop = merge_stop(self.sampling_params.get("stop"), tuple(getattr(self.parser, "stop", ()) or ()))
        settings = self.state.settings
        for turn in range(spec.max_turns):
            remaining = self._budget(max_new_tokens)
            if remaining is not None and remaining <= 0:
                raise _Finished("TRUNCATED", "response_budget")
            params = {**self.sampling_params, "stop": stop}
            if remaining is not None:
                params["max_new_tokens"] = remaining
            turn_record: dict[str, Any] = {"turn": turn, "calls": []}
            self.record["turns"].append(turn_record)
            self.record["phase"] = "generate"
            started = time.perf_counter()
            post = _sglang.slime_post(self.state.slime_http_utils)
            if post is not None:
                self.state.stats["sglang_posts_via_slime"] += 1
            out = await _sglang.generate(self.state.http, url, list(sample.tokens), params, headers=headers,
                                         retries=settings.sglang_retries, timeout_s=settings.sglang_timeout_s,
                                         post=post)
            turn_record["gen_s"] = round(time.perf_counter() - started, 4)
            self.record["gen_s"] += time.perf_counter() - started
            turn_record["finish_reason"] = out.finish_reason
            turn_record["new_tokens"] = len(out.token_ids)
            append_tokens(sample, args, tokens=out.token_ids, log_probs=out.log_probs, trainable=True,
                          meta_info=out.meta_info, text=out.text)
            self.last_text = out.text
            if out.finish_reason == "abort":
                raise _Finished("ABORTED", "sglang_abort")
            if out.finish_reason == "length":
                raise _Finished("TRUNCATED", "length")
            text = out.text
            matched = out.meta_info.get("finish_reason", {}).get("matched") \
                if isinstance(out.meta_info.get("finish_reason"), dict) else None
            if isinstance(matched, str) and not text.endswith(matched):
                text += matched  # the stop string was trimmed (no_stop_trim off); the parser needs it
            action = self.parser.parse(text)
            results = [await self._call(sb, call, turn_record) for call in action.calls]
            if action.answer is not None:
                self.answer = action.answer
                raise _Finished("COMPLETED", "answer")
            if not action.calls and action.error is None:
                raise _Finished("COMPLETED", "no_tool_call")
            if turn == spec.max_turns - 1:
                raise _Finished("TRUNCATED", "max_turns")
            if action.error is not None:
                turn_record["format_error"] = action.error
            observation = spec.observation_prefix + self.parser.render_observation(results, error=action.error) \
                + spec.observation_suffix
            ids = encode(self.tokenizer, observation)
            turn_record["observation_tokens"] = len(ids)
            remaining = self._budget(max_new_tokens)
            if remaining is not None and len(ids) >= remaining:
                # No room for the model to answer it: an observation nobody reads is not appended,
                # so the response never outgrows slime's budget.
                raise _Finished("TRUNCATED", "response_budget")
            append_tokens(sample, args, tokens=ids, log_probs=None, trainable=False, meta_info=None,
                          text=observation)

    # -- grading --------------------------------------------------------------------------------

    async def _pack(self, source: WeenvSandbox, paths: list[str]) -> bytes:
        """A tar of ``paths`` (relative to the workdir) from the agent's env; missing ones are left out."""
        quoted = " ".join(shlex.quote(p) for p in paths)
        with self._env_op("copy"):
            packed = await source.run(f"tar -cf - {quoted} 2>/dev/null", cwd=self.spec.workdir or "/",
                                      user=self.spec.user, timeout_s=self.spec.evaluator.timeout_s)
        if getattr(packed, "stdout_truncated", False):
            raise GradingError(f"the files to grade ({', '.join(paths)}) exceed weenv's exec output cap")
        return packed.stdout

    async def _unpack(self, target: WeenvSandbox, data: bytes, paths: list[str]) -> None:
        with self._env_op("copy"):
            unpacked = await target.run("tar -xf -", cwd=self.spec.workdir or "/", user=self.spec.user, stdin=data,
                                        timeout_s=self.spec.evaluator.timeout_s)
        if unpacked.exit_code != 0:
            raise GradingError(f"could not unpack {', '.join(paths)} in the grading env: "
                               f"{unpacked.stderr.decode('utf-8', 'replace')[-300:]}")

    async def _grade(self, task: WeenvSandbox, clean_source: Any, clean_is_ready: bool, status: str,
                     stack: contextlib.AsyncExitStack) -> None:
        evaluator = self.spec.evaluator
        assert evaluator is not None
        label = self.sample.label if isinstance(self.sample.label, str) else json.dumps(self.sample.label, default=str)
        answer = self.answer if self.answer is not None else self.last_text
        env = {**evaluator.env, "WEENV_ANSWER": answer[:MAX_EVALUATOR_VAR_CHARS],
               "WEENV_LABEL": (label or "")[:MAX_EVALUATOR_VAR_CHARS], "WEENV_STATUS": status.lower()}
        target = task
        if evaluator.grade_in_clean_env:
            packed = await self._pack(task, evaluator.copy_paths) if evaluator.copy_paths else b""
            # One env per sample at a time: the agent's goes before the grading env comes.
            await self._close(task)
            self.record["phase"] = "grade"
            target = await self._create(clean_source, from_snapshot=clean_is_ready)
            stack.push_async_callback(self._close, target)
            if not clean_is_ready:
                await self._setup(target)
            if packed:
                await self._unpack(target, packed, evaluator.copy_paths)
        with self._env_op("grade"):
            result = await target.run(evaluator.command, user=evaluator.user or self.spec.user, env=env,
                                      cwd=evaluator.workdir, timeout_s=evaluator.timeout_s)
        value, detail = evaluator_reward(result.exit_code, result.stdout, result.timed_out)
        self.record["grade"] = {"exit_code": result.exit_code, "timed_out": result.timed_out,
                                "duration_s": round(result.duration_s, 4), "reward": value,
                                "clean_env": evaluator.grade_in_clean_env,
                                "output_tail": (result.stdout + result.stderr)[-500:].decode("utf-8", "replace")}
        reward = reward_value(self.args, value, detail)
        self.record["reward"] = reward
        self.sample.reward = reward

    # -- all of it ------------------------------------------------------------------------------

    async def run(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            try:
                await self._run_in(stack)
            except BaseException:
                self.record["failed_phase"] = self.record["phase"]  # before teardown moves it on
                raise
            self.record["phase"] = "teardown"

    async def _run_in(self, stack: contextlib.AsyncExitStack) -> None:
        task, clean_source, clean_is_ready = await self._open_task_env(stack)
        try:
            await self._turns(task)
            status, why = "TRUNCATED", "max_turns"
        except _Finished as end:
            status, why = end.status, end.why
        self.record["end"] = why
        self.record["answer"] = None if self.answer is None else self.answer[:2000]
        if status == "ABORTED":
            raise GenerationAborted("SGLang finished the turn with 'abort'")
        self.sample.status = type(self.sample).Status[status]
        if self.spec.evaluator is not None:
            await self._grade(task, clean_source, clean_is_ready, status, stack)
