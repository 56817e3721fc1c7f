"""`qtool eval` reads the texts QUANT records only to warn (formats/provenance.py): a record that
is not one (another tool's key, a damaged or hand-edited config) is left out, never an error and
never a guess: a digest that is no SHA-256 is not matched by name instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from qtool import api  # noqa: E402
from qtool.calibration import Calibration  # noqa: E402
from qtool.engine.plan import QuantizeOptions  # noqa: E402
from qtool.spec import FormatName, PerGroup, QSpec, Scheme, StorageDtype  # noqa: E402
from tests.eval_models import build  # noqa: E402

CTX = 32
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))
GOOD = {"name": "calib.txt", "sha256": None, "tokens": 1, "role": "calibration"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("damaged-texts")
    (root / "calib.txt").write_text(TEXT)
    model = build(root / "llama", "llama")
    data = Calibration(texts=(root / "calib.txt",), tokens=8 * CTX, ctx=CTX)
    spec = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(16))
    options = QuantizeOptions(spec, format=FormatName.COMPRESSED_TENSORS, calibration=data)
    api.quantize(model, root / "ct", options)
    return root


@pytest.mark.parametrize(
    "texts",
    [
        "calib.txt",
        {"name": "calib.txt"},
        [1, "calib.txt", None, []],
        [{**GOOD, "name": 5}],
        [{**GOOD, "role": "fit"}],
        [{**GOOD, "sha256": "not-a-digest"}],
        [{**GOOD, "sha256": 7}],
    ],
)
def test_a_damaged_record_is_left_out(exported: Path, texts: object) -> None:
    config = exported / "ct" / "config.json"
    doc = json.loads(config.read_text())
    doc["quantization_config"]["qtool"]["texts"] = texts
    config.write_text(json.dumps(doc))
    options = api.EvalOptions(text=exported / "calib.txt", tokens=64, ctx=CTX)
    summary = api.evaluate(exported / "llama", exported / "ct", options)
    assert summary.in_sample == () and not any("in sample" in n for n in summary.notes)


def test_a_record_of_a_name_only_is_matched_by_name(exported: Path) -> None:
    """The control: the same edit with a valid record of a name only (as a GGUF's key) warns."""
    config = exported / "ct" / "config.json"
    doc = json.loads(config.read_text())
    doc["quantization_config"]["qtool"]["texts"] = [GOOD]
    config.write_text(json.dumps(doc))
    options = api.EvalOptions(text=exported / "calib.txt", tokens=64, ctx=CTX)
    summary = api.evaluate(exported / "llama", exported / "ct", options)
    assert [t.name for t in summary.in_sample] == ["calib.txt"]
