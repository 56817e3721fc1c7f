"""Calibration texts recorded in every output of `quantize --method` and `--imatrix` (name, tokens,
SHA-256, role: calibration.TextUse), and `qtool eval` warning when its text is one of them (the
in-sample trap: pydoc_data topics are eval's default text). Both formats, and a GGUF, whose
llama-quantize keys record the imatrix's dataset by name only. Outputs without a method or an
imatrix record nothing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from safetensors import safe_open  # noqa: E402

from qtool import api  # noqa: E402
from qtool.calibration import Calibration  # noqa: E402
from qtool.engine.model.text import default_text  # noqa: E402
from qtool.engine.plan import QuantizeOptions  # noqa: E402
from qtool.spec import FormatName, PerGroup, QSpec, RangeMethod, Scheme, StorageDtype  # noqa: E402
from tests import gguf_models as M  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.eval.test_gguf_eval import _save_tokenizer  # noqa: E402
from tests.eval_models import build  # noqa: E402

CTX = 32
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))
CHECK = " ".join(f"Delta{i}: epsilon zeta eta {i % 5}!" for i in range(40))
OTHER = " ".join(f"omicron {i} pi rho." for i in range(60))
SPEC = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(16))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_text().encode()).hexdigest()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("in-sample")
    (d / "calib.txt").write_text(TEXT)
    (d / "check.txt").write_text(CHECK)
    (d / "other.txt").write_text(OTHER)
    build(d / "llama", "llama")
    return d


def _method(root: Path, fmt: str, texts: tuple[str, ...] = ("calib.txt",)) -> QuantizeOptions:
    data = Calibration(texts=tuple(root / t for t in texts), tokens=8 * CTX, ctx=CTX,
                       check_texts=(root / "check.txt",))  # fmt: skip
    return QuantizeOptions(SPEC, format=fmt, calibration=data)


def _recorded(out: Path) -> list[dict[str, object]] | None:
    """What an output records under the texts key: the compressed-tensors config's, else the
    qtool sidecar's (None: no record)."""
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    if qconfig["quant_method"] == "compressed-tensors":
        found = qconfig["qtool"].get("texts")
        return None if found is None else list(found)
    side = next(out.glob("*.qparams.safetensors"))
    with safe_open(side, "pt") as f:
        raw = (f.metadata() or {}).get("qtool.texts")
    return None if raw is None else list(json.loads(raw))


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
def test_a_method_records_each_text_with_its_role(root: Path, tmp_path: Path, fmt: str) -> None:
    """Name (base name), SHA-256 of the text, tokens taken (fit and held out; the check text's
    windows) and role, the same in the output and in the JSON summary."""
    summary = api.quantize(root / "llama", tmp_path / "o", _method(root, fmt), force=True)
    want = [
        {"name": "calib.txt", "sha256": _sha(root / "calib.txt"), "tokens": 8 * CTX,
         "role": "calibration"},
        {"name": "check.txt", "sha256": _sha(root / "check.txt"), "tokens": CTX,
         "role": "check"},
    ]  # fmt: skip
    assert _recorded(tmp_path / "o") == want
    assert [t.as_dict() for t in summary.texts] == want


