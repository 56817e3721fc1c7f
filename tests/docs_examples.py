"""The examples of README.md and docs/*.md: parsed, run in a shell, compared, and refreshed.

The convention (docs/development.md, "Examples in the docs") is carried by the fence's info string:

- ```console   `$ ` lines are commands (a trailing `\\` continues on the next line, which may start
  with `> `); the lines after a command, up to the next `$ `, are what it prints, stdout and stderr
  together as a terminal shows them. A line `...` stands for any number of lines; a figure with
  decimals or an exponent may differ by one in its last printed digit.
- ```sh        every line is a command (`#` comments allowed); what it prints is not checked.
- Every command must exit 0, unless the block's next command is `echo $?`, which shows the code.
- `not-run: REASON` after the language: the block is not run (a real model, a GPU, llama.cpp).
- `needs=PROGRAM`: the block runs only where PROGRAM is installed (jq, say).
- `file=PATH` (any language): the block is an excerpt of PATH, verbatim.
- Every fence names its language; `text`, `python`, `json` and `toml` blocks are never run (and
  hold no `$ ` command; a synopsis such as `qtool quantize INPUT [options]` is fine).

A document's blocks run in order, each in its own bash, in one fresh directory holding copies of
sample_weights/ and examples/ (so an example may use a file an earlier one wrote), with the venv's
`qtool` first on PATH, COLUMNS=100 and every stream a pipe (no colour, no progress bars).
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ("console", "sh")
QUIET = ("text", "python", "json", "toml")
ELLIPSIS = "..."
ECHO_STATUS = "echo $?"
MARK = "@@qtool-docs-step@@"
SHOWN_PATH = "/path/to/qtool"  # the temporary directory, as the docs show it
# What the shell that runs the examples must not inherit: it changes what qtool prints.
UNSET = ("FORCE_COLOR", "CLICOLOR_FORCE", "PY_COLORS", "TTY_COMPATIBLE", "TTY_INTERACTIVE",
         "QTOOL_KERNEL", "QTOOL_DEBUG", "LINES", "PYTHONWARNINGS")  # fmt: skip
_FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")


def documents(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def shown(path: Path) -> str:
    """A path as failure messages name it: relative to the repository."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its info string, and its lines (indentation removed)."""

    doc: Path
    line: int  # 0-based index of the opening fence in the document
    indent: str
    lang: str
    info: str
    body: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{shown(self.doc)}:{self.line + 1}"

    def option(self, key: str) -> str | None:
        """`key=value` from the info string, or the text after `not-run:`."""
        if key == "not-run":
            return self.info.split("not-run:", 1)[1].strip() if "not-run:" in self.info else None
        match = re.search(rf"(?:^|\s){re.escape(key)}=(\S+)", self.info)
        return match[1] if match else None


def blocks(doc: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    found, lines, i = [], doc.read_text().splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, info = opening.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = tuple(line.removeprefix(indent) for line in lines[i + 1 : end])
        lang, _, rest = info.strip().partition(" ")
        found.append(Block(doc, i, indent, lang, rest.strip(), body))
        i = end + 1
    return found


def problems_with_fences(block: Block) -> list[str]:
    """What breaks the convention: a fence without a language, a reason-less not-run, a shell
    command hidden in a block that is never run, an excerpt that is not in its file."""
    where = f"{block.where}: ```{block.lang}"
    if block.lang not in RUN + QUIET:
        return [f"{where}: name the language (one of {', '.join(RUN + QUIET)})"]
    if "not-run" in block.info and not block.option("not-run"):
        return [f"{where}: `not-run:` needs a reason"]
    if block.lang == "console" and block.body and not block.body[0].startswith("$ "):
        return [f"{where}: a console block starts with a `$ ` command"]
    if block.lang in QUIET and any(line.startswith("$ ") for line in block.body):
        return [f"{where}: shows a `$ ` command but is never run; make it console"]
    excerpt = block.option("file")
    if excerpt and "\n".join(block.body) not in (ROOT / excerpt).read_text():
        return [f"{where}: not an excerpt of {excerpt}; copy the file's text"]
    return []


@dataclass(frozen=True)
class Step:
    """One command of a block, and for console blocks the lines it is shown to print."""

    command: str
    line: int  # 0-based index of the command's (first) line in the document
    expected: tuple[str, ...] | None
    out_start: int  # 0-based index of the first shown output line in the document
    status_shown: bool  # the next command is `echo $?`


def steps(block: Block) -> list[Step]:
    """The commands of a console or sh block, in order."""
    found: list[tuple[str, int, int]] = []  # command, its line, the line after it
    shown: list[list[str]] = []  # the lines shown after each command (console)
    body, i, console = block.body, 0, block.lang == "console"
    while i < len(body):
        if console and not body[i].startswith("$ "):
            shown[-1].append(body[i])
            i += 1
            continue
        start, command = i, body[i].removeprefix("$ ") if console else body[i]
        while command.endswith("\\") and i + 1 < len(body):
            i += 1
            command = command[:-1] + " " + body[i].removeprefix("> ").strip()
        i += 1
        if command.strip() and not command.lstrip().startswith("#"):
            found.append((command, block.line + 1 + start, block.line + 1 + i))
            shown.append([])
    return [
        Step(
            command,
            line,
            tuple(shown[n]) if console else None,
            after,
            n + 1 < len(found) and found[n + 1][0].strip() == ECHO_STATUS,
        )
        for n, (command, line, after) in enumerate(found)
    ]


def workspace(where: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """A fresh directory with the sample weights, the recipes and `.venv`; the environment to
    run examples in, from `environ` (a snapshot: pytest's main thread sets os.environ while
    worker threads run this, and iterating os.environ then can raise KeyError)."""
    for name in ("sample_weights", "examples"):
        shutil.copytree(ROOT / name, where / name)
    bindir = Path(sys.executable).parent
    if not (bindir / "qtool").exists():
        raise RuntimeError(f"no qtool beside {sys.executable}: run the tests from the venv")
    venv = where / ".venv"
    if (bindir / "activate").exists():
        venv.symlink_to(bindir.parent)
    else:  # not a venv: an activate that puts this interpreter's scripts first
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "activate").write_text(f'export PATH="{bindir}:$PATH"\n')
    env = {k: v for k, v in environ.items() if k not in UNSET}
    env.update(
        PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}",
        COLUMNS="100",
        PYTHONUNBUFFERED="1",  # stdout and stderr interleave as on a terminal
        PYTHONIOENCODING="utf-8",
    )
    return env


