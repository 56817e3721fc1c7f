"""Small things a new user read wrong: counts of one in the singular, "an 80-column", rows in
the natural order inspect uses (layers.2 before layers.10) in quantize and compare, 4-bit codes
shown as I4 (int4) rather than as the U8 bytes that hold them, and a hint the message already gave
not repeated in brackets."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from qtool.report import console
from tests.conftest import SAMPLES, Invoke


def test_a_count_of_one_is_singular(invoke: Invoke, tmp_path: Path) -> None:
    q = tmp_path / "q.safetensors"
    code, _, err = invoke("quantize", str(SAMPLES / "mlp.safetensors"), "-o", str(q),
                          "--include", "head.weight")  # fmt: skip
    assert code == 0, err
    code, out, _ = invoke("inspect", str(q.with_name("q.qparams.safetensors")))
    assert code == 0 and "1 quantized tensor" in out and "1 quantized tensors" not in out


@pytest.mark.parametrize(("width", "words"), [(80, "an 80-column"), (100, "a 100-column")])
def test_the_article_fits_the_width(
    monkeypatch: pytest.MonkeyPatch, width: int, words: str
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(console, "width_of", lambda stream: width)
    assert words in console._hidden_line(["shape"], Terminal())


@pytest.fixture
def layered(tmp_path: Path) -> Path:
    path = tmp_path / "layers.safetensors"
    torch.manual_seed(0)
    save_file({f"layers.{i}.weight": torch.randn(8, 16) for i in (10, 1, 2)}, path)
    return path


def test_quantize_and_compare_list_rows_in_natural_order(
    invoke: Invoke, layered: Path, tmp_path: Path
) -> None:
    q = tmp_path / "q.safetensors"
    for args in (["quantize", str(layered), "-o", str(q)], ["compare", str(layered), str(q)]):
        code, out, err = invoke(*args)
        assert code == 0, err
        where = [out.index(f" layers.{i}.weight") for i in (1, 2, 10)]
        assert where == sorted(where), out


def test_four_bit_codes_show_as_4_bit_integers(invoke: Invoke) -> None:
    code, out, _ = invoke("quantize", str(SAMPLES / "mlp.safetensors"), "--dtype", "int4",
                          "--dry-run")  # fmt: skip
    assert code == 0 and "F32→I4" in out and "→U8" not in out


def test_a_hint_the_message_gives_is_not_repeated(invoke: Invoke, tmp_path: Path) -> None:
    code, _, err = invoke("quantize", str(SAMPLES / "mlp.safetensors"), "--format",
                          "compressed-tensors", "-o", str(tmp_path / "o"))  # fmt: skip
    assert code == 2 and err.count("--config PATH") == 1, err


def test_compare_shows_4_bit_codes_as_4_bit_integers(invoke: Invoke, tmp_path: Path) -> None:
    """compare named the bytes that hold two codes each (F32→U8) where quantize says F32→I4."""
    out = tmp_path / "q.safetensors"
    src = str(SAMPLES / "mlp.safetensors")
    assert invoke("quantize", src, "--dtype", "int4", "-o", str(out))[0] == 0
    code, shown, _ = invoke("compare", src, str(out), "--all")
    assert code == 0 and "F32→I4" in shown and "U8" not in shown, shown
    code, shown, _ = invoke("compare", src, str(out), "--json")  # JSON: the stored dtypes
    assert code == 0 and '"dtype_b": "U8"' in shown, shown


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (2, "(20 A, 19 B)"),
        (4, "(20 A, 19 B, 18 C, 17 D)"),  # was '(20 A, 19 B, 18 C, 1 more specs)'
        (5, "(20 A, 19 B, 18 C, 2 more specs)"),
    ],
)
def test_the_written_specs_never_say_1_more_specs(count: int, expected: str) -> None:
    """SmolLM2's Q4_K_M said '(166 Q5_0, 16 Q4_K, 15 Q8_0, 1 more specs)': a wrong plural,
    and the words took the room the fourth spec's own count and name take."""
    by_spec = [(label, 20 - i, 0) for i, label in enumerate("ABCDE"[:count])]
    shown = console._written_specs(SimpleNamespace(by_spec=by_spec))  # type: ignore[arg-type]
    assert shown == " " + expected
