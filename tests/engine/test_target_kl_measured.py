"""quantize --target-kl measures its plan (engine/plan_kl.py) and solves again while the measured
KL is over the target (engine/allocate.py's _within_kl): the figure it reports is `qtool eval`'s
KL of the bytes it wrote, a plan predicted under the target but measured over it is not the one
written, two runs write the same bytes, and a target no plan can meet is one line.

The sensitivities are made up (alpha 0.05 for every tensor of tiny-lm, a tied-embedding Llama
with a tokenizer) so that the prediction is off the measurement by a factor the loop must
correct; the imatrix records no text, so the measurement takes the default text's first windows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qtool.engine import plan_kl
from qtool.formats.imatrix import write_imatrix
from qtool.formats.imatrix.sensitivity import Sensitivities, sensitivity_keys
from qtool.numerics import sensitivity
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from tests.conftest import Invoke

SAMPLES = Path(__file__).resolve().parents[2] / "sample_weights"
TINY_LM = SAMPLES / "tiny-lm"  # tied embeddings, a tokenizer, max_position_embeddings 256
KINDS = {"attn_q": 64, "attn_k": 64, "attn_v": 64, "attn_output": 64, "ffn_gate": 64,
         "ffn_up": 64, "ffn_down": 128}  # fmt: skip


def _imatrix(path: Path, alpha: float = 0.05) -> Path:
    """h = 1 for every Linear of tiny-lm, alpha `alpha` for each and for the tied table."""
    entries = {
        f"blk.{b}.{k}.weight": MatrixStats(np.full((1, w), 3.0, np.float32), np.array([3]))
        for b in range(2)
        for k, w in KINDS.items()
    }
    alphas = dict.fromkeys(entries, alpha) | {"token_embd.weight": alpha}
    extra = sensitivity_keys(Sensitivities(alphas, "test", 100, None))
    write_imatrix(path, ImportanceMatrix(entries, 512, 1, ("t.txt",)), extra)
    return path


def _quantize(invoke: Invoke, tmp_path: Path, kl: str, out: str, *extra: str) -> Any:
    code, stdout, err = invoke("quantize", str(TINY_LM), "--target-kl", kl, "--imatrix",
                               str(_imatrix(tmp_path / "s.gguf")), "-o", str(tmp_path / out),
                               "--threads", "1", "--json", *extra)  # fmt: skip
    assert code == 0, err
    return json.loads(stdout)


class _Counted:
    """PlanKL.measure wrapped: how many plans were measured."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        measure = plan_kl.PlanKL.measure

        def counted(meter: plan_kl.PlanKL, restore: plan_kl.Restore) -> float:
            self.calls += 1
            return measure(meter, restore)

        monkeypatch.setattr(plan_kl.PlanKL, "measure", counted)


