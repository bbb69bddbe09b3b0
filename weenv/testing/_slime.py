"""Harness for the slime plugin (tests and benchmarks/rollout.py): a stand-in for slime's ``Sample``, a
byte-level tokenizer, slime-like ``args``, and a fake SGLang ``/generate`` server on 127.0.0.1.

``Sample`` mirrors the fields, the nested ``Status`` enum, ``SpecInfo`` / ``PrefixCacheInfo`` and the
``append_response_tokens`` contract of ``slime/utils/types.py`` (THUDM/slime) without torch: model
tokens need log-probs, tool tokens get loss-mask 0, log-prob 0.0 and empty top-p spans (when top-p
replay is on), a ``meta_info`` with ``finish_reason`` adds to ``prefix_cache_info`` (and
``spec_info`` with ``args.sglang_speculative_algorithm``), appends ``weight_version`` and sets the
status; lengths are checked after every append. Not mirrored: decoding SGLang's top-p and
routed-experts arrays out of ``meta_info``. ``LegacySample`` has no ``append_response_tokens``
(older slime), to exercise the plugin's own bookkeeping. ``train_side_checks`` is what slime's
``RolloutManager._convert_samples_to_train_data`` (``slime/ray/rollout.py``) asserts per sample.

The fake server answers from a script: ``reply(prompt_text, payload) -> Reply``, where
``prompt_text`` is the byte-decoded ``input_ids``. ``turns([...])`` picks the reply by how many
observations the prompt already holds, so concurrent episodes each get their own next turn.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

# --------------------------------------------------------------------------- the stand-in Sample


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def append_response_tokens(self, args=None, *, tokens=None, log_probs=None, trainable: bool = True,
                               meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        tokens = [int(t) for t in (tokens or [])]
        log_probs = None if log_probs is None else [float(x) for x in log_probs]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError("trainable log probs appended to a response that has none")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += log_probs
        if tokens and not trainable and self.rollout_top_p_token_offsets is not None:
            if self.rollout_top_p_token_ids is None or not self.rollout_top_p_token_offsets:
                raise ValueError("Cannot append empty top-p spans without existing token ids and offsets.")
            self.rollout_top_p_token_ids = list(self.rollout_top_p_token_ids)
            self.rollout_top_p_token_offsets = list(self.rollout_top_p_token_offsets) + \
                [self.rollout_top_p_token_offsets[-1]] * len(tokens)
        if meta_info is not None and update_terminal_info and "finish_reason" in meta_info:
            if getattr(args, "sglang_speculative_algorithm", False):
                self.spec_info.add(meta_info=meta_info)
            self.prefix_cache_info.add(meta_info=meta_info)
            if "weight_version" in meta_info:
                self.weight_versions.append(meta_info["weight_version"])
            match meta_info["finish_reason"]["type"]:
                case "length":
                    self.status = Sample.Status.TRUNCATED
                case "abort":
                    self.status = Sample.Status.ABORTED
                case "stop":
                    self.status = Sample.Status.COMPLETED
        self._validate_response_metadata_lengths()

    def _validate_response_metadata_lengths(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(f"rollout_log_probs length {len(self.rollout_log_probs)} != {self.response_length}")
        if self.rollout_top_p_token_ids is None and self.rollout_top_p_token_offsets is None:
            return
        if self.rollout_top_p_token_ids is None or self.rollout_top_p_token_offsets is None:
            raise ValueError("rollout top-p replay must include both token ids and offsets.")
        if len(self.rollout_top_p_token_offsets) != self.response_length + 1:
            raise ValueError(f"rollout_top_p_token_offsets length {len(self.rollout_top_p_token_offsets)} "
                             f"!= response_length + 1 ({self.response_length + 1})")
        if int(self.rollout_top_p_token_offsets[-1]) != len(self.rollout_top_p_token_ids):
            raise ValueError("rollout top-p token ids/offsets mismatch")


def train_side_checks(sample: Any, args: Any) -> None:
    """What slime's ``_convert_samples_to_train_data`` asserts on each sample it trains on."""
    loss_mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    assert len(loss_mask) == sample.response_length, f"loss mask {len(loss_mask)} != {sample.response_length}"
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        assert sample.rollout_top_p_token_ids is not None
        assert sample.rollout_top_p_token_offsets is not None
        assert len(sample.rollout_top_p_token_offsets) == sample.response_length + 1
        assert int(sample.rollout_top_p_token_offsets[-1]) == len(sample.rollout_top_p_token_ids)


class LegacySample(Sample):
    """A Sample from before ``append_response_tokens`` existed."""

    append_response_tokens = None  # type: ignore[assignment]


# --------------------------------------------------------------------------- tokenizer and args


