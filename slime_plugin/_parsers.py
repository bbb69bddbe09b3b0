"""Tool-call parsers: how a model's turn becomes commands, and how results go back to it.

A parser is two methods plus the stop strings that end a turn at a call boundary:

``parse(text) -> Action``
    The model's text for one turn → the commands to run in order, the final answer if the turn
    gave one, or a format error to show the model (so it can correct itself next turn).
``render_observation(results) -> str``
    What the model sees after the commands ran (exit code, output, timeouts).

Built in (choose with ``parser:`` in the weenv settings, or give ``package.module.factory``):

``bash`` (default)
    ``<bash>ls -la</bash>`` runs a shell command; ``<answer>42</answer>`` ends the episode. An
    observation is ``<output exit_code="0">…</output>``. Stop strings ``</bash>``, ``</answer>``
    keep the model from writing past its own call.
``hermes``
    Hermes/Qwen style ``<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>``,
    ``<tool_call>{"name": "submit", "arguments": {"answer": "42"}}</tool_call>`` or
    ``<answer>…</answer>`` to finish; observations are ``<tool_response>…</tool_response>``.

The logic is pure (no I/O); the rollout does the running.
"""

from __future__ import annotations

import abc
import importlib
import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One command to run in the sandbox (through ``/bin/sh -c``)."""

    command: str


@dataclass(frozen=True)
class Action:
    """What one model turn asked for. ``calls`` run in order; ``answer`` (not ``None``) ends the
    episode after them; ``error`` is shown to the model when the turn was malformed."""

    calls: tuple[ToolCall, ...] = ()
    answer: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class CallResult:
    """The outcome of one :class:`ToolCall` as the parser renders it back."""

    command: str
    exit_code: int
    output: str
    timed_out: bool = False
    timeout_s: float | None = None
    truncated_bytes: int = 0


class ToolCallParser(abc.ABC):
    """The parser seam. Subclass it (or duck-type ``stop``, ``parse``, ``render_observation``)."""

    #: Strings after which SGLang should stop generating: the end of a call or of an answer.
    stop: tuple[str, ...] = ()

    @abc.abstractmethod
    def parse(self, text: str) -> Action:
        """The action in one turn of model text; never raises on malformed text."""

    @abc.abstractmethod
    def render_observation(self, results: list[CallResult], *, error: str | None = None) -> str:
        """The text appended after a turn (non-trainable), for the model's next turn."""


def _result_note(r: CallResult) -> str:
    # Cut output is marked inside ``output`` itself (where the cut is); only timeouts need a note.
    return f"[command timed out after {r.timeout_s:g} s and was killed]" if r.timed_out else ""


def _join(output: str, note: str) -> str:
    if output and not output.endswith("\n"):
        output += "\n"
    return output + (note + "\n" if note else "")


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class BashBlockParser(ToolCallParser):
    """``<bash>…</bash>`` calls, ``<answer>…</answer>`` to finish (see the module docstring)."""

    stop = ("</bash>", "</answer>")
    _CALL = re.compile(r"<bash>(.*?)</bash>", re.S)

    def __init__(self, max_calls_per_turn: int = 8):
        self.max_calls_per_turn = max_calls_per_turn

    def parse(self, text: str) -> Action:
        calls = tuple(ToolCall(m.group(1).strip()) for m in self._CALL.finditer(text))
        answer_match = _ANSWER.search(text)
        answer = answer_match.group(1).strip() if answer_match else None
        if len(calls) > self.max_calls_per_turn:
            return Action(error=f"at most {self.max_calls_per_turn} <bash> blocks per turn; none were run")
        if any(not c.command for c in calls):
            return Action(error="an empty <bash></bash> block; put a shell command inside it")
        if not calls and answer is None and "<bash>" in text:
            return Action(error="a <bash> block without its closing </bash>; none was run")
        return Action(calls=calls, answer=answer)

    def render_observation(self, results: list[CallResult], *, error: str | None = None) -> str:
        if error is not None:
            return f"\n<error>{error}</error>\n"
        parts = [
            f'\n<output exit_code="{r.exit_code}">\n{_join(r.output, _result_note(r))}</output>' for r in results
        ]
        return "".join(parts) + "\n"


