"""Files qtool writes that are not checkpoints are recognised by what they are: `inspect` shows
what they hold, any other command names them and the command that reads them, instead of a
checkpoint reader's complaint about bytes it misread (a logits file's magic read as a
safetensors header length)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import Invoke
from tests.reliability.test_logits_file_bounded import VOCAB, WINDOWS, valid


def _logits(tmp_path: Path) -> Path:
    path = tmp_path / "only.qlogits"
    path.write_bytes(valid())
    return path


def test_inspect_shows_a_logits_files_header(invoke: Invoke, tmp_path: Path) -> None:
    path = _logits(tmp_path)
    code, out, err = invoke("inspect", str(path), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kind"] == "logits" and doc["tensors"] == []
    meta = doc["metadata"]
    assert meta["tokens"] == str(sum(WINDOWS)) and meta["ctx"] == "6"
    assert meta["windows"] == str(len(WINDOWS)) and meta["vocab"] == str(VOCAB)
    assert meta["text_sha256"] == "a" * 64 and meta["dtype"] == "float32"
    assert any("eval --logits" in note for note in doc["notes"])
    code, out, err = invoke("inspect", str(path))
    assert code == 0 and "(logits)" in out and '"vocab": "40"' in out
    assert "eval --logits" in err and "safetensors" not in out + err


def test_other_commands_say_what_a_logits_file_is(invoke: Invoke, tmp_path: Path) -> None:
    path = _logits(tmp_path)
    for args in (["compare", str(path), str(path)], ["quantize", str(path), "--dry-run"]):
        code, out, err = invoke(*args)
        assert code == 1 and out == "", args
        assert "eval logits file" in err and "--logits" in err, args
        assert "header length" not in err, args


def test_inspect_shows_the_sensitivities_an_imatrix_holds(invoke: Invoke, tmp_path: Path) -> None:
    from qtool.formats.imatrix.sensitivity import Sensitivities
    from tests.formats.test_imatrix_sensitivity import NAMES, _write

    alpha = dict.fromkeys(NAMES, 0.5)
    files = {
        "fit": _write(tmp_path / "fit.imatrix.gguf", Sensitivities(alpha, "rtn int4", 512,
                                                                    (0.7, 0.4, 0.8))),
        "plain": _write(tmp_path / "plain.imatrix.gguf", Sensitivities(alpha, "rtn int4", 64)),
        "none": _write(tmp_path / "none.imatrix.gguf", None),
    }  # fmt: skip
    shown = {}
    for name, path in files.items():
        code, out, err = invoke("inspect", str(path), "--json")
        assert code == 0, err
        shown[name] = json.loads(out)["metadata"].get("qtool.sensitivity")
        console = invoke("inspect", str(path))[1]
        assert (shown[name] is not None) == ("sensitivities of" in console), name
    assert shown["fit"] == (
        f"sensitivities of {len(NAMES)} weights, reference rtn int4, 512 tokens, "
        "joint fit: gain 0.7, saturation 0.4, additivity 0.8"
    )
    assert shown["plain"] is not None and "64 tokens, no joint fit" in shown["plain"]
    assert shown["none"] is None
