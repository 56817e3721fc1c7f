"""One figure for one pair (issue 21): every error figure is the error of the weights as a
consumer restores them, by one definition (numerics/metrics.py), so `quantize` and `compare` of
the same pair print the same digits, whatever the input dtype, the format and the kernel.

Each test here failed on the code before the fix: quantize measured the float32 reconstruction
(the torch kernel through a fused multiply-add), compare the restored one, the fused kernel
summed in another order, and the two commands pooled different tensors.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.engine import plots
from qtool.numerics import kernels, metrics, select
from qtool.numerics.metrics import SquareSums, chunk_spans, error_stats, next_pow2
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, RangeMethod, Scheme, StorageDtype
from tests.conftest import SAMPLES, Invoke

NUMBA = select.numba_installed()
KERNELS = ["torch", pytest.param("fused", marks=pytest.mark.skipif(not NUMBA, reason="no numba"))]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FIGURES = ("mse", "max_abs_error", "sqnr_db", "mse_gain")


# ---------------------------------------------------------------- the definition itself


def reference_sum(values: torch.Tensor, shape: tuple[int, ...]) -> float:
    """docs/numerics.md's sum of squares, written out plainly with numpy: float64 squares, each
    chunk folded in halves over the next power of two, the chunk sums added exactly."""
    squares = values.reshape(-1).double().numpy() ** 2
    parts = []
    for a, b in chunk_spans(shape):
        p = next_pow2(b - a)
        buf = np.zeros(p)
        buf[: b - a] = squares[a:b]
        while p > 1:
            p //= 2
            buf[:p] = buf[:p] + buf[p : 2 * p]
        parts.append(buf[0])
    return math.fsum(parts)


SHAPES = [(37, 1), (5000,), (3, 5000), (100, 37), (7, 4096), (2, 8193), (40000, 3), (4, 3, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_square_sums_follow_the_definition_whatever_the_runs(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    want = reference_sum(x, shape)
    rng = random.Random(0)
    for _ in range(4):
        sums, flat, i = SquareSums(shape), x.reshape(-1), 0
        while i < flat.numel():
            step = rng.choice([1, 7, 100, 4096, 5000, 70000])
            sums.add(flat[i : i + step])
            i += step
        assert sums.totals() == [want]


def test_tensor_sums_of_a_batch_are_each_tensors_own() -> None:
    shapes = [(16, 16), (3, 4100), (37, 1), (2, 3, 5), (9000,)]
    xs = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    flat = torch.cat([x.reshape(-1) for x in xs])
    offsets = np.cumsum([0] + [x.numel() for x in xs[:-1]]).tolist()
    got = metrics.tensor_sums(flat, list(zip(offsets, shapes, strict=True)))
    assert got == [reference_sum(x, s) for x, s in zip(xs, shapes, strict=True)]


SPECS = [
    QSpec(),
    QSpec(granularity=PerGroup(128)),
    QSpec(granularity=PerTensor()),
    QSpec(granularity=PerChannel(1)),
    QSpec(Scheme.ASYM, StorageDtype.UINT4, PerGroup(32), RangeMethod.MSE),
    QSpec(range_method=RangeMethod.MSE),
]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("shape", [(300, 200), (3, 9000), (37, 1)], ids=str)
def test_kernel_figures_are_the_restored_error(
    dtype: torch.dtype, spec: QSpec, shape: tuple[int, ...]
) -> None:
    """The kernels' figures equal compare's on the restored tensor and the plain reference, to
    the last bit, with slabs of any size."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    for block in (kernels.DEFAULT_BLOCK_ELEMS, 999):
        result = kernels.quantize_tensor(x, spec, block_elems=block)
        q, s, z = result.q, result.scale, result.zero_point
        restored = kernels.dequantize(q, s, z, spec, dtype=dtype, shape=shape)
        assert result.errors is not None
        assert replace(result.errors, sq_error_minmax=None) == error_stats(x, restored)
        error = x.float() - restored.float()
        if spec.range_method is RangeMethod.MSE:  # what min-max would give, measured alike
            minmax = replace(spec, range_method=RangeMethod.MINMAX)
            want = kernels.quantize_tensor(x, minmax, block_elems=block).errors
            assert want is not None and result.errors.sq_error_minmax == want.sq_error
        assert result.errors.sq_error == reference_sum(error, shape)
        assert result.errors.sq_signal == reference_sum(x.float(), shape)
        assert result.errors.max_abs == float(error.abs().max())


