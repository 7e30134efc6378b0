"""Every fenced shell command in README.md and docs/*.md runs here, or says why it cannot.

Each ```sh / ```bash / ```shell block is classified by the line right before its fence:

* no marker: **run**. The block, as written, runs in bash (``-e -o pipefail``) from the repository
  root and must exit 0 within ``RUN_TIMEOUT_S``.
* ``<!-- doc-test: help: <why> -->``: **the command's contract**, for servers, benchmarks and load
  runs, which as written bind the doc's fixed ports or run for minutes. Each command's program
  must be installed, ``<program> [sub-command] --help`` must exit 0 and declare every option the
  command uses, and every repository path it names must exist. That proves the command would
  start parsing as documented, not that it works: the reason names where it runs for real
  (``tests/smoke/test_wheel.py`` starts pd-router's servers from the built wheel on free ports).
* ``<!-- doc-test: skip: <why> -->``: **not for this machine** (a Kubernetes cluster, a router
  already running on a fixed port, CI itself); the reason is required.

A fence without a language whose first command is a known program fails until it is labelled
``sh`` (and so classified), and a marker anywhere but right before a shell fence fails, so a
marker cannot silently stop covering the block it was written for.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell"}
# First words that make an unlabelled fence a command listing rather than program output.
COMMANDS = {"pd-router", "python", "python3", "pip", "curl", "kubectl", "helm", "locust", "bash", "docker"}
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<kind>[\w-]+)\s*:\s*(?P<why>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[^\s`]*)")
RUN_TIMEOUT_S = 120.0
HELP_TIMEOUT_S = 60.0
SHELL_OPERATORS = {"&&", "||", "|", ";", "&", ">", ">>", "<"}


@dataclass(frozen=True)
class Block:
    where: str  # file:line of the opening fence
    lang: str
    body: str
    kind: str  # run | help | skip
    why: str

    def commands(self) -> list[str]:
        """One string per command: continuation lines joined, comment-only and blank lines dropped."""
        joined = re.sub(r"\\\n\s*", " ", self.body)
        return [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]


def parse(text: str, rel: str) -> tuple[list[Block], list[str]]:
    """The shell blocks of one Markdown file, and what is wrong with its markers and unlabelled
    fences; ``rel`` names the file in both."""
    blocks: list[Block] = []
    problems: list[str] = []
    lines = text.splitlines()
    markers = {i for i, line in enumerate(lines) if MARKER.match(line)}
    used: set[int] = set()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, lang = opening["fence"], opening["lang"].lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        indent = len(opening["indent"])
        body = "\n".join(line[indent:] for line in lines[i + 1 : end])
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        if lang in SHELL:
            kind, why = "run", ""
            if marker is not None:
                used.add(i - 1)
                kind, why = marker["kind"], marker["why"]
                if kind not in ("help", "skip"):
                    problems.append(f"{rel}:{i}: unknown doc-test kind {kind!r} (help or skip)")
                if not why:
                    problems.append(f"{rel}:{i}: a doc-test marker needs its reason")
            blocks.append(Block(f"{rel}:{i + 1}", lang, body, kind, why))
        elif not lang:
            words = [line.split()[0] for line in body.splitlines() if line.strip()]
            if words and words[0] in COMMANDS:
                problems.append(f"{rel}:{i + 1}: a command block without a language: label it ```sh")
        i = end + 1
    problems += [f"{rel}:{m + 1}: a doc-test marker not right before a shell fence" for m in markers - used]
    return blocks, problems


def parsed(path: Path) -> tuple[list[Block], list[str]]:
    return parse(path.read_text(), str(path.relative_to(REPO)))


def all_blocks() -> list[Block]:
    return [block for path in DOCS for block in parsed(path)[0]]


def shell_env() -> dict[str, str]:
    """This interpreter's bin directory first: ``python3``, ``pd-router`` and ``locust`` are the
    ones installed with it."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_every_shell_block_is_classified() -> None:
    problems = [problem for path in DOCS for problem in parsed(path)[1]]
    assert not problems, "\n".join(problems)
    kinds = {block.kind for block in all_blocks()}
    # The extraction itself still works: the README has blocks of every kind.
    assert kinds == {"run", "help", "skip"}, kinds


def test_the_classifier_rejects_what_it_should() -> None:
    blocks, problems = parse(
        "<!-- doc-test: skip: -->\n```sh\nkubectl get pods\n```\n\n"
        "<!-- doc-test: help: a marker before yaml -->\n```yaml\na: 1\n```\n\n"
        "```\ncurl -s localhost:9090/metrics\n```\n\n"
        "```\nrequests  12 ok\n```\n",
        "probe.md",
    )
    assert [b.kind for b in blocks] == ["skip"]
    assert any("needs its reason" in p for p in problems)
    assert any("not right before a shell fence" in p for p in problems)
    assert any("label it ```sh" in p for p in problems)
    assert len(problems) == 3, problems  # program output in an unlabelled fence is fine


@functools.cache
def help_text(program: tuple[str, ...]) -> str:
    done = subprocess.run(
        [*program, "--help"],
        cwd=REPO,
        env=shell_env(),
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{shlex.join(program)} --help: exit {done.returncode}\n{done.stderr}"
    return done.stdout


def program_of(tokens: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(the program with its sub-commands, the rest of the command line)."""
    if tokens[0] in ("python", "python3") and tokens[1:2] == ["-m"]:
        program, rest = [sys.executable, "-m", tokens[2]], tokens[3:]
    else:
        found = shutil.which(tokens[0], path=shell_env()["PATH"])
        assert found is not None, f"{tokens[0]}: not installed"
        program, rest = [found], tokens[1:]
    while rest and not rest[0].startswith("-"):  # sub-commands: the words before the first option
        program.append(rest.pop(0))
    return tuple(program), rest


def check_contract(command: str) -> None:
    tokens = shlex.split(command, comments=True)
    assert not SHELL_OPERATORS & set(tokens), f"{command!r}: one command per line for a help contract"
    program, rest = program_of(tokens)
    text = help_text(program)
    for token in rest:
        if token.startswith("-") and not re.fullmatch(r"-\d[\d.]*", token):
            option = token.split("=", 1)[0]
            declared = re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text)
            assert declared, f"{command!r}: {shlex.join(program)} --help does not declare {option}"
        elif "/" in token and not token.startswith("/") and (REPO / token.split("/")[0]).exists():
            # A repository path (an absolute one is the reader's, e.g. a checkout made beforehand)
            assert (REPO / token).exists(), f"{command!r}: {token} does not exist in the repository"


RUNNABLE = [b for b in all_blocks() if b.kind in ("run", "help")]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_shell_block(block: Block) -> None:
    if block.kind == "help":
        for command in block.commands():
            check_contract(command)
        return
    # Its own process group, so a command that overruns is stopped with everything it started.
    proc = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", block.body],
        cwd=REPO,
        env=shell_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{block.where}: still running after {RUN_TIMEOUT_S:.0f} s (mark it help or skip)\n{err}")
    assert proc.returncode == 0, f"{block.where}: exit {proc.returncode}\n{out}\n{err}"
