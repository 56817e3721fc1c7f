"""`qtool eval FLOAT Q1 Q2 ...` and the float side kept in a file (`--save-logits`, `--logits`),
on tiny models built offline (tests/eval_models.py); needs the interop extra.

Several candidates against one float pass must report, for each, exactly what a pair run
reports (so the float side was neither shifted nor mixed up between candidates); the figures
from a logits file equal the pair's but for the KL, within the 16-bit codes' bound; a logits
file made for another text, window, dtype, token count, model or tokenizer is refused."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

REASON = "needs the interop extra: pip install -c constraints.txt -e '.[interop]'"
pytest.importorskip("transformers", reason=REASON)
pytest.importorskip("compressed_tensors", reason=REASON)

import torch  # noqa: E402

from qtool import api  # noqa: E402
from qtool.errors import InputError  # noqa: E402
from qtool.eval_results import EvalSummary  # noqa: E402
from qtool.spec import PerChannel, PerGroup, QSpec, Scheme, StorageDtype  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.eval_models import build, save_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

TEXT = "Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!\n" * 12
INT4 = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32))
INT8 = QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(0))
QUANTS = ("ct-int4", "q-int8", "llama")  # the last: FLOAT itself (KL 0, nothing changed)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("many")
    (r / "text.txt").write_text(TEXT)
    (r / "other.txt").write_text(TEXT.upper())
    build(r / "llama", "llama")
    build(r / "llama-tied", "llama-tied")
    for name, spec, fmt in (("ct-int4", INT4, "compressed-tensors"), ("q-int8", INT8, "qtool")):
        api.quantize(r / "llama", r / name, api.QuantizeOptions(spec, (), format=fmt), device="cpu")
    return r


def options(root: Path, **changes: Any) -> Any:
    base: dict[str, Any] = {"text": root / "text.txt", "tokens": 500, "ctx": 64, "threads": 1}
    return api.EvalOptions(**(base | changes))


def run(root: Path, quants: tuple[str, ...] = QUANTS, **kw: Any) -> list[EvalSummary]:
    logits, save = kw.pop("logits", None), kw.pop("save_logits", None)
    paths = [root / q for q in quants]
    return api.evaluate_all(root / "llama", paths, options(root, **kw), None, logits, save)


@pytest.fixture(scope="module")
def pairs(root: Path) -> list[EvalSummary]:
    return [api.evaluate(root / "llama", root / q, options(root)) for q in QUANTS]


@pytest.fixture(scope="module")
def saved(root: Path) -> tuple[Path, list[EvalSummary]]:
    path = root / "base.qlogits"
    return path, run(root, save_logits=path)


def test_each_candidate_reports_exactly_what_its_pair_run_reports(
    pairs: list[EvalSummary], saved: tuple[Path, list[EvalSummary]]
) -> None:
    _, many = saved
    assert [s.inputs[1] for s in many] == [s.inputs[1] for s in pairs]
    for pair, one in zip(pairs, many, strict=True):
        assert one.causal == pair.causal  # every figure, bit for bit
        assert (one.changed, one.parameters) == (pair.changed, pair.parameters)
        assert (one.tokens, one.windows, one.ctx, one.loaded_as, one.notes) == (
            pair.tokens, pair.windows, pair.ctx, pair.loaded_as, pair.notes,
        )  # fmt: skip
    assert many[0].causal is not None and many[0].causal.kl.mean > 1e-3
    assert many[2].causal is not None and many[2].causal.kl.max == 0.0 and many[2].changed == 0


def test_from_a_logits_file_the_figures_are_the_pairs_and_kl_within_its_bound(
    root: Path, pairs: list[EvalSummary], saved: tuple[Path, list[EvalSummary]]
) -> None:
    path, _ = saved
    got = run(root, logits=path)
    for pair, one in zip(pairs, got, strict=True):
        c, p = one.causal, pair.causal
        assert c is not None and p is not None
        for name in ("ppl_float", "ppl_quant", "agree", "predicted", "ln_ratio", "ln_ratio_se"):
            assert getattr(c, name) == getattr(p, name), name
        assert c.dp_mean == pytest.approx(p.dp_mean, rel=1e-9, abs=1e-15)
        # each position's coded KL clamped at 0: FLOAT against itself is ~2e-6, not 0
        assert c.kl.mean == pytest.approx(p.kl.mean, rel=1e-3, abs=1e-5)
        assert c.kl.max >= 0 and c.kl.mean >= 0
        assert c.kl.mean != p.kl.mean  # the 16-bit codes, not an exact float side
        assert (one.changed, one.parameters) == (pair.changed, pair.parameters)


def test_from_a_logits_file_floats_weights_are_never_read(
    root: Path, tmp_path: Path, pairs: list[EvalSummary], saved: tuple[Path, list[EvalSummary]]
) -> None:
    """FLOAT's weight bytes overwritten (headers kept): the figures do not move."""
    blind = tmp_path / "llama"
    shutil.copytree(root / "llama", blind)
    weights = blind / "model.safetensors"
    data = bytearray(weights.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:] = b"\xff" * (len(data) - start)  # NaN in every float
    weights.write_bytes(bytes(data))
    got = api.evaluate_all(blind, [root / "ct-int4"], options(root), None, saved[0])
    assert got[0].causal is not None and pairs[0].causal is not None
    assert got[0].causal.ppl_float == pairs[0].causal.ppl_float


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"text": "other.txt"}, "its text"),
        ({"ctx": 32}, "its window length"),
        ({"dtype": "bfloat16"}, "its dtype"),
        ({"tokens": 400}, "its token count"),
        ({"float": "llama-tied"}, "its model config"),
        ({"float": "other-tokenizer"}, "its tokenizer"),
    ],
    ids=["text", "ctx", "dtype", "tokens", "model", "tokenizer"],
)
def test_a_logits_file_made_for_other_inputs_is_refused(
    root: Path, saved: tuple[Path, list[EvalSummary]], change: dict[str, Any], message: str
) -> None:
    float_dir = root / "llama"
    if change.get("float") == "other-tokenizer":
        float_dir = root / "other-tokenizer"
        if not float_dir.exists():
            shutil.copytree(root / "llama", float_dir)
            save_tokenizer(float_dir, encoder=False, extra_bos="</s>")
    elif "float" in change:
        float_dir = root / change["float"]
    kw = {k: (root / v if k == "text" else v) for k, v in change.items() if k != "float"}
    quant = root / ("ct-int4" if float_dir.name != "llama-tied" else "llama-tied")
    with pytest.raises(InputError, match=message) as err:
        api.evaluate_all(float_dir, [quant], options(root, **kw), None, saved[0])
    assert err.value.path == str(saved[0])


