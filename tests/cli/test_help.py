"""The help of every command (issue 21 item 10): panels, one metavar style, the inputs each
command accepts (and that it does accept them), the environment variables, and agreement with
README.md and docs/cli.md. Commands are read from the app, so a new command is checked too."""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Any

import pytest
import typer

from qtool.cli import app
from tests.conftest import Invoke

ROOT = Path(__file__).parents[2]
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()


def _commands() -> dict[str, Any]:
    group: Any = typer.main.get_command(app)
    return dict(group.commands)


COMMANDS = sorted(_commands())


def _visible_options(command: str) -> list[Any]:
    params = _commands()[command].params
    return [p for p in params if p.param_type_name == "option" and not p.hidden]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_an_example_and_a_mention_in_the_docs(
    invoke: Invoke, command: str
) -> None:
    code, out, _ = invoke(command, "--help")
    assert code == 0 and _commands()[command].help, command
    assert f"Example: qtool {command}" in out
    assert f"qtool {command}" in (ROOT / "README.md").read_text()
    assert f"## `qtool {command}`" in CLI_DOC


def test_quantize_help_is_in_panels_in_order(invoke: Invoke) -> None:
    out = invoke("quantize", "--help")[1]
    panels = re.findall(r"^(\S[^:\n]*):$", out, re.MULTILINE)
    assert panels == [
        "Arguments",
        "What to quantize",
        "How to quantize",
        "Output",
        "Quality gates (exit 3 when one is broken)",
        "Report",
        "Run",
        "Options",
    ]
    how = out.split("How to quantize:")[1].split("Output:")[0]
    assert all(flag in how for flag in ("--scheme", "--dtype", "--group-size", "--range"))
    gates = out.split("Quality gates")[1].split("Report:")[0]
    assert all(flag in gates for flag in ("--max-mse", "--min-sqnr", "--min-overall-sqnr"))


# a choice's values are lower-case words, or GGUF type names (Q4_K) after them
_METAVAR = re.compile(r"[A-Z]+(\.[a-z]+)?|[a-z0-9-]+(\|[a-z0-9-]+)+(\|Q[0-9]_[0-9K])*")


@pytest.mark.parametrize("command", COMMANDS)
def test_one_metavar_style(invoke: Invoke, command: str) -> None:
    """A value is an upper-case word (PATH, N, DB, FILE.png); a choice lists its values."""
    for param in _commands()[command].params:
        if param.param_type_name == "argument":
            assert param.metavar and param.metavar.isupper(), param.name
        elif not param.is_flag and not param.hidden:
            assert param.metavar and _METAVAR.fullmatch(param.metavar), (param.opts, param.metavar)
    out = invoke(command, "--help")[1]
    assert not re.search(r"<[a-z|-]+>", out), out  # Typer's own <path>, <float>, <sym|asym>


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_fits_an_80_column_terminal(invoke: Invoke, command: str) -> None:
    """Rich wraps help text but never a metavar: a long choice list (--dtype's 14 types) ran
    past the terminal's edge."""
    from rich.cells import cell_len

    out = invoke(*([command] if command else []), "--help", env={"COLUMNS": "80"})[1]
    assert [line for line in out.splitlines() if cell_len(line) > 80] == []


def test_dtype_help_names_every_kind_of_type(invoke: Invoke) -> None:
    out = " ".join(invoke("quantize", "--help", env={"COLUMNS": "200"})[1].split())
    line = out[out.index("--dtype") :].split("--per-channel")[0]
    for word in ("int8", "uint8", "int4", "uint4", "Q8_0", "Q6_K", "Q4_K_M", "F16", "BF16", "F32"):
        assert word in line, (word, line)


def test_calibrate_force_speaks_of_its_one_file(invoke: Invoke) -> None:
    """calibrate writes one file: the help shared with quantize spoke of output directories."""
    out = " ".join(invoke("calibrate", "--help")[1].split())
    force = out[out.index("--force") :].split("Report:")[0]
    assert "Replace an existing --out file" in force and "directory" not in force


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_the_environment_variables(invoke: Invoke, command: str) -> None:
    out = invoke(command, "--help")[1]
    assert "QTOOL_DEBUG=1" in out
    if command in ("quantize", "dequantize", "compare"):
        assert "QTOOL_KERNEL=auto|torch|fused" in out
    top = invoke("--help")[1]
    assert "QTOOL_KERNEL" in top and "QTOOL_DEBUG" in top


@pytest.mark.parametrize(
    ("command", "kinds"),
    [
        ("quantize", ("sharded", "model directory", ".pt", "GGUF file", "Llama, Qwen2, Mistral")),
        ("dequantize", ("sharded", "compressed-tensors model directory", "qtool quantize")),
        ("compare", ("sharded", "model directory", "compressed-tensors")),
        ("inspect", ("sharded", "model directory", "compressed-tensors", "sidecar")),
        ("plot", (".safetensors", ".pt")),
        ("calibrate", ("Llama family", "Mixtral", "Qwen2-MoE", "Qwen3-MoE", ".dat")),
    ],
)
def test_help_says_which_inputs_a_command_takes(
    invoke: Invoke, command: str, kinds: tuple[str, ...]
) -> None:
    assert invoke(command, "--help")[0] == 0
    params = _commands()[command].params
    text = " ".join(p.help or "" for p in params if p.param_type_name == "argument")
    assert all(kind in text for kind in kinds), (command, text)


