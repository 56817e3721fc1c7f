"""`quantize X.gguf --format gguf --allow-requantize` (issue 33, item 8): an already quantized
GGUF quantized again, as llama-quantize's `--allow-requantize` does, through a float copy in a
scratch directory beside the output. The output is exactly what `dequantize -o F32.gguf` then
`quantize F32.gguf` writes; one warning says quality is lost twice; without the flag the
refusal names it; an output that is the input is refused; no scratch file is left after a
success or an error, and a killed run's scratch is taken by the next run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qtool.engine.requantize import scratch_beside
from qtool.io.atomic import remove_stale_temps
from tests import gguf_models as M
from tests.conftest import Invoke

pytest.importorskip("gguf")
pytest.importorskip("transformers")

WARNING = "quality is lost twice"


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q8_0 GGUF qtool quantized from the tiny llama's BF16 GGUF, alone in its directory."""
    from qtool import api
    from qtool.spec import FormatName, gguf_spec

    d = M.make_hf_llama(tmp_path_factory.mktemp("tiny"))
    bf16 = M.write_float_gguf(d, d / "bf16.gguf", "BF16")
    out = tmp_path_factory.mktemp("q8") / "model.Q8_0.gguf"
    options = api.QuantizeOptions(gguf_spec("Q8_0"), format=FormatName.GGUF)
    api.quantize(bf16, out, options)
    return out


def _quantize(invoke: Invoke, src: Path, *args: str) -> tuple[int, str, str]:
    return invoke("quantize", str(src), "--format", "gguf", "--dtype", "Q4_K", *args)


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_requantize_writes_what_dequantize_then_quantize_writes(
    invoke: Invoke, q8: Path, tmp_path: Path
) -> None:
    f32, two_step, again = tmp_path / "f32.gguf", tmp_path / "two.gguf", tmp_path / "again.gguf"
    assert invoke("dequantize", str(q8), "-o", str(f32))[0] == 0
    assert _quantize(invoke, f32, "-o", str(two_step))[0] == 0
    code, out, err = _quantize(invoke, q8, "-o", str(again), "--allow-requantize", "--json")
    assert code == 0, err
    assert again.read_bytes() == two_step.read_bytes()
    assert err.count(WARNING) == 1 and "Q8_0" in err.splitlines()[0]
    summary = json.loads(out)
    assert summary["inputs"] == [str(q8)]  # the user's file, not the scratch copy
    assert _listing(tmp_path) == ["again.gguf", "f32.gguf", "two.gguf"]
    assert _listing(q8.parent) == [q8.name]


def test_a_float_gguf_with_the_flag_is_quantized_as_usual_without_a_warning(
    invoke: Invoke, tmp_path: Path
) -> None:
    d = M.make_hf_llama(tmp_path / "hf")
    f32 = M.write_float_gguf(d, tmp_path / "f32.gguf", "F32")
    plain, flagged = tmp_path / "plain.gguf", tmp_path / "flagged.gguf"
    assert _quantize(invoke, f32, "-o", str(plain))[0] == 0
    code, _, err = _quantize(invoke, f32, "-o", str(flagged), "--allow-requantize")
    assert code == 0 and WARNING not in err
    assert flagged.read_bytes() == plain.read_bytes()


def test_without_the_flag_the_refusal_names_it_and_dequantize(
    invoke: Invoke, q8: Path, tmp_path: Path
) -> None:
    code, out, err = _quantize(invoke, q8, "-o", str(tmp_path / "x.gguf"))
    assert code == 1 and out == ""
    assert "--allow-requantize" in err and "qtool dequantize makes a float copy" in err
    assert len(err.strip().splitlines()) == 1 and _listing(tmp_path) == []


def test_refusals_leave_nothing_behind(invoke: Invoke, q8: Path, tmp_path: Path) -> None:
    before = q8.read_bytes()
    # the input as its own output, even with --force
    code, _, err = _quantize(invoke, q8, "-o", str(q8), "--allow-requantize", "--force")
    assert code == 1 and "would overwrite the input" in err and q8.read_bytes() == before
    # another output format
    code, _, err = invoke("quantize", str(q8), "--dtype", "int8", "--allow-requantize")
    assert code == 2 and "--format gguf" in err
    # an error of the second run, after the scratch copy was made: an existing output
    existing = tmp_path / "taken.gguf"
    existing.write_bytes(b"mine")
    code, out, err = _quantize(invoke, q8, "-o", str(existing), "--allow-requantize")
    assert code == 1 and out == "" and "--force" in err, err
    assert existing.read_bytes() == b"mine"
    assert _listing(tmp_path) == ["taken.gguf"] and _listing(q8.parent) == [q8.name]
    assert "requantize.F32" not in err  # errors name the user's files, not the scratch copy


def test_an_output_that_is_the_input_is_refused_as_every_command_refuses_it(
    invoke: Invoke, q8: Path, tmp_path: Path
) -> None:
    """The same exit status (1: an output error) and the same words as quantize and
    dequantize, whatever the spelling of the path (a symlink to the input included)."""
    d = M.make_hf_llama(tmp_path / "hf")
    f32 = M.write_float_gguf(d, tmp_path / "f32.gguf", "F32")
    link = tmp_path / "link.gguf"
    link.symlink_to(q8)

    def refusal(code: int, out: str, err: str) -> tuple[int, str, str]:
        line = err.strip().splitlines()[-1]
        return code, out, line[line.index(": would overwrite") :]

    plain = refusal(*_quantize(invoke, f32, "-o", str(f32), "--force"))
    restored = refusal(*invoke("dequantize", str(f32), "-o", str(f32), "--force"))
    assert plain == (1, "", f": would overwrite the input {f32}; choose another output path")
    assert restored == plain
    for out in (q8, link):
        code, out_, err = _quantize(invoke, q8, "-o", str(out), "--allow-requantize", "--force")
        assert refusal(code, out_, err) == (1, "", plain[2].replace(str(f32), str(q8))), err
    assert os.listdir(q8.parent) == [q8.name]


def test_scratch_is_a_locked_temp_directory_the_next_run_takes_once_dead(tmp_path: Path) -> None:
    out = tmp_path / "model.Q4_K.gguf"
    with scratch_beside(out) as scratch:
        (scratch / "big.gguf").write_bytes(b"x" * 100)
        assert scratch.parent == tmp_path and scratch.name.startswith(f".{out.name}.qtool-tmp-")
        assert remove_stale_temps(tmp_path) == 0 and scratch.exists()  # alive: locked
    assert _listing(tmp_path) == []
    # a killed run's (same name, nobody holds its lock) is removed by the next run there
    dead = tmp_path / f".{out.name}.qtool-tmp-99999-0badcafe"
    dead.mkdir()
    (dead / "requantize.F32.gguf").write_bytes(b"x" * 100)
    with scratch_beside(out):
        assert not dead.exists()
    assert _listing(tmp_path) == []