def test_cli_a_row_per_candidate_and_the_gate_names_who_failed(
    root: Path, invoke: Invoke, saved: tuple[Path, list[EvalSummary]]
) -> None:
    args = ["eval", str(root / "llama"), *(str(root / q) for q in QUANTS), "--text",
            str(root / "text.txt"), "--tokens", "500", "--ctx", "64", "--threads", "1"]  # fmt: skip
    code, out, err = invoke(*args, "--max-kl", "0.01")
    assert code == 3, err
    failed = [line for line in out.splitlines() if line.startswith("gate: FAILED")]
    assert len(failed) == 1 and "ct-int4" in failed[0] and "mean KL" in failed[0]
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(" ")]
    assert all(q in rows for q in QUANTS), out  # each by its shortest distinct ending
    code, out, err = invoke(*args, "--json", "--max-kl", "1")
    doc = json.loads(out)
    assert code == 0 and [c["inputs"][1] for c in doc["candidates"]] == [
        str(root / q) for q in QUANTS
    ]
    assert doc["gate"] == {"passed": True, "failed": []}
    first = doc["candidates"][0]["causal"]
    assert first["kl"]["mean"] == saved[1][0].causal.kl.mean  # type: ignore[union-attr]
    assert set(first["ln_ppl_ratio"]) == {"mean", "se"} and "mean_dp" in first