def test_an_imatrix_records_its_texts_under_the_same_keys(root: Path, tmp_path: Path) -> None:
    imatrix = tmp_path / "m.imatrix.gguf"
    api.calibrate(root / "llama", imatrix, (root / "calib.txt",), 4 * CTX, CTX, "cpu", True)
    spec = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(16), RangeMethod.MSE)
    for fmt in (FormatName.QTOOL, FormatName.COMPRESSED_TENSORS):
        out = tmp_path / fmt.value
        api.quantize(root / "llama", out, QuantizeOptions(spec, format=fmt, imatrix=imatrix))
        assert _recorded(out) == [
            {"name": "calib.txt", "sha256": _sha(root / "calib.txt"), "tokens": 4 * CTX,
             "role": "calibration"}
        ]  # fmt: skip


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
def test_no_method_no_imatrix_records_nothing(root: Path, tmp_path: Path, fmt: str) -> None:
    summary = api.quantize(root / "llama", tmp_path / "o", QuantizeOptions(SPEC, format=fmt))
    assert _recorded(tmp_path / "o") is None and summary.texts == ()


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
def test_eval_warns_on_a_calibration_or_check_text(
    root: Path, tmp_path: Path, invoke: Invoke, fmt: str
) -> None:
    """Calibration text: one warning line on stderr naming it, `in_sample` in the JSON; the
    check text: the same, saying so; another text: nothing."""
    out = tmp_path / "o"
    api.quantize(root / "llama", out, _method(root, fmt), force=True)
    base = ["eval", str(root / "llama"), str(out), "--tokens", "128", "--ctx", str(CTX)]
    rc, stdout, err = invoke(*base, "--text", str(root / "calib.txt"))
    assert rc == 0, err
    warned = [line for line in err.splitlines() if "in sample" in line]
    assert len(warned) == 1 and "calib.txt" in warned[0] and "calibrated on" in warned[0]
    assert "in sample" not in stdout
    rc, stdout, err = invoke(*base, "--text", str(root / "check.txt"), "--json")
    assert rc == 0, err
    doc = json.loads(stdout)
    assert [(t["name"], t["role"]) for t in doc["in_sample"]] == [("check.txt", "check")]
    assert any("check text" in n for n in doc["notes"])
    rc, stdout, err = invoke(*base, "--text", str(root / "other.txt"), "--json")
    assert rc == 0 and json.loads(stdout)["in_sample"] == [] and "in sample" not in err


def test_eval_warns_on_its_own_default_text(root: Path, tmp_path: Path) -> None:
    """A model calibrated on a file holding eval's default text (pydoc_data topics, as
    /tmp/smol/pydoc.txt is): eval with its default text matches it by SHA-256, whatever the
    file was called."""
    out = tmp_path / "o"
    (tmp_path / "pydoc.txt").write_text(default_text().content)
    data = Calibration(texts=(tmp_path / "pydoc.txt",), tokens=8 * CTX, ctx=CTX,
                       check_texts=(root / "check.txt",))  # fmt: skip
    api.quantize(root / "llama", out, QuantizeOptions(SPEC, calibration=data), force=True)
    summary = api.evaluate(root / "llama", out, api.EvalOptions(tokens=128, ctx=CTX))
    assert [(t.name, t.role.value) for t in summary.in_sample] == [("pydoc.txt", "calibration")]
    assert any(n.startswith("in sample") and "pydoc_data" in n for n in summary.notes)


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("in-sample-gguf")
    M.make_hf_llama(d / "float")
    _save_tokenizer(d / "float")
    M.write_float_gguf(d / "float", d / "f32.gguf", "F32")
    text = "the cat sat on the mat, and the dog ate the hat; a thin man in a tent " * 20
    (d / "text.txt").write_text(text)
    (d / "other.txt").write_text("a tent, a hat, the man sat in the mat; " * 30)
    return d


def test_a_gguf_with_llama_quantizes_imatrix_keys_matches_by_name(
    gguf_root: Path, tmp_path: Path, invoke: Invoke
) -> None:
    """quantize.imatrix.dataset holds the dataset's name only (llama-quantize's key): eval
    matches its base name and says the match is by name."""
    d = gguf_root
    imatrix = tmp_path / "m.imatrix.gguf"
    api.calibrate(d / "float", imatrix, (d / "text.txt",), 2 * CTX, CTX, "cpu", True)
    q4 = tmp_path / "q4.gguf"
    rc, _, err = invoke("quantize", str(d / "f32.gguf"), "--format", "gguf", "--dtype", "Q4_0",
                        "--imatrix", str(imatrix), "-o", str(q4))  # fmt: skip
    assert rc == 0, err
    base = ["eval", str(d / "float"), str(q4), "--tokens", "120", "--ctx", "64", "--json"]
    rc, stdout, err = invoke(*base, "--text", str(d / "text.txt"))
    assert rc == 0, err
    doc = json.loads(stdout)
    assert [(t["name"], t["sha256"], t["role"]) for t in doc["in_sample"]] == [
        ("text.txt", None, "calibration")
    ]
    assert any("by name only" in n for n in doc["notes"])
    rc, stdout, err = invoke(*base, "--text", str(d / "other.txt"))
    assert rc == 0 and json.loads(stdout)["in_sample"] == [], err