@pytest.mark.skipif(not NUMBA, reason="no numba")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("spec", SPECS[:5], ids=lambda s: s.describe())
def test_fused_kernels_give_the_same_figures(dtype: torch.dtype, spec: QSpec) -> None:
    from qtool.numerics import fused

    for shape in ((300, 200), (3, 9000), (37, 1), (5000,)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        if not fused.supports(spec, x.ndim) or spec.granularity == PerChannel(1) and x.ndim < 2:
            continue
        for scale_dtype in (torch.float32, dtype):
            want = kernels.quantize_tensor(x, spec, scale_dtype=scale_dtype)
            got = fused.quantize_tensor(x, spec, scale_dtype=scale_dtype)
            assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
            assert got.errors == want.errors, (shape, scale_dtype)


# ---------------------------------------------------------------- quantize vs compare, end to end


def write_as(src: Path, dst: Path, dtype: torch.dtype, extra: dict[str, torch.Tensor]) -> Path:
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(src).items()}
    save_file(tensors | {k: v.to(dtype) for k, v in extra.items()}, dst)
    return dst


def checkpoint(tmp_path: Path, tag: str) -> Path:
    """sample_weights/mlp plus tensors past the tiny-tensor batches: a long row cut into
    several chunks, many short rows, a column and a conv."""
    g = torch.Generator().manual_seed(11)
    extra = {
        "wide.weight": torch.randn(3, 9000, generator=g),
        "tall.weight": torch.randn(400, 100, generator=g),
        "conv.weight": torch.randn(64, 16, 5, 5, generator=g),
        "col.weight": torch.randn(37, 1, generator=g),
    }
    return write_as(SAMPLES / "mlp.safetensors", tmp_path / f"m-{tag}.safetensors", DTYPES[tag],
                    extra)  # fmt: skip


