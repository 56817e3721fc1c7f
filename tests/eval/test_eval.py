"""`qtool eval` end to end on tiny models built offline (tests/eval_models.py), exported with
qtool itself (qtool format, sharded, compressed-tensors) and as float; needs the interop extra.

The figures are checked against an independent reference: both models run by this test over
the same windows, scored with torch's cross_entropy and kl_div. The tests fail on a KL taken
the other way round, on targets shifted by one, on windows cut wrongly, and on a quantized side
that was silently not loaded (KL exactly 0, or figures that differ from the same weights
loaded another way)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

REASON = "needs the interop extra: pip install -c constraints.txt -e '.[interop]'"
transformers = pytest.importorskip("transformers", reason=REASON)
pytest.importorskip("compressed_tensors", reason=REASON)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from qtool import api  # noqa: E402
from qtool.engine.model.text import windows  # noqa: E402
from qtool.errors import InputError  # noqa: E402
from qtool.eval_results import EvalSummary  # noqa: E402
from qtool.spec import PerChannel, PerGroup, QSpec, Scheme, StorageDtype  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.eval_models import build, save_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")  # third-party loaders warn freely

TEXT = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine!\n"
    "Is this the real life? Is this just fantasy? Caught in a landslide.\n\n"
) * 12
INT4 = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32))
INT8 = QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(0))
ASYM8 = QSpec(Scheme.ASYM, StorageDtype.INT8, PerChannel(0))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Tiny matmuls: threads only cost synchronisation (and much more on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def quantize(
    src: Path, out: Path, spec: QSpec, fmt: str = "qtool", include: tuple[str, ...] = ()
) -> Path:
    api.quantize(src, out, api.QuantizeOptions(spec, include, format=fmt), device="cpu")
    return out


TIED_TOO = ("*embed_tokens.weight", "*_proj.weight")  # a tied embedding stays float by default


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny models and their exports (built once)."""
    r = tmp_path_factory.mktemp("eval")
    (r / "text.txt").write_text(TEXT)
    for name in ("llama-tied", "llama", "bert"):
        build(r / name, name)
    build(r / "llama-sharded", "llama", shard_bytes=60_000)
    quantize(r / "llama-tied" / "model.safetensors", r / "tied.int4.safetensors", INT4,
             include=TIED_TOO)  # fmt: skip
    quantize(r / "llama-sharded", r / "sharded.int8", INT8)
    quantize(r / "llama", r / "llama-ct-int4", INT4, "compressed-tensors")
    quantize(r / "llama", r / "llama-ct-asym8", ASYM8, "compressed-tensors")
    quantize(r / "bert" / "model.safetensors", r / "bert.int4.safetensors", INT4)
    quantize(r / "bert", r / "bert-ct-int4", INT4, "compressed-tensors")
    return r


def evaluate(root: Path, float_dir: str, quant: str, **options: Any) -> EvalSummary:
    defaults: dict[str, Any] = {"text": root / "text.txt", "tokens": 700, "ctx": 96}
    return api.evaluate(root / float_dir, root / quant, api.EvalOptions(**(defaults | options)))


# ---- the reference: this test's own loop -------------------------------------------------------


def reference_figures(
    float_model: Any, quant_model: Any, ids: list[int], ctx: int
) -> dict[str, float]:
    """Perplexities, mean KL(float || quant) and top-1 agreement by torch's own losses."""
    nll_f, nll_q, kls, agree = [], [], [], []
    with torch.no_grad():
        for start in range(0, len(ids), ctx):
            window = torch.tensor(ids[start : start + ctx])
            if len(window) < 2:
                continue
            lf = float_model(window[None]).logits[0, :-1].double()
            lq = quant_model(window[None]).logits[0, :-1].double()
            target = window[1:]
            nll_f.append(F.cross_entropy(lf, target, reduction="none"))
            nll_q.append(F.cross_entropy(lq, target, reduction="none"))
            logp_f, logp_q = lf.log_softmax(-1), lq.log_softmax(-1)
            kls.append(F.kl_div(logp_q, logp_f, log_target=True, reduction="none").sum(-1))
            agree.append((lf.argmax(-1) == lq.argmax(-1)).double())
    return {
        "ppl_float": math.exp(torch.cat(nll_f).mean()),
        "ppl_quant": math.exp(torch.cat(nll_q).mean()),
        "kl": float(torch.cat(kls).mean()),
        "top1": float(torch.cat(agree).mean()),
        "predicted": sum(len(k) for k in kls),
    }