class ByteTokenizer:
    """One token per UTF-8 byte; ``decode(encode(t)) == t``. Chat template: ``role: content\\n``."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", "replace")

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True,
                            **kw: Any) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


def byte_tokenizer(args: Any) -> ByteTokenizer:
    """The ``weenv_tokenizer`` factory tests use: ``weenv.testing.byte_tokenizer``."""
    return ByteTokenizer()


def slime_args(server: FakeSGLang | None = None, **overrides: Any) -> SimpleNamespace:
    """``args`` as slime's parser (plus a ``--custom-config-path`` YAML) would leave them."""
    values: dict[str, Any] = dict(
        sglang_router_ip=server.host if server else "127.0.0.1",
        sglang_router_port=server.port if server else 9,
        hf_checkpoint=None,
        n_samples_per_prompt=1,
        n_samples_per_eval_prompt=1,
        rollout_max_context_len=None,
        rollout_max_response_len=4096,
        reward_key=None,
        group_rm=False,
        partial_rollout=False,
        custom_generate_function_path="slime_plugin.rollout.generate",
        custom_rm_path="slime_plugin.rollout.reward",
        weenv_tokenizer="weenv.testing.byte_tokenizer",
        weenv_sglang_retries=0,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def sampling_params(max_new_tokens: int = 4096) -> dict[str, Any]:
    """What slime's GenerateState hands a custom generate function."""
    return dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, stop=None, stop_token_ids=None,
                skip_special_tokens=False, no_stop_trim=True, spaces_between_special_tokens=False)


# --------------------------------------------------------------------------- the fake SGLang server


@dataclass
class Reply:
    """One scripted generation. ``finish``: stop / length / abort. ``log_prob``: for every token."""

    text: str
    finish: str = "stop"
    matched: str | int | None = None
    log_prob: float = -0.25


def turns(replies: list[Reply | str], *, markers: tuple[str, ...] = ("<output exit_code=", "<error>")) \
        -> Callable[[str, dict], Reply]:
    """A script that answers turn k (k = observations already in the prompt) with ``replies[k]``."""

    def reply(prompt_text: str, payload: dict) -> Reply:
        k = sum(prompt_text.count(m) for m in markers)
        r = replies[min(k, len(replies) - 1)]
        return Reply(r) if isinstance(r, str) else r

    return reply


class FakeSGLang:
    """``POST /generate`` on 127.0.0.1 with a scripted ``reply``; ``requests`` records payloads.
    ``fail_next`` answers that many requests with HTTP 503 first; ``latency_s`` delays every answer
    (a model that takes time to generate; requests are served in parallel threads);
    ``weight_version`` is reported in every ``meta_info`` (SGLang's default is ``"default"``)."""

    def __init__(self, latency_s: float = 0.0) -> None:
        self.reply: Callable[[str, dict], Reply] = turns(["<answer>nothing scripted</answer>"])
        self.requests: list[dict] = []
        self.fail_next = 0
        self.latency_s = latency_s
        self.weight_version: str | None = "default"
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                status, answer = fake._answer(self.path, json.loads(body or b"{}"))
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)  # a client that hung up is no error

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False  # keep-alive handler threads end with the process
        self.host, self.port = self._server.server_address[0], self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-sglang", daemon=True)
        self._thread.start()

    def _answer(self, path: str, payload: dict) -> tuple[int, dict]:
        if path != "/generate":
            return 404, {"error": f"no route {path}"}
        with self._lock:
            self.requests.append(payload)
            if self.fail_next > 0:
                self.fail_next -= 1
                return 503, {"error": "overloaded"}
        if self.latency_s:
            time.sleep(self.latency_s)
        prompt = bytes(payload.get("input_ids", [])).decode("utf-8", "replace")
        r = self.reply(prompt, payload)
        ids = list(r.text.encode("utf-8"))
        limit = payload.get("sampling_params", {}).get("max_new_tokens")
        text, finish = r.text, r.finish
        if limit is not None and len(ids) > limit:
            ids, finish = ids[:limit], "length"
            text = bytes(ids).decode("utf-8", "ignore")
        finish_reason: dict[str, Any] = {"type": finish}
        if finish == "stop":
            finish_reason["matched"] = r.matched
        if finish == "abort":
            finish_reason["message"] = "Abort before prefill"
        meta = {"finish_reason": finish_reason, "prompt_tokens": len(payload.get("input_ids", [])),
                "completion_tokens": len(ids), "cached_tokens": 0,
                "output_token_logprobs": [[r.log_prob, t, None] for t in ids]}
        if self.weight_version is not None:
            meta["weight_version"] = self.weight_version
        return 200, {"text": text, "meta_info": meta}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