def llama(tmp_path: Path, tag: str) -> Path:
    """A llama model directory in `tag`'s dtype, its MLP wide enough for the one-tensor kernels
    and for rows longer than a chunk (intermediate 4160)."""
    root = tmp_path / f"llama-{tag}"
    root.mkdir()
    config = json.loads((SAMPLES / "tiny-llama" / "config.json").read_text())
    config |= {"intermediate_size": 4160, "num_hidden_layers": 1, "dtype": str(DTYPES[tag])[6:]}
    (root / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(12)
    shapes = {
        "lm_head.weight": (128, 64),
        "model.embed_tokens.weight": (128, 64),
        "model.norm.weight": (64,),
        "model.layers.0.input_layernorm.weight": (64,),
        "model.layers.0.post_attention_layernorm.weight": (64,),
        "model.layers.0.mlp.down_proj.weight": (64, 4160),
        "model.layers.0.mlp.gate_proj.weight": (4160, 64),
        "model.layers.0.mlp.up_proj.weight": (4160, 64),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.k_proj.weight": (32, 64),
        "model.layers.0.self_attn.v_proj.weight": (32, 64),
        "model.layers.0.self_attn.o_proj.weight": (64, 64),
    }
    tensors = {k: (torch.randn(s, generator=g) * 0.05).to(DTYPES[tag]) for k, s in shapes.items()}
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return root


def run_json(invoke: Invoke, *args: str, kernel: str = "torch") -> tuple[int, dict[str, Any]]:
    code, out, err = invoke(*args, "--json", env={"QTOOL_KERNEL": kernel})
    assert code in (0, 3), err
    return code, json.loads(out)


def assert_same_figures(quantized: dict[str, Any], compared: dict[str, Any]) -> None:
    """Every figure of every quantized row, and the totals, equal (same float, same digits)."""
    rows = {r["name"]: r for r in compared["tensors"]}
    done = [r for r in quantized["tensors"] if r["quantized"]]
    assert done
    for row in done:
        for figure in ("mse", "max_abs_error", "sqnr_db"):
            assert row[figure] == rows[row["name"]][figure], (row["name"], figure)
    for figure in ("mse", "max_abs_error", "sqnr_db"):
        assert quantized["totals"][figure] == compared["totals"][figure], figure
    assert all(rows[row["name"]]["restored"] == row["dtype"] for row in done)
    assert quantized["totals"]["pooled_over"] == compared["totals"]["pooled_over"] == "quantized"
    assert quantized["measured"] == compared["measured"]


QTOOL_SPECS = {
    "int8": (),
    "int4-g32-mse": ("--dtype", "int4", "--group-size", "32", "--range", "mse"),
    "asym-uint8-tensor": ("--scheme", "asym", "--dtype", "uint8", "--per-tensor"),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tag", DTYPES)
@pytest.mark.parametrize("spec", QTOOL_SPECS, ids=QTOOL_SPECS.keys())
def test_quantize_and_compare_agree_qtool_format(
    invoke: Invoke, tmp_path: Path, kernel: str, tag: str, spec: str
) -> None:
    src, out = checkpoint(tmp_path, tag), tmp_path / "q.safetensors"
    _, quantized = run_json(invoke, "quantize", str(src), "-o", str(out), *QTOOL_SPECS[spec],
                            kernel=kernel)  # fmt: skip
    _, compared = run_json(invoke, "compare", str(src), str(out), kernel=kernel)
    assert_same_figures(quantized, compared)
    assert quantized["measured"] == f"as restored to {tag.upper().replace('FP', 'F')}"
    _, estimated = run_json(invoke, "quantize", str(src), "--dry-run", "--estimate",
                            *QTOOL_SPECS[spec], kernel=kernel)  # fmt: skip
    assert estimated["tensors"] == quantized["tensors"]


CT_SPECS = {
    "int8": (),
    "asym-int4-g32": ("--scheme", "asym", "--dtype", "int4", "--group-size", "32"),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tag", DTYPES)
@pytest.mark.parametrize("spec", CT_SPECS, ids=CT_SPECS.keys())
def test_quantize_and_compare_agree_compressed_tensors(
    invoke: Invoke, tmp_path: Path, kernel: str, tag: str, spec: str
) -> None:
    src, out = llama(tmp_path, tag), tmp_path / "ct"
    args = ("--format", "compressed-tensors", *CT_SPECS[spec])
    _, quantized = run_json(invoke, "quantize", str(src), "-o", str(out), *args, kernel=kernel)
    _, compared = run_json(invoke, "compare", str(src / "model.safetensors"), str(out),
                           kernel=kernel)  # fmt: skip
    assert_same_figures(quantized, compared)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_error_budget_measures_what_compare_measures(
    invoke: Invoke, tmp_path: Path, kernel: str
) -> None:
    src, out = checkpoint(tmp_path, "bf16"), tmp_path / "b.safetensors"
    _, quantized = run_json(invoke, "quantize", str(src), "-o", str(out), "--target-sqnr", "30",
                            kernel=kernel)  # fmt: skip
    _, compared = run_json(invoke, "compare", str(src), str(out), kernel=kernel)
    assert_same_figures(quantized, compared)
    for row in quantized["tensors"]:  # the budget's verdict is the figure the row shows
        if row["quantized"]:
            assert row["sqnr_db"] >= 30


def test_a_sharded_pair_pools_to_the_same_digits(invoke: Invoke, tmp_path: Path) -> None:
    src = tmp_path / "sharded"
    shutil.copytree(SAMPLES / "sharded-mlp", src)
    index = src / "model.safetensors.index.json"
    _, quantized = run_json(invoke, "quantize", str(index), "-o", str(tmp_path / "out"))
    _, compared = run_json(invoke, "compare", str(index),
                           str(tmp_path / "out" / "model.safetensors.index.json"))  # fmt: skip
    assert_same_figures(quantized, compared)


# ---------------------------------------------------------------- the examples


def test_min_sqnr_gives_one_verdict_in_quantize_and_compare(invoke: Invoke, tmp_path: Path) -> None:
    src, out = SAMPLES / "mlp-bf16.safetensors", tmp_path / "mlpq.safetensors"
    gate = ("--min-sqnr", "44.5")
    code_q, quantized = run_json(invoke, "quantize", str(src), "-o", str(out), *gate)
    code_c, compared = run_json(invoke, "compare", str(src), str(out), *gate)
    assert code_q == code_c
    assert quantized["gate"]["passed"] == compared["gate"]["passed"]
    assert_same_figures(quantized, compared)


def test_min_overall_sqnr_gives_one_verdict(invoke: Invoke, tmp_path: Path) -> None:
    src, out = SAMPLES / "mlp.safetensors", tmp_path / "q.safetensors"
    code_q, quantized = run_json(invoke, "quantize", str(src), "-o", str(out))
    overall = quantized["totals"]["sqnr_db"]
    for bound in (overall - 0.05, overall + 0.05):
        gate = ("--min-overall-sqnr", f"{bound:.3f}")
        code_q, _ = run_json(invoke, "quantize", str(src), "--dry-run", "--estimate", *gate)
        code_c, compared = run_json(invoke, "compare", str(src), str(out), *gate)
        assert code_q == code_c == (0 if bound < overall else 3)
        assert compared["totals"]["pooled_over"] == "quantized"


def column(tmp_path: Path) -> Path:
    """The issue's 37x1 column of k * s (k = -127..127 step 7, then 127): exact codes."""
    s = torch.tensor(0.37 / 127, dtype=torch.float32)
    k = torch.cat([torch.arange(-127, 128, 7).float()[:36], torch.tensor([127.0])])
    path = tmp_path / "col37.safetensors"
    save_file({"col.weight": (k * s).float().reshape(37, 1)}, path)
    return path


def test_the_column_gets_one_verdict_with_both_kernels(invoke: Invoke, tmp_path: Path) -> None:
    src = column(tmp_path)
    kernel_names = ["torch", "fused"] if NUMBA else ["torch"]
    seen = []
    for kernel in kernel_names:
        out = tmp_path / f"col.{kernel}.safetensors"
        args = ("--axis", "1", "--max-mse", "5e-18")
        code, quantized = run_json(invoke, "quantize", str(src), "-o", str(out), *args,
                                   kernel=kernel)  # fmt: skip
        _, compared = run_json(invoke, "compare", str(src), str(out), "--max-mse", "5e-18")
        assert_same_figures(quantized, compared)
        seen.append((code, [r[f] for r in quantized["tensors"] for f in FIGURES]))
    assert all(s == seen[0] for s in seen)
    assert seen[0][0] == 0  # k * s restores exactly: no error


def test_plot_measures_the_tensor_as_restored(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    src = SAMPLES / "mlp-bf16.safetensors"
    drawn = plots.plot_tensor(src, "embed.weight", QSpec(), tmp_path / "p.png")
    x = load_file(src)["embed.weight"]
    result = kernels.quantize_tensor(x, QSpec(), with_errors=False)
    q, scale, zp = result.q, result.scale, result.zero_point
    want = error_stats(x, kernels.dequantize(q, scale, zp, QSpec(), dtype=x.dtype, shape=x.shape))
    assert drawn["sqnr_db"] == want.sqnr_db and drawn["mse"] == want.mse


# ---------------------------------------------------------------- what is pooled, and said


def test_compare_pools_the_quantized_tensors_unless_asked(invoke: Invoke, tmp_path: Path) -> None:
    src, out = SAMPLES / "mlp.safetensors", tmp_path / "q.safetensors"
    _, quantized = run_json(invoke, "quantize", str(src), "-o", str(out))
    _, compared = run_json(invoke, "compare", str(src), str(out))
    _, everything = run_json(invoke, "compare", str(src), str(out), "--pool", "all")
    assert compared["totals"]["sqnr_db"] == quantized["totals"]["sqnr_db"]
    assert everything["totals"]["pooled_over"] == "all"
    assert everything["totals"]["sqnr_db"] > compared["totals"]["sqnr_db"]  # kept: no error
    code, text, _ = invoke("compare", str(src), str(out))
    assert "overall SQNR" in text and "(quantized tensors)" in text
    assert "errors as restored to F32" in title(text)
    code, text, _ = invoke("quantize", str(src), "-o", str(out), "--force")
    assert "(quantized tensors)" in text and "errors as restored to F32" in title(text)


def title(text: str) -> str:
    """The table's title, its lines joined (a long title wraps within COLUMNS)."""
    return " ".join(text.split("\n\n")[0].split())


def test_float_pairs_pool_everything_and_say_so(invoke: Invoke, tmp_path: Path) -> None:
    src = SAMPLES / "mlp.safetensors"
    other = write_as(src, tmp_path / "h.safetensors", torch.float16, {})
    _, compared = run_json(invoke, "compare", str(src), str(other))
    assert compared["totals"]["pooled_over"] == "all" and compared["measured"] == "as stored"


# ---------------------------------------------------------------- --target-sqnr's options


def test_target_sqnr_warns_about_the_options_it_overrides(invoke: Invoke, tmp_path: Path) -> None:
    src = tmp_path / "m8.safetensors"
    shutil.copy(SAMPLES / "mlp.safetensors", src)
    code, _, err = invoke("quantize", str(src), "--target-sqnr", "30", "--scheme", "asym",
                          "--dtype", "uint4", "--range", "mse")  # fmt: skip
    assert code == 0
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert "--scheme, --dtype, --range ignored" in warnings[0]
    assert (tmp_path / "m8.quantized.safetensors").exists()
    assert not list(tmp_path.glob("*uint4*"))
    code, _, err = invoke("quantize", str(src), "--target-sqnr", "30", "--force")
    assert code == 0 and "ignored" not in err


def test_the_default_name_says_the_dtype_only_when_every_tensor_has_it(
    invoke: Invoke, tmp_path: Path
) -> None:
    src = tmp_path / "m.safetensors"
    shutil.copy(SAMPLES / "mlp.safetensors", src)
    assert invoke("quantize", str(src), "--dtype", "int4")[0] == 0
    assert (tmp_path / "m.int4.safetensors").exists()
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[rule]]\nmatch = "head.*"\ndtype = "int4"\n')
    assert invoke("quantize", str(src), "--recipe", str(recipe))[0] == 0
    assert (tmp_path / "m.quantized.safetensors").exists()


# ---------------------------------------------------------------- what loaders reconstruct


def ct_decompress(path: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of every quantized module (its compressors call
    quantization.lifecycle.forward.dequantize, as transformers does when it loads a model)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_quantizable_tensors

    doc = json.loads((path / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(doc)
    tensors = load_file(path / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for scheme in qc.config_groups.values():
        comp = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
        names = comp.compression_param_names(scheme)
        matched = list(match_quantizable_tensors(tensors, qc.ignore, scheme.targets, [names[0]]))
        for module, _ in matched:
            if f"{module}.weight_scale" not in tensors:
                continue
            local = {p: tensors.pop(f"{module}.{p}") for p in names if f"{module}.{p}" in tensors}
            out[f"{module}.weight"] = comp.decompress(local, scheme)["weight"]
    return out


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("tag", DTYPES)
def test_compressed_tensors_dequantizes_what_the_figures_measure(
    invoke: Invoke, tmp_path: Path, tag: str
) -> None:
    """compressed-tensors' dequantize (codes and zero point cast to the scale's dtype,
    subtracted, times the scale, all in that dtype) gives the very tensor qtool's reader
    restores and the figures measure, bf16 and fp16 included: the integer difference is exact
    in the scale's dtype and the product of two short significands is exact before its one
    rounding, which is the rounding of qtool's float32 product to that dtype."""
    pytest.importorskip("compressed_tensors")
    from qtool.formats.registry import open_reader

    src, out = llama(tmp_path, tag), tmp_path / "ct"
    for spec in CT_SPECS.values():
        shutil.rmtree(out, ignore_errors=True)
        args = ("-o", str(out), "--format", "compressed-tensors", *spec)
        assert invoke("quantize", str(src), *args)[0] == 0
        theirs = ct_decompress(out)
        reader = open_reader(out)
        try:
            assert theirs and set(theirs) <= set(reader.names)
            for name, weight in theirs.items():
                ours = reader.values(name)
                assert weight.dtype == ours.dtype == DTYPES[tag]
                assert torch.equal(weight, ours), name
        finally:
            reader.close()


@pytest.mark.skipif(not NUMBA, reason="no numba")
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_fused_codes_without_figures_for_rows_longer_than_a_chunk(spec: QSpec) -> None:
    """Without figures the fused row kernel still walks a long row chunk by chunk (it looped
    forever on the first chunk's end when only the figures moved it on)."""
    from qtool.numerics import fused

    x = torch.randn(3, 2 * metrics.CHUNK + 77, generator=torch.Generator().manual_seed(9))
    if not fused.supports(spec, x.ndim):
        return
    got = fused.quantize_tensor(x, spec, with_errors=False)
    want = kernels.quantize_tensor(x, spec, with_errors=False)
    assert got.errors is None and torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)


def test_a_gguf_output_is_measured_as_ggml_restores_it(invoke: Invoke, tmp_path: Path) -> None:
    """A GGUF type is dequantized to float32 by ggml: quantize says so (it said BF16, the input's
    dtype, while compare of the same pair said F32), and both pool to the same digits."""
    if not (SAMPLES / "tiny-llama.gguf").exists():
        pytest.skip("no GGUF sample")
    out = tmp_path / "q.gguf"
    args = ("--format", "gguf", "--dtype", "Q4_K", "-o", str(out))
    _, quantized = run_json(invoke, "quantize", str(SAMPLES / "tiny-llama.gguf"), *args)
    _, compared = run_json(invoke, "compare", str(SAMPLES / "tiny-llama"), str(out))
    assert quantized["measured"] == compared["measured"] == "as restored to F32"
    for figure in ("mse", "max_abs_error", "sqnr_db", "pooled_over"):
        assert quantized["totals"][figure] == compared["totals"][figure], figure