def dequantized_model(root: Path, float_dir: str, quant_file: str) -> Any:
    """FLOAT's architecture with QUANT's weights as `qtool dequantize` restores them."""
    restored = root / f"{quant_file}.restored.safetensors"
    if not restored.exists():
        api.dequantize(root / quant_file, restored)
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(root / float_dir, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in load_file(restored).items()}, strict=False)
    return model.eval()


# ---- causal LMs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tied_int4(root: Path) -> EvalSummary:
    return evaluate(root, "llama-tied", "tied.int4.safetensors", per_layer=True)


def test_figures_equal_an_independent_reference(root: Path, tied_int4: EvalSummary) -> None:
    float_model = transformers.AutoModelForCausalLM.from_pretrained(
        root / "llama-tied", dtype=torch.float32
    ).eval()
    quant_model = dequantized_model(root, "llama-tied", "tied.int4.safetensors")
    tok = transformers.AutoTokenizer.from_pretrained(root / "llama-tied")
    ids = tok(TEXT)["input_ids"][:700]
    ref = reference_figures(float_model, quant_model, ids, 96)
    got = tied_int4.causal
    assert got is not None
    assert got.predicted == ref["predicted"] == 700 - len(windows(700, 96))
    assert got.ppl_float == pytest.approx(ref["ppl_float"], rel=1e-5)
    assert got.ppl_quant == pytest.approx(ref["ppl_quant"], rel=1e-5)
    assert got.kl.mean == pytest.approx(ref["kl"], rel=1e-3)
    assert got.top1 == pytest.approx(ref["top1"])
    assert got.kl.mean > 1e-4  # int4 moves a model: the quantized side really was loaded
    assert tied_int4.tokens == 700 and tied_int4.windows == 8 and tied_int4.ctx == 96


def test_a_tied_head_is_quantized_with_the_embedding(tied_int4: EvalSummary) -> None:
    assert tied_int4.layers is not None
    names = {r.name for r in tied_int4.layers}
    assert "lm_head" in names and "model.layers.1.mlp.down_proj" in names
    assert all(r.tokens == 700 for r in tied_int4.layers)


def test_output_sqnr_equals_a_reference_from_captured_inputs(
    root: Path, tied_int4: EvalSummary
) -> None:
    """10 log10(|X W^T|^2 / |X (W - W_q)^T|^2) with X captured by this test's own hook."""
    name = "model.layers.0.mlp.down_proj"
    float_model = transformers.AutoModelForCausalLM.from_pretrained(
        root / "llama-tied", dtype=torch.float32
    ).eval()
    quant_model = dequantized_model(root, "llama-tied", "tied.int4.safetensors")
    inputs: list[torch.Tensor] = []
    module = float_model.get_submodule(name)
    handle = module.register_forward_hook(lambda m, a, o: inputs.append(a[0][0].double()))
    ids = transformers.AutoTokenizer.from_pretrained(root / "llama-tied")(TEXT)["input_ids"][:700]
    with torch.no_grad():
        for s, e in windows(700, 96):
            float_model(torch.tensor([ids[s:e]]))
    handle.remove()
    x = torch.cat(inputs)
    w = module.weight.double()
    dw = w - quant_model.get_submodule(name).weight.double()
    expected = 10 * math.log10(float((x @ w.T).square().sum() / (x @ dw.T).square().sum()))
    row = next(r for r in tied_int4.layers or () if r.name == name)
    assert row.output_sqnr_db == pytest.approx(expected, abs=1e-3)
    weight_db = 10 * math.log10(float(w.square().sum() / dw.square().sum()))
    assert row.weight_sqnr_db == pytest.approx(weight_db, abs=1e-4)


def test_float_against_itself_is_exactly_equal(root: Path) -> None:
    s = evaluate(root, "llama", "llama", tokens=200)
    assert s.causal is not None and s.causal.kl.max == 0.0 and s.causal.top1 == 1.0
    assert s.causal.ppl_ratio == 1.0 and s.changed == 0 and s.notes
    assert s.loaded_as == "float checkpoint"


def test_compressed_tensors_loaded_by_transformers_equals_its_dequantized_copy(root: Path) -> None:
    """transformers' load of the export gives exactly the figures of qtool's dequantization of
    it (so the codes were loaded, and decompressed as qtool reads them), and they are not 0."""
    api.dequantize(root / "llama-ct-int4", root / "ct.restored.safetensors")
    by_transformers = evaluate(root, "llama", "llama-ct-int4")
    by_qtool = evaluate(root, "llama", "ct.restored.safetensors")
    assert by_transformers.loaded_as.startswith("compressed-tensors, loaded by transformers")
    assert by_transformers.causal == by_qtool.causal
    assert by_transformers.causal is not None and by_transformers.causal.kl.mean > 1e-4
    assert by_transformers.tokenizer == "FLOAT's = QUANT's"