def run(block: Block, cwd: Path, env: dict[str, str]) -> list[tuple[int, str]]:
    """(exit code, output) of each step of the block, run in order in one bash."""
    lines = ["set -o pipefail", "__rc=0"]
    for n, step in enumerate(steps(block)):
        lines += ["(exit $__rc)", step.command, "__rc=$?", f"printf '\\n{MARK} {n} %d\\n' $__rc"]
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", "\n".join(lines)],
        cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=600,
    )  # fmt: skip
    parts = re.split(rf"\n{MARK} \d+ (\d+)\n", done.stdout)
    return [(int(rc), out) for out, rc in zip(parts[0:-1:2], parts[1::2], strict=True)]


def normalized(text: str | tuple[str, ...], tmp: Path, timings: bool = True) -> list[str]:
    """Lines as compared: temporary paths and names, timings (unless `timings` is false: the
    lines to show) and trailing spaces neutralised."""
    if isinstance(text, tuple):
        text = "\n".join(text)
    for path in {str(tmp.resolve()), str(tmp)}:
        text = text.replace(path, SHOWN_PATH)
    text = re.sub(r"\.qtool-(tmp|old)-\d+-\w+", r".qtool-\1-PID-RANDOM", text)
    if timings:
        text = re.sub(r"\b\d+(?:\.\d+)? ?(?:ms|s)\b", "T s", text)
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def matches(expected: list[str], actual: list[str]) -> bool:
    """Line for line, a `...` line standing for any number of lines."""

    @cache
    def at(i: int, j: int) -> bool:
        if i == len(expected):
            return j == len(actual)
        if expected[i].strip() == ELLIPSIS:
            return at(i + 1, j) or (j < len(actual) and at(i, j + 1))
        return j < len(actual) and same_line(expected[i], actual[j]) and at(i + 1, j + 1)

    return at(0, 0)


_NUMBER = re.compile(r"\d+(?:\.(\d+))?(?:[eE]([+-]?\d+))?")


def same_line(expected: str, actual: str) -> bool:
    """Equal, but for numbers one apart in their last printed digit: a figure that runs through
    a matrix product (a KL, a perplexity) can round the other way on a CPU whose BLAS takes
    another code path (AVX2 against AVX-512)."""
    if expected == actual:
        return True
    if _NUMBER.sub("#", expected) != _NUMBER.sub("#", actual):
        return False
    pairs = zip(_NUMBER.finditer(expected), _NUMBER.finditer(actual), strict=True)
    return all(_one_digit_apart(a, b) for a, b in pairs)


def _one_digit_apart(a: re.Match[str], b: re.Match[str]) -> bool:
    """Whether two printed numbers are equal or, both figures with decimals or an exponent (not
    counts) printed alike, one apart in the last digit."""
    decimals, exponent = len(a[1] or ""), int(a[2] or 0)
    if a[0] == b[0]:
        return True
    if not (a[1] or a[2]) or (decimals, exponent) != (len(b[1] or ""), int(b[2] or 0)):
        return False
    last_digit = 10.0**exponent * 10.0**-decimals
    return abs(float(a[0]) - float(b[0])) <= 1.5 * last_digit


def refreshed(expected: list[str], actual: list[str]) -> list[str]:
    """What to show instead: the printed lines, elided where the docs elided them. Stretches the
    docs show in full stay in full; in a stretch with a `...`, the printed lines that start like
    a shown line (a tensor name, a header) stay and the rest become one `...`."""
    marks = [line for line in expected if line.strip() == ELLIPSIS]
    if not marks:
        return actual
    out: list[str] = []
    blocks = difflib.SequenceMatcher(None, expected, actual, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in blocks:
        shown_lines = [line for line in expected[i1:i2] if line.strip() != ELLIPSIS]
        if tag == "equal" or len(shown_lines) == i2 - i1:
            out += actual[j1:j2]
            continue
        keys = {_key(line) for line in shown_lines}
        for line in actual[j1:j2]:
            if _key(line) in keys:
                out.append(line)
            elif not out or out[-1] != marks[0]:
                out.append(marks[0])
    return out


def _key(line: str) -> str:
    words = line.split()
    return "" if not words else "─" if set(words[0]) == {"─"} else words[0]


def diff(expected: list[str], actual: list[str], where: str) -> str:
    return "\n".join(
        difflib.unified_diff(expected, actual, f"{where} (shown)", "printed", lineterm="")
    )
