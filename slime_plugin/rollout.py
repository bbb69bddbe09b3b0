"""slime entry points: a multi-turn, tool-using custom generate function and its reward function.

    --custom-generate-function-path slime_plugin.rollout.generate
    --custom-rm-path slime_plugin.rollout.reward
    --custom-config-path weenv.yaml          # weenv_plan, weenv_evaluator, ... (docs/slime.md)

``generate`` runs one sample's episode in its own weenv env (prepared once per group and forked
when snapshots are available), talks token ids to SGLang, runs the model's tool calls, appends
their output as non-trainable tokens and grades the result. It never raises for a failure of the
environment, SGLang or the configuration: the sample comes back ABORTED with ``reward = 0.0``,
``remove_sample = True`` and ``metadata["abort_reason"]``. Its envs are always killed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ._config import resolve_env_spec, resolve_rollout_settings
from ._episode import MAX_EVALUATOR_VAR_CHARS, RUN_KEY, Episode, evaluator_reward, mark_aborted, reset_response, reward_value
from ._errors import ConfigError, GradingError, SlimePluginError
from ._parsers import load_parser
from ._state import close_loop_states, load_tokenizer, loop_state, loop_states

logger = logging.getLogger(__name__)

__all__ = ["RUN_KEY", "aclose", "generate", "reward", "statistics"]


def _new_record() -> dict[str, Any]:
    return {"envs": [], "turns": [], "env_s": 0.0, "gen_s": 0.0, "env_ops_s": {}, "phase": "config"}


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """slime custom generate function (``--custom-generate-function-path``); returns ``sample``.

    The outcome is in ``sample.status`` (COMPLETED, TRUNCATED or ABORTED), ``sample.reward`` (set
    when an evaluator is configured), the token fields, and ``sample.metadata["weenv_run"]``: env
    ids, per-turn finish reasons, tool exit codes and timings, env-seconds, the grade."""
    started = time.perf_counter()
    record = _new_record()
    reset_response(sample)
    try:
        settings = resolve_rollout_settings(args)
        spec = resolve_env_spec(args, sample)
        try:
            parser = load_parser(spec.parser)
        except ValueError as e:
            raise ConfigError("parser", str(e)) from None
        state = loop_state(settings)
        record["phase"] = "tokenizer"
        tokenizer = await load_tokenizer(args, settings)
        episode = Episode(args=args, sample=sample, sampling_params=sampling_params, spec=spec, parser=parser,
                          state=state, tokenizer=tokenizer, evaluation=evaluation, record=record)
        async with asyncio.timeout(settings.episode_timeout_s):
            await episode.run()
    except TimeoutError:
        _abort(sample, args, record, f"{_phase(record)}/episode_timeout: the sample ran past episode_timeout_s")
    except SlimePluginError as e:
        _abort(sample, args, record, f"{_phase(record)}/{e.reason}: {e}")
    except Exception as e:  # noqa: BLE001 - a bug here must cost one sample, not the rollout manager
        logger.exception("[weenv] sample %s: unexpected error in phase %s", getattr(sample, "index", "?"),
                         _phase(record))
        _abort(sample, args, record, f"{_phase(record)}/internal: {type(e).__name__}: {e}")
    finally:
        record["wall_s"] = round(time.perf_counter() - started, 4)
        record["env_s"] = round(record["env_s"], 4)
        record["gen_s"] = round(record["gen_s"], 4)
        record["env_ops_s"] = {k: round(v, 4) for k, v in record["env_ops_s"].items()}
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        sample.metadata = {**metadata, RUN_KEY: record}
        if hasattr(sample, "non_generation_time"):
            sample.non_generation_time = (sample.non_generation_time or 0.0) + record["env_s"]
    return sample


def _phase(record: dict) -> str:
    return record.get("failed_phase") or record["phase"]


def _abort(sample: Any, args: Any, record: dict, reason: str) -> None:
    record["abort_reason"] = reason
    mark_aborted(sample, args, reason)
    logger.warning("[weenv] sample %s aborted: %s", getattr(sample, "index", "?"), reason)


async def reward(args: Any, sample_or_samples: Any, **kwargs: Any) -> Any:
    """slime reward function (``--custom-rm-path``): one sample → its reward, a list → a list.

    Returns the reward the episode computed. A sample without one (made by another generate
    function) is graded now: a fresh env from its weenv settings, the evaluator run with
    ``WEENV_ANSWER`` = the response. If that fails, the reward is 0.0 and ``remove_sample`` is set."""
    if isinstance(sample_or_samples, list):
        return list(await asyncio.gather(*(_reward_one(args, s) for s in sample_or_samples)))
    return await _reward_one(args, sample_or_samples)


async def _reward_one(args: Any, sample: Any) -> Any:
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    record = metadata.get(RUN_KEY)
    if isinstance(record, dict) and "reward" in record:
        return record["reward"]
    if isinstance(record, dict) and "abort_reason" in record:
        return reward_value(args, 0.0)
    try:
        return await _grade_response(args, sample)
    except Exception as e:  # noqa: BLE001 - see the docstring: a failed grade must not end the rollout
        reason = f"grading/{e.reason if isinstance(e, SlimePluginError) else 'internal'}: {e}"
        logger.warning("[weenv] sample %s: reward failed: %s", getattr(sample, "index", "?"), reason)
        sample.remove_sample = True
        sample.metadata = {**metadata, "abort_reason": reason}
        return reward_value(args, 0.0)


async def _grade_response(args: Any, sample: Any) -> Any:
    settings = resolve_rollout_settings(args)
    spec = resolve_env_spec(args, sample)
    evaluator = spec.evaluator
    if evaluator is None:
        raise GradingError("no evaluator configured (metadata.weenv.evaluator or args.weenv_evaluator)")
    record = _new_record()
    # An episode without turns: its env handling (slots, admission retries, teardown) is reused.
    episode = Episode(args=args, sample=sample, sampling_params={}, spec=spec, parser=None,
                      state=loop_state(settings), tokenizer=None, evaluation=False, record=record)
    from_snapshot = spec.snapshot is not None
    sb = await episode._create(spec.snapshot if from_snapshot else spec.plan, from_snapshot=from_snapshot)
    try:
        await episode._setup(sb)
        label = sample.label if isinstance(sample.label, str) else ("" if sample.label is None else str(sample.label))
        env = {**evaluator.env, "WEENV_ANSWER": (sample.response or "")[:MAX_EVALUATOR_VAR_CHARS],
               "WEENV_LABEL": label[:MAX_EVALUATOR_VAR_CHARS],
               "WEENV_STATUS": str(getattr(sample.status, "value", sample.status))}
        result = await sb.run(evaluator.command, user=evaluator.user or spec.user, env=env, cwd=evaluator.workdir,
                              timeout_s=evaluator.timeout_s)
    finally:
        await episode._close(sb)
    value, detail = evaluator_reward(result.exit_code, result.stdout, result.timed_out)
    out = reward_value(args, value, detail)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    merged = dict(metadata.get(RUN_KEY) or {})
    merged["reward"] = out
    merged["grade"] = {"exit_code": result.exit_code, "timed_out": result.timed_out, "reward": value,
                       "clean_env": True, "env": sb.sandbox_id, "env_s": round(record["env_s"], 4)}
    sample.metadata = {**metadata, RUN_KEY: merged}
    return out


def statistics() -> dict[str, int]:
    """Env operation counts of the running event loop (``created_from_plan``,
    ``created_from_snapshot``, ``commits``, ``kills``, ``snapshot_unavailable``, ...)."""
    total: dict[str, int] = {}
    for state in loop_states():
        for key, value in state.stats.items():
            total[key] = total.get(key, 0) + value
        total["group_leaders"] = total.get("group_leaders", 0) + state.templates.leaders
        total["group_followers"] = total.get("group_followers", 0) + state.templates.followers
    return total


async def aclose() -> None:
    """Close the weenv and SGLang clients of the running event loop (at the end of a process or
    test; slime never calls it, and a process exit is just as good)."""
    await close_loop_states()
