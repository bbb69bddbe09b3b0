"""Reading a Dockerfile for ``weenv build -f``: dockerfile-parse splits it into instructions (line
continuations, comments, parser directives, the JSON forms); this module turns them into stages
of typed instructions, with ARG / ENV substitution done as Docker does it (``$VAR``, ``${VAR}``,
``${VAR:-default}``, quotes) by dockerfile-parse's word splitter.

What is refused, naming the line: instructions weenv does not carry out (``VOLUME``, ``ONBUILD``,
``HEALTHCHECK``, ``MAINTAINER``), BuildKit's ``RUN --mount`` / ``--network`` / ``--security``,
``ADD`` of a URL or a git repository (a build fetches nothing), ``FROM scratch`` and
``FROM --platform``, flags an instruction does not take.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field

from ._build import BuildError

SUPPORTED = ("FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "LABEL", "EXPOSE", "CMD",
             "ENTRYPOINT", "SHELL", "STOPSIGNAL")
REFUSED = {
    "VOLUME": "a weenv env's filesystem is one overlay; mount what you need with the plan's [[mounts]]",
    "ONBUILD": "triggers for later builds are not kept",
    "HEALTHCHECK": "weenv does not run health checks",
    "MAINTAINER": "deprecated by Docker: use LABEL maintainer=...",
}
COPY_FLAGS = {"COPY": ("from", "chown", "chmod", "link", "parents", "exclude"), "ADD": ("chown", "chmod", "link")}


class DockerfileError(BuildError):
    """A Dockerfile weenv cannot build; the message names the file and line."""


@dataclass
class Instruction:
    line: int
    op: str
    value: str
    """The text after the instruction word, continuations joined (not yet substituted)."""
    flags: dict[str, str] = field(default_factory=dict)
    exec_form: list[str] | None = None
    """The JSON array form of RUN / CMD / ENTRYPOINT / SHELL / COPY / ADD, when written so."""

    def where(self, path: str) -> str:
        return f"{path}:{self.line}: {self.op}"


@dataclass
class Stage:
    index: int
    base: str
    name: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: str
    global_args: list[Instruction]
    stages: list[Stage]

    def stage(self, ref: str, before: int, where: str) -> Stage:
        """The stage ``--from=`` / ``FROM`` names: an earlier stage's name or index."""
        for s in self.stages[:before]:
            if s.name is not None and s.name == ref.lower():
                return s
        if ref.isdigit() and int(ref) < before:
            return self.stages[int(ref)]
        raise DockerfileError(f"{where}: no earlier stage is named {ref!r}")


def words(text: str, args: dict[str, str], envs: dict[str, str]) -> list[str]:
    """``text`` split into words with quotes removed and ``$VAR`` substituted (Docker's rules,
    dockerfile-parse's splitter)."""
    from dockerfile_parse.util import WordSplitter

    return list(WordSplitter(_modifiers(text, {**args, **envs}), args=args, envs=envs).split(dequote=True))


def _modifiers(text: str, values: dict[str, str]) -> str:
    """``${VAR:-word}`` and ``${VAR:+word}``, which the splitter leaves alone, resolved first."""
    import re

    def one(m: re.Match[str]) -> str:
        name, op, word = m.group(1), m.group(2), m.group(3)
        have = values.get(name, "")
        return (have or word) if op == "-" else (word if have else "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*):([-+])([^}]*)\}", one, text)


def substitute(text: str, args: dict[str, str], envs: dict[str, str]) -> str:
    """``text`` with ``$VAR`` substituted and quotes removed, its words joined by one space."""
    return " ".join(words(text, args, envs))


def _split_flags(ins: Instruction, allowed: tuple[str, ...], path: str) -> None:
    rest = ins.value.lstrip()
    while rest.startswith("--"):
        word, _, tail = rest.partition(" ")
        key, eq, val = word[2:].partition("=")
        if key not in allowed:
            raise DockerfileError(f"{ins.where(path)}: flag --{key} is not supported"
                                  + (f" (supported: {', '.join('--' + a for a in allowed)})" if allowed else ""))
        ins.flags[key] = val if eq else "true"
        rest = tail.lstrip()
    ins.value = rest


def _exec_form(value: str) -> list[str] | None:
    """The JSON array of an exec-form instruction; None when it is shell form (Docker, too,
    takes text that does not parse as a JSON array of strings as shell form)."""
    text = value.strip()
    if not text.startswith("["):
        return None
    try:
        got = json.loads(text)
    except ValueError:
        return None
    return got if isinstance(got, list) and all(isinstance(x, str) for x in got) else None