class HermesToolCallParser(ToolCallParser):
    """Hermes/Qwen ``<tool_call>{json}</tool_call>`` calls (see the module docstring)."""

    stop = ("</tool_call>", "</answer>")
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
    command_tools = ("bash", "shell", "execute_bash", "run")
    submit_tools = ("submit", "finish", "answer")

    def __init__(self, max_calls_per_turn: int = 8):
        self.max_calls_per_turn = max_calls_per_turn

    def parse(self, text: str) -> Action:
        calls: list[ToolCall] = []
        answer_match = _ANSWER.search(text)
        answer = answer_match.group(1).strip() if answer_match else None
        for m in self._CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError as e:
                return Action(error=f"a <tool_call> is not valid JSON ({e.msg} at char {e.pos}); none were run")
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return Action(error='a <tool_call> needs {"name": ..., "arguments": {...}}; none were run')
            arguments = obj.get("arguments", {})
            if isinstance(arguments, str):  # some templates emit the arguments JSON-encoded twice
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return Action(error=f"the arguments of tool {obj['name']!r} are not a JSON object; none were run")
            if not isinstance(arguments, dict):
                return Action(error=f"the arguments of tool {obj['name']!r} are not a JSON object; none were run")
            name = obj["name"]
            if name in self.command_tools:
                command = arguments.get("command", arguments.get("cmd"))
                if not isinstance(command, str) or not command.strip():
                    return Action(error=f'tool {name!r} needs a string "command" argument; none were run')
                calls.append(ToolCall(command.strip()))
            elif name in self.submit_tools:
                value = arguments.get("answer", arguments.get("result", ""))
                answer = value if isinstance(value, str) else json.dumps(value)
            else:
                known = ", ".join(self.command_tools[:1] + self.submit_tools[:1])
                return Action(error=f"unknown tool {name!r} (tools: {known}); none were run")
        if len(calls) > self.max_calls_per_turn:
            return Action(error=f"at most {self.max_calls_per_turn} tool calls per turn; none were run")
        if not calls and answer is None and "<tool_call>" in text:
            return Action(error="a <tool_call> without its closing </tool_call>; none was run")
        return Action(calls=tuple(calls), answer=answer)

    def render_observation(self, results: list[CallResult], *, error: str | None = None) -> str:
        if error is not None:
            return f"\n<tool_response>\nerror: {error}\n</tool_response>\n"
        parts = [
            f"\n<tool_response>\nexit_code: {r.exit_code}\n{_join(r.output, _result_note(r))}</tool_response>"
            for r in results
        ]
        return "".join(parts) + "\n"


BUILTIN_PARSERS = {"bash": BashBlockParser, "hermes": HermesToolCallParser}


_loaded: dict[str, ToolCallParser] = {}


def load_parser(name: str) -> ToolCallParser:
    """A built-in parser by name, or ``package.module.factory`` called with no arguments.

    Raises :class:`ValueError` (the config layer names the setting) when it cannot be found or
    does not look like a parser."""
    if name in _loaded:
        return _loaded[name]  # type: ignore[return-value]
    if name in BUILTIN_PARSERS:
        parser: object = BUILTIN_PARSERS[name]()
    else:
        module_name, _, attr = name.rpartition(".")
        if not module_name:
            raise ValueError(f"unknown parser {name!r}: use one of {sorted(BUILTIN_PARSERS)} or package.module.factory")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load parser {name!r}: {e}") from e
        try:
            parser = factory()
        except Exception as e:  # noqa: BLE001 - reported as a bad setting, with the cause
            raise ValueError(f"parser factory {name!r} failed: {type(e).__name__}: {e}") from e
    missing = [a for a in ("parse", "render_observation") if not callable(getattr(parser, a, None))]
    if missing:
        raise ValueError(f"parser {name!r} has no {', '.join(missing)} method")
    _loaded[name] = parser
    return parser  # type: ignore[return-value]