def test_the_reported_kl_is_evals_kl_of_the_written_output(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The figure is a measurement of what was written, not the prediction: `qtool eval` of
    the output on the same windows gives the same mean KL to 1e-9. (The default text's first
    8,000 characters stand in for it, every whole window of 256 taken, so that the windows are
    the ones eval cuts from the file's start.)"""
    from qtool.engine.calibrate.data import default_text
    from qtool.engine.model.text import Text

    short = Text(default_text().content[:8000], "the default text's start")
    monkeypatch.setattr(plan_kl, "default_text", lambda: short)
    monkeypatch.setattr(plan_kl, "MEASURE_TOKENS", 10**6)
    doc = _quantize(invoke, tmp_path, "0.01", "o")
    measured = doc["allocation"]["measured_kl"]
    assert measured["solves"] == 1 and "the default text's start" in measured["on"]
    scored = int(measured["on"].split()[0].replace(",", ""))
    assert scored % 255 == 0 and scored >= 4 * 255
    text = tmp_path / "start.txt"
    text.write_text(short.content, encoding="utf-8")
    code, out, err = invoke("eval", str(TINY_LM), str(tmp_path / "o"), "--text", str(text),
                            "--tokens", str(scored // 255 * 256), "--ctx", "256", "--dtype",
                            "float32", "--threads", "1", "--json")  # fmt: skip
    assert code == 0, err
    causal = json.loads(out)["causal"]
    assert causal["positions_scored"] == scored
    assert measured["kl"] == pytest.approx(causal["kl"]["mean"], rel=1e-9)
    # the prediction is another number (alpha is made up): the report is not it
    assert abs(measured["kl"] - doc["allocation"]["predicted_loss"]) > 1e-4
    note = next(n for n in doc["notes"] if n.startswith("allocation ("))
    assert f"measured KL {measured['kl']:.4g} nats/token" in note


def test_a_plan_measured_over_the_target_is_solved_again_until_within(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """alpha 0.05 under-predicts tiny-lm's KL about 2.5 times: the first plan within the
    predicted 0.005 measures over it; the loop solves again with the bound tightened, each plan
    predicted lower and no smaller than the last, until one measures within. One measurement
    per solve, and the float model run once (its final states are kept)."""
    counted = _Counted(monkeypatch)
    floats = []
    capture = plan_kl.capture
    monkeypatch.setattr(plan_kl, "capture", lambda *a, **k: floats.append(1) or capture(*a, **k))
    doc = _quantize(invoke, tmp_path, "0.005", "o")
    measured = doc["allocation"]["measured_kl"]
    rounds = measured["rounds"]
    assert len(rounds) == measured["solves"] == counted.calls >= 2
    assert rounds[0]["kl"] > 0.005 >= rounds[0]["predicted"]  # the prediction alone missed
    assert measured["kl"] == rounds[-1]["kl"] <= 0.005
    assert all(a["predicted"] > b["predicted"] for a, b in zip(rounds, rounds[1:], strict=False))
    assert all(a["bytes"] <= b["bytes"] for a, b in zip(rounds, rounds[1:], strict=False))
    assert doc["allocation"]["bytes"] == rounds[-1]["bytes"]
    assert len(floats) == counted.calls + 1  # the planned stream each time, the float once


def test_a_bound_tightened_below_the_ladder_measures_its_least_error_plan(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-solve whose tightened bound lies below the least the ladder can predict takes the
    ladder's least-error plan and measures it, rather than refusing with the user's target
    ('no plan reaches predicted KL 0.005: the least the ladder reaches is ...', which the first
    plan contradicts): here that plan measures within, and is written. (tiny-lm's default
    ladder keeps float as its least error, a floor of 0; a ladder without float has a floor
    above 0 that a tightened bound can cross: the bound is forced under it.)"""
    monkeypatch.setattr(sensitivity, "tightened", lambda *a: -1.0)
    doc = _quantize(invoke, tmp_path, "0.005", "o")
    measured = doc["allocation"]["measured_kl"]
    assert measured["solves"] == 2 and measured["kl"] <= 0.005
    assert measured["rounds"][1]["predicted"] < measured["rounds"][0]["predicted"]


def test_two_runs_write_the_same_bytes(invoke: Invoke, tmp_path: Path) -> None:
    """The loop is deterministic: the same inputs give the same solves and the same output."""
    docs = [_quantize(invoke, tmp_path, "0.005", name) for name in ("a", "b")]
    assert docs[0]["allocation"] == docs[1]["allocation"]
    assert docs[0]["allocation"]["measured_kl"]["solves"] >= 2
    files = [{p.name: p.read_bytes() for p in sorted((tmp_path / n).iterdir())} for n in "ab"]
    assert files[0] == files[1] and files[0]


def test_a_target_the_solves_run_out_on_is_one_line(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the target after the last solve allowed: exit 2, one line giving the last plan's
    predicted and measured KL, nothing written."""
    monkeypatch.setattr(sensitivity, "MAX_SOLVES", 1)
    imatrix = str(_imatrix(tmp_path / "s.gguf"))
    code, out, err = invoke("quantize", str(TINY_LM), "--target-kl", "0.005", "--imatrix",
                            imatrix, "-o", str(tmp_path / "o"))  # fmt: skip
    said = " ".join(err.split())
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "no plan reached KL 0.005 in 1 solve: the last," in said and "measured 0.0" in said
    assert not (tmp_path / "o").exists()


def test_kl_that_rules_hold_beyond_the_target_is_one_line(invoke: Invoke, tmp_path: Path) -> None:
    """Tensors a recipe rule quantizes are in the measured model but not the target's to
    decide: when the target's tensors at their least error (kept float) still measure over
    it, no plan can meet it, and the run says so at once, without solving again."""
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[rule]]\nmatch = "*mlp*"\nscheme = "sym"\ndtype = "int4"\n'
                      'granularity = "channel"\naxis = 0\n')  # fmt: skip
    code, out, err = invoke("quantize", str(TINY_LM), "--target-kl", "1e-6", "--recipe",
                            str(recipe), "--imatrix", str(_imatrix(tmp_path / "s.gguf")),
                            "-o", str(tmp_path / "o"))  # fmt: skip
    said = " ".join(err.split())
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "no plan reaches KL 1e-06: with every tensor the target decides at its least" in said
    assert "(the tensors rules quantize)" in said
    assert not (tmp_path / "o").exists()


def test_an_input_qtool_cannot_run_keeps_the_prediction_and_says_so(
    invoke: Invoke, tmp_path: Path
) -> None:
    """tiny-llama has no tokenizer: the plan is the predicted one, its KL not measured, and
    a warning on stderr, the note and the JSON say why (the JSON's KL null: no figure passes
    for a measurement; it was the string "NaN", and stderr was empty)."""
    entries = {
        f"blk.{b}.{k}.weight": MatrixStats(np.full((1, w), 3.0, np.float32), np.array([3]))
        for b in range(2)
        for k, w in KINDS.items()
    }
    alphas = dict.fromkeys(entries, 0.05) | {"token_embd.weight": 0.05, "output.weight": 0.05}
    write_imatrix(tmp_path / "s.gguf", ImportanceMatrix(entries, 512, 1, ("t.txt",)),
                  sensitivity_keys(Sensitivities(alphas, "test", 100, None)))  # fmt: skip
    code, out, err = invoke("quantize", str(SAMPLES / "tiny-llama"), "--target-kl", "0.01",
                            "--imatrix", str(tmp_path / "s.gguf"), "-o", str(tmp_path / "o"),
                            "--json")  # fmt: skip
    assert code == 0 and len(err.strip().splitlines()) == 1, err
    warning = "--target-kl 0.01 was not checked: the input directory has no tokenizer"
    assert warning in " ".join(err.split())
    doc = json.loads(out)
    measured = doc["allocation"]["measured_kl"]
    assert measured["kl"] is None and measured["rounds"] == []
    assert measured["on"] == "not measured: the input directory has no tokenizer"
    note = next(n for n in doc["notes"] if n.startswith("allocation ("))
    assert "KL not measured: the input directory has no tokenizer (1 solve), predicted" in note


def test_tightened_scales_the_bound_below_the_last_plan() -> None:
    """The next bound: target x predicted / measured from the smaller of the bound and the
    prediction (strictly under both, so the next plan differs); refused when within."""
    assert sensitivity.tightened(0.3, 0.3, 0.29, 0.35) == pytest.approx(0.29 * 0.3 / 0.35)
    assert sensitivity.tightened(0.3, 0.2, 0.25, 0.4) == pytest.approx(0.2 * 0.3 / 0.4)
    with pytest.raises(ValueError):
        sensitivity.tightened(0.3, 0.3, 0.29, 0.3)


def _recorded(path: Path, tokens: int) -> Path:
    """_imatrix's file recording `tokens` tokens read of calibrate's default text."""
    from qtool.engine.calibrate.data import default_text
    from qtool.gguf_types import ValueType
    from qtool.io.gguf_layout import GGUFValue

    entries = {
        f"blk.{b}.{k}.weight": MatrixStats(np.full((1, w), 3.0, np.float32), np.array([3]))
        for b in range(2)
        for k, w in KINDS.items()
    }
    alphas = dict.fromkeys(entries, 0.05) | {"token_embd.weight": 0.05}
    sha = default_text().info.sha256
    extra = sensitivity_keys(Sensitivities(alphas, "test", 100, None)) | {
        "qtool.datasets.sha256": GGUFValue(ValueType.ARRAY, (sha,), ValueType.STRING),
        "qtool.datasets.tokens": GGUFValue(
            ValueType.ARRAY, np.array([tokens], np.uint64), ValueType.UINT64
        ),
    }
    write_imatrix(path, ImportanceMatrix(entries, 256, 1, ("t.txt",)), extra)
    return path


@pytest.mark.parametrize(
    ("read", "says"),
    [
        (300, "2,040 tokens of stdlib docstrings (CPython {v}) past the imatrix's 300"),
        (10**9, "2,040 tokens of stdlib docstrings (CPython {v}) (all read by the imatrix, "
         "1,000,000,000 tokens: not held out)"),
    ],
    ids=["held-out", "all-read"],
)  # fmt: skip
def test_the_windows_start_past_what_the_imatrix_read(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read: int, says: str
) -> None:
    """An imatrix that records reading the default text: the measurement takes its windows
    past the first window boundary after those tokens (300 read: from token 512), spread over
    the rest of the text, so the KL is of text none of its figures came from; one that read all
    of it is measured on windows spread over the whole text, said not to be held out."""
    import sys

    starts = []
    held_out = plan_kl.held_out

    def recorded(*args: Any) -> plan_kl.HeldOut:
        found = held_out(*args)
        starts.append(found)
        return found

    monkeypatch.setattr(plan_kl, "held_out", recorded)
    imatrix = _recorded(tmp_path / "r.gguf", read)
    code, out, err = invoke("quantize", str(TINY_LM), "--target-kl", "0.01", "--imatrix",
                            str(imatrix), "-o", str(tmp_path / "o"), "--json")  # fmt: skip
    assert code == 0, err
    version = ".".join(str(v) for v in sys.version_info[:3])
    assert json.loads(out)["allocation"]["measured_kl"]["on"] == says.format(v=version)
    from qtool.engine.calibrate.data import default_text
    from qtool.engine.model.hf import tokenizer
    from qtool.engine.model.tokens import leading_ids

    ids = leading_ids(tokenizer(TINY_LM, "the model", None), default_text().content, 1 << 21)
    full = [ids[s : s + 256] for s in range(0, len(ids) - 255, 256)]
    offset = 2 if read == 300 else 0  # in windows of 256
    taken = [full.index(w, offset) for w in starts[0].windows]
    assert len(taken) == 8 and taken == sorted(taken) and taken[0] >= offset
    assert taken[-1] - taken[0] > len(full) // 2  # spread over the text, not its first windows


@pytest.mark.parametrize(
    ("chunk", "positions", "length"),
    [(2**31 - 1, 10**9, plan_kl.MEASURE_TOKENS), (2**31 - 1, None, plan_kl.MEASURE_TOKENS),
     (4096, 10**9, plan_kl.MEASURE_TOKENS), (256, 10**9, 256), (4096, 128, 128)],
    ids=["both-huge", "no-limit", "chunk-over", "chunk-under", "positions-under"],
)  # fmt: skip
def test_a_window_is_never_longer_than_the_measured_tokens(
    tmp_path: Path, chunk: int, positions: int | None, length: int
) -> None:
    """The window length is the input's to claim (the imatrix's chunk size, the config's
    max_position_embeddings), so it is capped at MEASURE_TOKENS: a chunk size of 2^31 - 1 with
    max_position_embeddings 1e9 made one window of the whole default text (901,438 tokens),
    its attention out of memory. The measurement scores at most MEASURE_TOKENS positions."""
    from types import SimpleNamespace

    from qtool.engine.model.hf import tokenizer
    from qtool.formats.imatrix import read_imatrix_file

    entries = {"blk.0.attn_q.weight": MatrixStats(np.ones((1, 64), np.float32), np.array([3]))}
    write_imatrix(tmp_path / "c.gguf", ImportanceMatrix(entries, chunk, 1, ("t.txt",)))
    metadata = read_imatrix_file(tmp_path / "c.gguf").metadata
    config = SimpleNamespace(max_position_embeddings=positions)
    held = plan_kl.held_out(tokenizer(TINY_LM, "the model", None), config, metadata)
    assert {len(w) for w in held.windows} == {length}
    assert len(held.windows) >= plan_kl.MEASURE_TOKENS // length
    assert held.tokens <= plan_kl.MEASURE_TOKENS
    assert not held.in_sample and "not held out" not in held.describe()


def _alphas(path: Path, alpha: Any) -> Path:
    """_imatrix's file with alpha `alpha(name)` for each tensor (the tied table included)."""
    entries = {
        f"blk.{b}.{k}.weight": MatrixStats(np.full((1, w), 3.0, np.float32), np.array([3]))
        for b in range(2)
        for k, w in KINDS.items()
    }
    alphas = {name: alpha(name) for name in [*entries, "token_embd.weight"]}
    extra = sensitivity_keys(Sensitivities(alphas, "test", 100, None))
    write_imatrix(path, ImportanceMatrix(entries, 512, 1, ("t.txt",)), extra)
    return path


def test_sensitivities_that_are_all_zero_are_refused(invoke: Invoke, tmp_path: Path) -> None:
    """Every alpha 0: every plan predicts KL 0, so the target decides nothing (the cheapest plan
    was measured and reported as 'every tensor at its least error'): one line naming the
    file, exit 1, nothing written."""
    imatrix = _alphas(tmp_path / "z.gguf", lambda _: 0.0)
    code, out, err = invoke("quantize", str(TINY_LM), "--target-kl", "0.005", "--imatrix",
                            str(imatrix), "-o", str(tmp_path / "o"))  # fmt: skip
    said = " ".join(err.split())
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert str(imatrix) in said and "its sensitivities say nothing" in said
    assert not (tmp_path / "o").exists()


def test_a_plan_is_at_its_least_error_only_by_its_errors(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor whose alpha is 0 costs the prediction nothing at any spec, so the plan stores it
    at its cheapest: that is not its least error, and a plan over the target with such tensors
    is not one 'with every tensor the target decides at its least error' (the test compared
    alpha x error, 0 for them whatever they are stored as)."""
    monkeypatch.setattr(sensitivity, "MAX_SOLVES", 1)
    imatrix = _alphas(tmp_path / "p.gguf", lambda n: 0.0 if "ffn" in n else 1e3)
    code, out, err = invoke("quantize", str(TINY_LM), "--target-kl", "1e-6", "--imatrix",
                            str(imatrix), "-o", str(tmp_path / "o"))  # fmt: skip
    said = " ".join(err.split())
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "at its least error" not in said and "no plan reached KL 1e-06 in 1 solve" in said


def test_tensors_an_allocation_keeps_float_are_not_said_quantized_without_the_imatrix(
    invoke: Invoke, tmp_path: Path
) -> None:
    """An imatrix of block 0 alone: block 1's 7 Linears have no entry and no alpha, so the
    allocation keeps them float; the warning on tensors without an entry is counted on the
    plan written, not on the plan before the allocation ('7 of 15 quantized tensors have no
    entry ... and were quantized without it', of tensors it wrote float)."""
    entries = {
        f"blk.0.{k}.weight": MatrixStats(np.full((1, w), 3.0, np.float32), np.array([3]))
        for k, w in KINDS.items()
    }
    alphas = dict.fromkeys(entries, 0.05) | {"token_embd.weight": 0.05}
    write_imatrix(tmp_path / "b0.gguf", ImportanceMatrix(entries, 512, 1, ("t.txt",)),
                  sensitivity_keys(Sensitivities(alphas, "test", 100, None)))  # fmt: skip
    code, out, err = invoke("quantize", str(TINY_LM), "--target-kl", "0.01", "--imatrix",
                            str(tmp_path / "b0.gguf"), "-o", str(tmp_path / "o"),
                            "--json")  # fmt: skip
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["tensors"]}
    block1 = [r for n, r in rows.items() if ".layers.1." in n and n.endswith("proj.weight")]
    assert len(block1) == 7 and not any(r["quantized"] for r in block1)
    assert "have no entry" not in err, err


@pytest.mark.parametrize("count", [float("nan"), "many", 1.5])
def test_an_imatrix_token_count_that_is_no_integer_records_nothing(count: object) -> None:
    """qtool.datasets.tokens comes from the imatrix file: a NaN, a string or a fraction there
    is no count of tokens read (0), never an internal error (int(nan) raised ValueError)."""
    from qtool.gguf_types import ValueType
    from qtool.io.gguf_layout import GGUFValue

    fields = {
        "qtool.datasets.sha256": GGUFValue(ValueType.ARRAY, ("abc",), ValueType.STRING),
        "qtool.datasets.tokens": GGUFValue(ValueType.ARRAY, (count,), ValueType.FLOAT32),
    }
    assert plan_kl._tokens_read(fields, "abc") == 0