def parse(text: str, path: str = "Dockerfile") -> Dockerfile:
    """The stages of Dockerfile ``text`` (``path`` names it in errors); DockerfileError naming
    the line for what weenv does not build."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(fileobj=io.BytesIO(text.encode("utf-8")), env_replace=False)
    try:
        structure = parser.structure
    except Exception as e:  # noqa: BLE001 - the parser's own errors are not one type
        raise DockerfileError(f"{path}: cannot be parsed: {e}") from None
    global_args: list[Instruction] = []
    stages: list[Stage] = []
    for item in structure:
        op = str(item["instruction"]).upper()
        line = int(item["startline"]) + 1
        ins = Instruction(line, op, str(item["value"]))
        if op == "COMMENT":
            continue
        if op in REFUSED:
            raise DockerfileError(f"{ins.where(path)} is not supported: {REFUSED[op]}")
        if op not in SUPPORTED:
            raise DockerfileError(f"{ins.where(path)}: unknown instruction")
        if op == "FROM":
            _split_flags(ins, (), path)
            parts = ins.value.split()
            if len(parts) not in (1, 3) or (len(parts) == 3 and parts[1].lower() != "as"):
                raise DockerfileError(f"{ins.where(path)}: expected FROM IMAGE [AS NAME], got {ins.value!r}")
            stages.append(Stage(len(stages), parts[0], parts[2].lower() if len(parts) == 3 else None, line))
            continue
        if not stages:
            if op != "ARG":
                raise DockerfileError(f"{ins.where(path)}: only ARG may come before the first FROM")
            global_args.append(ins)
            continue
        if op in COPY_FLAGS:
            _split_flags(ins, COPY_FLAGS[op], path)
        elif op == "RUN":
            _split_flags(ins, (), path)  # BuildKit's --mount, --network, --security: not carried out
        if op in ("RUN", "CMD", "ENTRYPOINT", "SHELL", "COPY", "ADD"):
            ins.exec_form = _exec_form(ins.value)
            if op == "SHELL" and not ins.exec_form:
                raise DockerfileError(f"{ins.where(path)}: SHELL takes a JSON array, e.g. [\"/bin/bash\", \"-c\"]")
        stages[-1].instructions.append(ins)
    if not stages:
        raise DockerfileError(f"{path}: no FROM instruction")
    return Dockerfile(path, global_args, stages)


def key_values(ins: Instruction, args: dict[str, str], envs: dict[str, str], path: str) -> list[tuple[str, str]]:
    """``ENV`` / ``LABEL`` / ``ARG`` pairs (``K=V ...``, or the old ``ENV K V`` form), substituted."""
    from dockerfile_parse.util import extract_key_values

    if not ins.value.strip():  # dockerfile-parse fails on it with an IndexError
        raise DockerfileError(f"{ins.where(path)}: expected NAME=VALUE")
    try:
        pairs = extract_key_values(env_replace=ins.op != "ARG", args=dict(args), envs=dict(envs),
                                   instruction_value=ins.value)
    except Exception as e:  # noqa: BLE001
        raise DockerfileError(f"{ins.where(path)}: {e}") from None
    if not pairs:
        raise DockerfileError(f"{ins.where(path)}: expected NAME=VALUE")
    return [(str(k), str(v)) for k, v in pairs]


def arg_values(ins: Instruction, args: dict[str, str], envs: dict[str, str], path: str) -> list[tuple[str, str | None]]:
    """``ARG NAME[=default] ...``: each name with its default (None: none given)."""
    import re

    out: list[tuple[str, str | None]] = []
    for w in words(ins.value, args, envs):
        name, eq, default = w.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise DockerfileError(f"{ins.where(path)}: {name!r} is not an argument name")
        out.append((name, default if eq else None))
    if not out:
        raise DockerfileError(f"{ins.where(path)}: expected NAME[=DEFAULT]")
    return out


def argv_of(ins: Instruction, shell: list[str]) -> list[str]:
    """The argv of RUN / CMD / ENTRYPOINT: the exec form as written, else ``SHELL + [text]`` (the
    shell substitutes variables then, not the builder)."""
    return list(ins.exec_form) if ins.exec_form is not None else [*shell, ins.value]


def exposed(ins: Instruction, args: dict[str, str], envs: dict[str, str], path: str) -> list[str]:
    import re

    out = []
    for w in words(ins.value, args, envs):
        m = re.fullmatch(r"([0-9]{1,5})(?:/(tcp|udp|sctp))?", w.lower())
        if m is None or not 0 < int(m.group(1)) < 65536:
            raise DockerfileError(f"{ins.where(path)}: {w!r} is not PORT[/tcp|udp|sctp]")
        out.append(f"{int(m.group(1))}/{m.group(2) or 'tcp'}")
    return out


__all__ = ["Dockerfile", "DockerfileError", "Instruction", "Stage", "arg_values", "argv_of", "exposed", "key_values", "parse",
           "substitute", "words"]