def test_asymmetric_compressed_tensors_load_with_dequantize(root: Path) -> None:
    s = evaluate(root, "llama", "llama-ct-asym8", tokens=200)
    assert "dequantize=True" in s.loaded_as
    assert s.causal is not None and 0 < s.causal.kl.mean < 0.05 and s.changed == 14


def test_a_sharded_qtool_output_is_dequantized_shard_by_shard(root: Path) -> None:
    s = evaluate(root, "llama-sharded", "sharded.int8", tokens=200)
    assert s.loaded_as == "qtool reader, dequantized in memory"
    assert s.causal is not None and 0 < s.causal.kl.mean < 0.05


def test_tied_compressed_tensors_export(root: Path, tmp_path: Path) -> None:
    """Loads once `ignore` names the tied head; without it (qtool 0.1's exports) transformers
    cannot load it, and the error says why."""
    out = quantize(root / "llama-tied", tmp_path / "ct", INT4, "compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    if "lm_head" not in json.dumps(config["quantization_config"]["ignore"]):
        with pytest.raises(InputError, match='lacks "lm_head"'):
            evaluate(root, "llama-tied", str(out), tokens=100)
        config["quantization_config"]["ignore"] = ["lm_head"]
        (out / "config.json").write_text(json.dumps(config))
    s = evaluate(root, "llama-tied", str(out), tokens=100)
    assert s.causal is not None and s.causal.kl.mean > 0


def test_the_default_text_is_cpython_documentation(root: Path) -> None:
    s = evaluate(root, "llama", "llama", text=None, tokens=64, ctx=None)
    assert s.text.source.startswith("pydoc_data topics (CPython 3.")
    assert s.tokens == 64 and s.ctx == 128  # FLOAT's max_position_embeddings < 512


# ---- encoders -------------------------------------------------------------------------------


def test_encoder_cosine_and_hidden_state_error(root: Path) -> None:
    s = evaluate(root, "bert", "bert.int4.safetensors", tokens=400, per_layer=True)
    e = s.encoder
    assert s.causal is None and e is not None
    assert 0.5 < e.cosine_min <= e.cosine_mean < 1.0 and 0 < e.hidden_rel_error < 1
    assert s.tokens <= 400 and s.windows == e.sentences
    assert s.layers and "pooler.dense" in {r.name for r in s.layers}
    same = evaluate(root, "bert", "bert", tokens=100)
    assert same.encoder is not None and same.encoder.hidden_rel_error == 0.0
    assert same.encoder.cosine_min == pytest.approx(1.0)


def test_encoder_compressed_tensors_equals_its_dequantized_copy(root: Path) -> None:
    api.dequantize(root / "bert-ct-int4", root / "bert-ct.restored.safetensors")
    a = evaluate(root, "bert", "bert-ct-int4", tokens=300)
    b = evaluate(root, "bert", "bert-ct.restored.safetensors", tokens=300)
    assert a.encoder == b.encoder and a.encoder is not None and a.encoder.cosine_mean < 1


# ---- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("float_dir", "quant", "message"),
    [
        ("llama", "bert.int4.safetensors", "not a checkpoint of FLOAT's model"),
        ("llama", "bert-ct-int4", "not FLOAT's architecture"),
        ("llama-tied", "llama-ct-int4", "not FLOAT's architecture"),
        ("llama", "tied.int4.safetensors", "not a checkpoint of FLOAT's model"),
        ("llama-ct-int4", "llama", "FLOAT is already quantized"),
        ("llama/model.safetensors", "llama", "FLOAT must be a Hugging Face model directory"),
        ("llama", "missing.safetensors", "no such file"),
    ],
    ids=["names", "ct-arch", "tied-vs-untied", "tied-names", "float-quantized", "float-file",
         "missing"],
)  # fmt: skip
def test_pairs_of_different_models_are_refused(
    root: Path, float_dir: str, quant: str, message: str
) -> None:
    with pytest.raises(InputError, match=message):
        evaluate(root, float_dir, quant, tokens=50)