def test_cli_save_then_logits_and_their_usage_errors(
    root: Path, invoke: Invoke, tmp_path: Path
) -> None:
    common = ["--text", str(root / "text.txt"), "--tokens", "300", "--ctx", "64", "--threads", "1"]
    out_file = tmp_path / "f.qlogits"
    code, out, err = invoke("eval", str(root / "llama"), "--save-logits", str(out_file), *common)
    assert code == 0, err
    assert out_file.exists() and f"wrote {out_file}" in out
    assert [p.name for p in tmp_path.iterdir()] == ["f.qlogits"]  # no temp left behind
    code, out, err = invoke("eval", str(root / "llama"), str(root / "q-int8"), "--logits",
                            str(out_file), *common, "--json")  # fmt: skip
    assert code == 0, err and json.loads(out)["candidates"][0]["changed_tensors"] > 0
    for extra, message in (
        ([], "give QUANT"),
        ([str(root / "q-int8"), "--per-layer", "--logits", str(out_file)], "--per-layer"),
        ([str(root / "q-int8"), "--logits", str(out_file), "--save-logits", str(out_file)],
         "give one"),
    ):  # fmt: skip
        code, out, err = invoke("eval", str(root / "llama"), *extra, *common)
        assert code == 2 and message in err and out == "", (extra, err)


def test_cli_save_logits_never_replaces_an_input(root: Path, invoke: Invoke) -> None:
    """FLOAT's weights, a QUANT's file or the text named as --save-logits: refused, untouched."""
    weights = root / "llama" / "model.safetensors"
    common = ["--text", str(root / "text.txt"), "--tokens", "100", "--ctx", "64", "--threads", "1"]
    for target in (weights, root / "ct-int4" / "config.json", root / "text.txt"):
        before = target.read_bytes()
        code, out, err = invoke("eval", str(root / "llama"), str(root / "ct-int4"),
                                "--save-logits", str(target), *common)  # fmt: skip
        assert code == 1 and out == "" and len(err.splitlines()) == 1, err
        assert target.read_bytes() == before


