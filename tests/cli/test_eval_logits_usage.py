"""`qtool eval --logits FILE QUANT` (FLOAT left out, as if the file stood in for it) takes QUANT
as FLOAT and no QUANT: the usage error said 'give QUANT (one or more), or --save-logits FILE',
naming neither what is missing nor why, and offering an option --logits refuses. It now says
FLOAT comes first and why the file cannot stand in for it (it keeps only digests of FLOAT's
config and tokenizer). Usage errors come before any input is read: the paths need not exist."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import Invoke


def test_logits_without_float_asks_for_float(invoke: Invoke, tmp_path: Path) -> None:
    saved, quant = tmp_path / "base.qlogits", tmp_path / "quant"
    code, out, err = invoke("eval", "--logits", str(saved), str(quant))
    assert (code, out) == (2, "")
    assert "FLOAT then QUANT" in err and "digests" in err
    assert "--save-logits" not in err  # the option --logits refuses beside it
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_logits_with_float_alone_asks_for_both(invoke: Invoke, tmp_path: Path) -> None:
    """One path given may be FLOAT (QUANT forgotten) as well as QUANT: the message asks for
    both in order, not for FLOAT alone, which the user may have given."""
    code, out, err = invoke("eval", str(tmp_path / "float"), "--logits", str(tmp_path / "f.ql"))
    assert (code, out) == (2, "")
    assert "one path given" in err and "give both, FLOAT first" in err


def test_logits_without_float_json(invoke: Invoke, tmp_path: Path) -> None:
    code, out, err = invoke("eval", "--logits", str(tmp_path / "f.qlogits"), str(tmp_path / "q"),
                            "--json")  # fmt: skip
    assert (code, out) == (2, "")
    doc = json.loads(err)
    assert doc["error"]["code"] == "usage" and "FLOAT then QUANT" in doc["error"]["message"]


def test_no_quant_without_logits_keeps_its_message(invoke: Invoke, tmp_path: Path) -> None:
    code, out, err = invoke("eval", str(tmp_path / "float"))
    assert (code, out) == (2, "") and "give QUANT (one or more), or --save-logits FILE" in err