# Each command on each kind of input its help names.
@pytest.mark.parametrize(
    ("command", "input_kind"),
    [
        ("quantize", "safetensors"),
        ("quantize", "pt"),
        ("quantize", "sharded-dir"),
        ("quantize", "sharded-index"),
        ("quantize", "model-dir"),
        ("dequantize", "qtool"),
        ("dequantize", "qtool-sharded"),
        ("dequantize", "ct-dir"),
        ("compare", "safetensors"),
        ("compare", "pt"),
        ("compare", "qtool"),
        ("compare", "sharded-dir"),
        ("compare", "ct-dir"),
        ("compare", "model-dir"),
        ("inspect", "safetensors"),
        ("inspect", "qtool"),
        ("inspect", "sidecar"),
        ("inspect", "sharded-dir"),
        ("inspect", "ct-dir"),
        ("inspect", "model-dir"),
        ("plot", "safetensors"),
        ("plot", "pt"),
    ],
)
def test_every_input_the_help_names_is_accepted(
    invoke: Invoke, samples: Path, command: str, input_kind: str
) -> None:
    if command == "plot":
        pytest.importorskip("matplotlib")
    q, qs, ct = samples / "q.safetensors", samples / "q-sharded", samples / "ct"
    assert invoke("quantize", str(samples / "mlp.safetensors"), "-o", str(q))[0] == 0
    assert invoke("quantize", str(samples / "sharded-mlp"), "-o", str(qs))[0] == 0
    ct_args = [str(samples / "tiny-llama"), "--format", "compressed-tensors", "-o", str(ct)]
    assert invoke("quantize", *ct_args)[0] == 0
    inputs = {
        "safetensors": samples / "mlp.safetensors",
        "pt": samples / "mlp.pt",
        "qtool": q,
        "sidecar": samples / "q.qparams.safetensors",
        "qtool-sharded": qs,
        "sharded-dir": samples / "sharded-mlp",
        "sharded-index": next((samples / "sharded-mlp").glob("*.index.json")),
        "ct-dir": ct,
        "model-dir": samples / "tiny-llama",
    }
    path = str(inputs[input_kind])
    args = {
        "quantize": ["quantize", path, "--dry-run"],
        "dequantize": ["dequantize", path, "-o", str(samples / "restored")],
        "compare": ["compare", path, path],
        "inspect": ["inspect", path],
        "plot": ["plot", path, "-t", "head.weight", "-o", str(samples / "p.png")],
    }[command]
    if args[0] == "dequantize" and input_kind != "qtool-sharded":
        args[-1] += ".safetensors"
    code, _, stderr = invoke(*args)
    assert code == 0, stderr


def _named(word: str, text: str) -> bool:
    """`word` in `text` as a whole word (`--logits` is not named by `--save-logits`)."""
    return re.search(rf"(?<![\w+-]){re.escape(word)}(?![\w+-])", text) is not None


def _choices(param: Any) -> list[enum.Enum]:
    """The values of an option whose type is an enum (a choice), else none."""
    kind = getattr(param.type_descriptor, "annotation", None)
    return list(kind) if isinstance(kind, type) and issubclass(kind, enum.Enum) else []


def test_docs_cli_names_every_option_and_no_stale_one() -> None:
    """Every visible option of every command is in docs/cli.md, and every option docs/cli.md
    shows in backticks exists (a few named on purpose: the hidden old spelling, other tools')."""
    options = {o for c in COMMANDS for p in _visible_options(c) for o in p.opts + p.secondary_opts}
    long_options = {o for o in options if o.startswith("--")}
    missing = sorted(o for o in long_options if not _named(o, CLI_DOC))
    assert not missing, f"docs/cli.md does not describe {missing}"
    choices = {
        (p.opts[0], str(c.value))
        for cmd in COMMANDS
        for p in _visible_options(cmd)
        for c in _choices(p)
    }
    unnamed = sorted(f"{o} {c}" for o, c in choices if not _named(c, CLI_DOC))
    assert not unnamed, f"docs/cli.md does not name the choices {unnamed}"
    # link targets dropped first: a heading's anchor (`#allocation---target-size`) is no option
    prose = re.sub(r"\]\([^)\s]*\)", "]", CLI_DOC)
    shown = set(re.findall(r"`[^`]*?(--[a-z][a-z0-9-]+)", prose))
    unknown = {"--bits", "--output", "--symmetric"}  # examples of what suggestions answer
    elsewhere = {"--dtype", "--allow-requantize", "--help", "--version", *unknown}
    stale = sorted(shown - long_options - elsewhere)
    assert not stale, f"docs/cli.md shows options no command has: {stale}"


# A flag name cut at one of its hyphens at the end of a line ("--save-" / "logits").
_CUT_FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*-$", re.MULTILINE)


@pytest.mark.parametrize("columns", [40, 56, 72])
def test_help_never_breaks_a_flag_name_at_its_hyphens(columns: int) -> None:
    group: Any = typer.main.get_command(app)
    for name, command in [*_commands().items(), ("qtool", group)]:
        ctx = command.context_class(command, info_name=name, terminal_width=columns)
        out = command.get_help(ctx)
        assert "--" in out and "\u2011" not in out, (name, columns)
        assert not _CUT_FLAG.findall(out), (name, columns, _CUT_FLAG.findall(out))


def test_usage_of_a_several_argument_has_one_ellipsis(invoke: Invoke) -> None:
    for command in COMMANDS:
        usage = invoke(command, "--help")[1].splitlines()[0]
        assert "......" not in usage and "...]..." not in usage, usage
    assert "FLOAT [QUANT]..." in invoke("eval", "--help")[1].splitlines()[0]


def test_docs_cli_says_quantize_takes_a_hugging_face_directory_for_gguf() -> None:
    """The inputs quantize's help names with --format gguf are in docs/cli.md's section too."""
    section = CLI_DOC.split("## `qtool quantize`")[1].split("\n## ")[0]
    intro = " ".join(section.split("| option |")[0].split())
    assert "Hugging Face model directory of the Llama family (Llama, Qwen2, Mistral)" in intro
