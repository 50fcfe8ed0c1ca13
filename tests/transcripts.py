"""Transcripts in the documents are output the code prints today.

A fenced ``console`` block in README.md or docs/*.md is a transcript: each ``$ tjax ...`` line is
run (in one fresh folder per block, in order, so a later command may read an earlier one's run)
and the lines under it must be what it prints, stdout and stderr together, in order. Rules that
keep a transcript short and its check exact where it matters:

- a line ``...`` stands for any number of printed lines;
- ``...`` inside a line stands for any text there;
- throughput, MFU, the measured peak and compile times vary from run to run and are not
  compared; every other number is, to 3 significant digits (XLA's flags move the last digit);
- output that is one JSON object may be shown as a subset: the keys shown, and the first
  items of each list shown.

``python tests/transcripts.py [FILE.md]`` prints each transcript as the code prints it today,
to paste into the document after a change.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Figures that differ between two runs of the same command: left out of the comparison.
VOLATILE_KEYS = ("tokens_per_s", "mfu", "compile_s", "wall_s", "step_s")
VOLATILE = [
    r"[\d,]+ tokens/s", r"MFU [\d.]+%", r"\(compile\) [\d.]+s", r"peak [\d.]+ GFLOP/s",
    *(rf'"{key}": [-\d.e+]+' for key in VOLATILE_KEYS),
]
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?")


@dataclass
class Command:
    argv: list[str]
    expected: list[str]


@dataclass
class Transcript:
    document: Path
    line: int
    commands: list[Command]

    @property
    def name(self) -> str:
        return f"{self.document.name}:{self.line}"


def transcripts(documents: list[Path] = DOCUMENTS) -> list[Transcript]:
    found = []
    for document in documents:
        lines = document.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() != "```console":
                i += 1
                continue
            start, body = i + 1, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            commands: list[Command] = []
            for text in body:
                if text.startswith("$ "):
                    commands.append(Command(shlex.split(text[2:]), []))
                elif commands:
                    commands[-1].expected.append(text)
            found.append(Transcript(document, start, commands))
    return found


def run(argv: list[str], cwd: str) -> list[str]:
    """What ``argv`` prints, stdout and stderr interleaved as a terminal shows them."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TJAX_COMPILE_CACHE": "off"}
    if argv[0] == "tjax":
        argv = [sys.executable, "-m", "transformers_jax.cli", *argv[1:]]
    done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    return [line for line in done.stdout.splitlines() if not _is_noise(line)]


def _is_noise(line: str) -> bool:
    """Lines the platform prints, not tjax: libtpu's complaints on a host without a TPU."""
    return bool(re.match(r"(WARNING: Logging before InitGoogle|E\d{4} |=== Source Location|"
                         r"learning/\w+/tfrc/|Failed to find host bounds)", line))


def _steady(line: str) -> str:
    for pattern in VOLATILE:
        line = re.sub(pattern, "<varies>", line)
    return line


def _numbers_agree(a: str, b: str) -> bool:
    x, y = (float(s.replace(",", "")) for s in (a, b))
    return abs(x - y) <= 5e-3 * max(abs(x), abs(y)) or f"{x:.3g}" == f"{y:.3g}"


def line_matches(expected: str, actual: str) -> bool:
    expected, actual = _steady(expected), _steady(actual)
    pattern, numbers = "", []
    for piece in re.split(r"(\.\.\.|-?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?)", expected):
        if piece == "...":
            pattern += ".*?"
        elif NUMBER.fullmatch(piece or "x"):
            pattern += f"({NUMBER.pattern})"
            numbers.append(piece)
        else:
            pattern += re.escape(piece)
    found = re.fullmatch(pattern, actual)
    return bool(found) and all(_numbers_agree(a, b)
                               for a, b in zip(numbers, found.groups(), strict=True))


def json_subset(expected, actual) -> bool:
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            k in actual and json_subset(v, actual[k]) for k, v in expected.items())
    if isinstance(expected, list):
        return (isinstance(actual, list) and len(expected) <= len(actual)
                and all(json_subset(e, a) for e, a in zip(expected, actual, strict=False)))
    if isinstance(expected, float | int) and not isinstance(expected, bool):
        return (isinstance(actual, float | int) and not isinstance(actual, bool)
                and _numbers_agree(str(expected), str(actual)))
    return expected == actual


def output_matches(expected: list[str], actual: list[str]) -> bool:
    text = "\n".join(expected).strip()
    if text.startswith("{"):  # one JSON object, shown in part
        try:
            shown = json.loads(text)
            printed = json.loads("\n".join(actual))
        except json.JSONDecodeError:
            return False
        return json_subset(_without_volatile(shown), printed)
    return _lines_match(expected, actual)


def _without_volatile(obj):
    if isinstance(obj, dict):
        return {k: _without_volatile(v) for k, v in obj.items() if k not in VOLATILE_KEYS}
    return obj


def _lines_match(expected: list[str], actual: list[str]) -> bool:
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head.strip() == "...":
        return any(_lines_match(rest, actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and line_matches(head, actual[0]) and _lines_match(rest, actual[1:])


def replay(transcript: Transcript) -> list[tuple[Command, list[str]]]:
    with tempfile.TemporaryDirectory(prefix="tjax-transcript-") as folder:
        return [(command, run(command.argv, folder)) for command in transcript.commands]


if __name__ == "__main__":
    chosen = [Path(p).resolve() for p in sys.argv[1:]] or DOCUMENTS
    for transcript in transcripts(chosen):
        print(f"--- {transcript.name}")
        for command, printed in replay(transcript):
            print("$ " + shlex.join(command.argv))
            print("\n".join(printed))