def test_each_candidate_is_checked_for_an_in_sample_text(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A candidate whose quantization recorded the evaluation text gets the pair run's in-sample
    warning and record; the others do not."""
    import dataclasses
    import hashlib

    from qtool.calibration import Role, TextUse
    from qtool.engine.evaluate import many

    sha = hashlib.sha256(TEXT.encode()).hexdigest()
    used = (TextUse("text.txt", sha, 500, Role.CALIBRATION),)
    real = many.load_quant

    def recorded(path: Path, *args: Any) -> Any:
        loaded = real(path, *args)
        return dataclasses.replace(loaded, texts=used) if path.name == "q-int8" else loaded

    monkeypatch.setattr(many, "load_quant", recorded)
    got = run(root, ("ct-int4", "q-int8"), tokens=100)
    assert [s.in_sample for s in got] == [(), used]
    assert not any("in sample" in n for n in got[0].notes)
    assert any("in sample" in n and "calibrated on" in n for n in got[1].notes)


def test_cli_logits_gives_the_text_tokens_ctx_and_dtype_it_was_saved_with(
    root: Path, invoke: Invoke, tmp_path: Path
) -> None:
    """--logits FILE alone runs on what the file was saved from (they had to be repeated, and a
    --dtype or --tokens left out was refused as differing); one given that differs is still
    refused; a saved text that is not there any more asks for --text."""
    text = tmp_path / "saved.txt"
    shutil.copy(root / "text.txt", text)
    saved = tmp_path / "f.qlogits"
    made = ["--text", str(text), "--tokens", "300", "--ctx", "48", "--dtype", "bfloat16"]
    code, _, err = invoke("eval", str(root / "llama"), "--save-logits", str(saved), *made,
                          "--threads", "1")  # fmt: skip
    assert code == 0, err
    args = ["eval", str(root / "llama"), str(root / "q-int8"), "--logits", str(saved),
            "--threads", "1", "--json"]  # fmt: skip
    code, out, err = invoke(*args)
    assert code == 0, err
    doc = json.loads(out)  # one QUANT: its own document
    assert (doc["tokens"], doc["ctx"], doc["dtype"]) == (300, 48, "bfloat16")
    assert doc["text"]["source"] == str(text)
    for given, differs in ((["--tokens", "200"], "token count"), (["--ctx", "64"], "window"),
                           (["--dtype", "float32"], "dtype"),
                           (["--text", str(root / "other.txt")], "text")):  # fmt: skip
        code, out, err = invoke(*args, *given)
        assert code == 1 and out == "" and f"its {differs}" in err, (given, err)
    text.unlink()
    code, out, err = invoke(*args)
    assert code == 2 and out == "" and "--text FILE" in err and str(text) in err, err


def test_saved_defaults_default_text_and_a_dtype_qtool_does_not_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A file saved on the default text defaults to it (from any CPython: the SHA-256 check
    then says whether the text is the same); a dtype qtool cannot run in is the file's fault."""
    from qtool.engine.evaluate import many
    from qtool.engine.model.text import default_text
    from qtool.formats.logits_file import LogitsInfo

    info = LogitsInfo("0" * 64, default_text().source.replace("3.", "2."), "0" * 64, 96, 48,
                      "float16", "c", "t", "LlamaForCausalLM", 100, (48, 48))  # fmt: skip
    monkeypatch.setattr(many, "read_logits_info", lambda path: info)
    path = tmp_path / "f.qlogits"
    assert many.saved_defaults(path, None, None, None, None) == (None, 96, 48, "float16")
    assert many.saved_defaults(path, path, 50, 8, "float32") == (path, 50, 8, "float32")
    assert many.saved_defaults(None, None, None, None, None) == (None, 4096, None, "float32")
    monkeypatch.setattr(many, "read_logits_info", lambda path: replace(info, dtype="int3"))
    with pytest.raises(InputError, match="its dtype 'int3'"):
        many.saved_defaults(path, None, None, None, None)


@pytest.mark.parametrize("quants", [("q-int8",), ("q-int8", "llama")])
def test_cli_from_a_logits_file_says_so_not_a_float_pass(
    root: Path,
    invoke: Invoke,
    saved: tuple[Path, list[EvalSummary]],
    quants: tuple[str, ...],
    tmp_path: Path,
) -> None:
    """With --logits no float pass runs: the report names the file FLOAT's side came from, says
    the KL comes from its 16-bit codes, and never claims a float pass or two models' timing (it
    did, one QUANT or several); the JSON names the file read, saving names the file written."""
    args = ["eval", str(root / "llama"), *(str(root / q) for q in quants), "--threads", "1"]
    code, out, err = invoke(*args, "--logits", str(saved[0]))
    assert code == 0, err
    out = " ".join(out.split())  # lines folded to the width joined
    assert "float pass" not in out.replace("no float pass", "") and "2 models" not in out, out
    assert f"read from {saved[0]}" in out and "16 bits" in out, out
    code, out, err = invoke(*args, "--logits", str(saved[0]), "--json")
    assert code == 0, err
    assert json.loads(out)["logits"] == {"file": str(saved[0]), "use": "read"}
    code, out, err = invoke(*args, "--json")
    assert code == 0, err
    assert json.loads(out)["logits"] is None
    written = tmp_path / "w.qlogits"
    code, out, err = invoke(*args, "--save-logits", str(written), "--json")
    assert code == 0, err
    assert json.loads(out)["logits"] == {"file": str(written), "use": "written"}


def test_cli_json_shape_follows_the_quant_count_as_json_md_says(
    root: Path, invoke: Invoke, saved: tuple[Path, list[EvalSummary]], tmp_path: Path
) -> None:
    """json.md: one QUANT gives the one-QUANT document, with --logits too; none
    (--save-logits alone) or several give `candidates`; both name the logits file and keep
    schema_version 2 (the docs said --logits alone moved one QUANT under `candidates`)."""
    floatdir, q = str(root / "llama"), str(root / "q-int8")
    common = ["--threads", "1", "--json"]
    written = tmp_path / "w.qlogits"
    runs = [
        ([q, "--logits", str(saved[0])], 1, {"file": str(saved[0]), "use": "read"}),
        ([q, q.replace("q-int8", "llama"), "--logits", str(saved[0])], 2,
         {"file": str(saved[0]), "use": "read"}),
        (["--save-logits", str(written), "--text", str(root / "text.txt"), "--tokens", "100",
          "--ctx", "64"], 0, {"file": str(written), "use": "written"}),
    ]  # fmt: skip
    for args, count, logits in runs:
        code, out, err = invoke("eval", floatdir, *args, *common)
        assert code == 0, err
        doc = json.loads(out)
        assert doc["schema_version"] == 2 and doc["logits"] == logits
        assert ("candidates" in doc) == (count != 1), args
        assert len(doc.get("candidates", [doc])) == count


def test_cli_save_logits_alone_reports_what_the_float_pass_measured(
    root: Path, invoke: Invoke, saved: tuple[Path, list[EvalSummary]], tmp_path: Path
) -> None:
    """`eval FLOAT --save-logits FILE` (no QUANT) said only 'wrote FILE': it now gives the text,
    tokens, windows and FLOAT's perplexity, in the console and the JSON's `float`, the same as
    a run with candidates reports for FLOAT."""
    first = saved[1][0]
    assert first.causal is not None
    common = ["--text", str(root / "text.txt"), "--tokens", "500", "--ctx", "64", "--threads", "1"]
    code, out, err = invoke("eval", str(root / "llama"), "--save-logits",
                            str(tmp_path / "a.qlogits"), *common)  # fmt: skip
    assert code == 0, err
    out = " ".join(out.split())
    ppl = f"perplexity FLOAT {first.causal.ppl_float:,.2f}"
    scored = f"{first.causal.predicted:,} positions scored"
    for shown in (str(root / "text.txt"), f"{first.tokens:,} tokens", ppl,
                  f"{first.windows} windows of 64", scored):  # fmt: skip
        assert shown in out, (shown, out)
    code, out, err = invoke("eval", str(root / "llama"), "--save-logits",
                            str(tmp_path / "b.qlogits"), *common, "--json")  # fmt: skip
    assert code == 0, err
    got = json.loads(out)["float"]
    assert got["perplexity_float"] == first.causal.ppl_float
    assert (got["tokens"], got["windows"], got["ctx"], got["positions_scored"]) == (
        first.tokens,
        first.windows,
        64,
        first.causal.predicted,
    )
    assert got["text"]["source"] == str(root / "text.txt") and got["seconds"] > 0


def test_a_logits_file_finds_its_text_from_another_directory(
    root: Path, invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text given by a relative path was stored as given: --logits from another directory
    looked for it there and asked for --text. The file stores the resolved path."""
    from qtool.formats.logits_file import read_logits_info

    (tmp_path / "here").mkdir()
    shutil.copy(root / "text.txt", tmp_path / "here" / "t.txt")
    monkeypatch.chdir(tmp_path / "here")
    saved = tmp_path / "f.qlogits"
    code, _, err = invoke("eval", str(root / "llama"), "--save-logits", str(saved), "--text",
                          "t.txt", "--tokens", "100", "--ctx", "64", "--threads", "1")  # fmt: skip
    assert code == 0, err
    assert read_logits_info(saved).text_source == str(tmp_path / "here" / "t.txt")
    monkeypatch.chdir(root)
    code, out, err = invoke("eval", str(root / "llama"), str(root / "q-int8"), "--logits",
                            str(saved), "--threads", "1", "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["tokens"] == 100