def test_another_tokenizer_is_refused(root: Path, tmp_path: Path) -> None:
    other = tmp_path / "ct"
    shutil.copytree(root / "llama-ct-int4", other)
    save_tokenizer(other, encoder=False, extra_bos="</s>")  # same vocabulary, another BOS
    with pytest.raises(InputError, match="tokenizer differs from FLOAT's: at token 0"):
        evaluate(root, "llama", str(other), tokens=50)


def test_codes_without_their_sidecar_are_refused(root: Path, tmp_path: Path) -> None:
    lonely = tmp_path / "codes.safetensors"
    shutil.copy(root / "tied.int4.safetensors", lonely)
    with pytest.raises(Exception, match="sidecar|qparams"):
        evaluate(root, "llama-tied", str(lonely), tokens=50)


# ---- the command line -----------------------------------------------------------------------


def listing(root: Path) -> list[tuple[str, int, float]]:
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*"))


def test_cli_gate_exits_3_naming_the_bound_and_writes_nothing(root: Path, invoke: Invoke) -> None:
    before = listing(root)
    args = ["eval", str(root / "llama-tied"), str(root / "tied.int4.safetensors"), "--text",
            str(root / "text.txt"), "--tokens", "200", "--ctx", "64", "--threads", "1"]  # fmt: skip
    code, out, err = invoke(*args, "--max-kl", "1e-9", "--min-top1", "0.1", "--per-layer")
    assert code == 3, err
    assert (
        "gate: FAILED (mean KL" in out
        and "above 1e-09" in out
        and "top-1" not in out.split("gate:")[1]
    )
    assert "Per quantized Linear" in out and "lm_head" in out
    code, out, err = invoke(*args, "--json", "--max-ppl-ratio", "100")
    doc = json.loads(out)
    assert code == 0 and doc["command"] == "eval" and doc["gate"]["passed"] is True
    assert doc["causal"]["positions_scored"] == 200 - 4 and doc["layers"] is None
    assert set(doc["causal"]["kl"]) == {"mean", "median", "p90", "p99", "p999", "max"}
    assert listing(root) == before


@pytest.mark.parametrize(
    ("model", "flag", "message"),
    [("bert", "--max-kl", "--max-kl bound(s) a causal LM's figures; FLOAT is an encoder"),
     ("llama", "--min-cosine", "--min-cosine bounds an encoder's figure")],
    ids=["kl-on-encoder", "cosine-on-lm"],
)  # fmt: skip
def test_cli_bound_for_the_other_kind_is_a_usage_error(
    root: Path, invoke: Invoke, model: str, flag: str, message: str
) -> None:
    code, out, err = invoke("eval", str(root / model), str(root / model), flag, "0.5")
    assert code == 2 and message in err and out == ""


def test_cli_bad_inputs_are_one_line(root: Path, invoke: Invoke, tmp_path: Path) -> None:
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"abc\xff\xfe")
    code, out, err = invoke("eval", str(root / "llama"), str(root / "llama"), "--text", str(binary))
    assert (
        code == 1 and "not UTF-8 text (byte 0xff at offset 3)" in err and len(err.splitlines()) == 1
    )
    code, _, err = invoke("eval", str(root / "nothing"), str(root / "llama"))
    assert code == 1 and "nothing: no such file or directory" in err
    code, _, err = invoke("eval", str(root / "llama"), str(root / "llama"), "--min-top1", "2")
    assert code == 2 and "--min-top1" in err
    code, _, err = invoke("eval", str(root / "llama"), str(root / "llama"), "--max-kl", "nan")
    assert code == 2 and "--max-kl" in err
    code, _, err = invoke("eval", str(root / "llama"), str(root / "llama"), "--max-kl", "inf")
    assert code == 2 and "finite" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_cuda_without_a_gpu_is_a_clear_error(root: Path, invoke: Invoke) -> None:
    code, _, err = invoke("eval", str(root / "llama"), str(root / "llama"), "--device", "cuda")
    assert code == 1 and "no CUDA device" in err


def test_cli_without_transformers_names_the_extra(
    root: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import fails
    code, out, err = invoke("eval", str(root / "llama"), str(root / "llama"))
    assert code == 1 and "pip install 'qtool[interop]'" in err and out == ""


def test_bfloat16_compute_runs_both_models_in_bfloat16(root: Path) -> None:
    s = evaluate(root, "llama-tied", "tied.int4.safetensors", tokens=200, dtype="bfloat16",
                 per_layer=True)  # fmt: skip
    assert s.dtype == "bfloat16" and s.causal is not None
    assert math.isfinite(s.causal.kl.mean) and s.causal.kl.mean > 0
    assert s.layers and all(math.isfinite(r.output_sqnr_db) for r in s.layers)
