"""`quantize --imatrix`: the importance matrix matched to each quantized tensor (llama.cpp's
names or the checkpoint's), the weighted range search's codes in the output, the weighted SQNR
in the rows, the provenance in the summary and the output's metadata, and the refusals."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from qtool import api
from qtool.errors import InputError, UsageError
from qtool.formats.imatrix import write_imatrix
from qtool.formats.imatrix.naming import llama_names
from qtool.numerics import kernels
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from qtool.numerics.range_methods import ColumnWeights
from qtool.results import QuantizeSummary
from qtool.spec import FormatName, PerGroup, QSpec, RangeMethod, Scheme, StorageDtype

TINY_LM = Path(__file__).resolve().parents[2] / "sample_weights" / "tiny-lm"
SPEC = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32), RangeMethod.MSE)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _linears() -> dict[str, tuple[int, ...]]:
    with safe_open(TINY_LM / "model.safetensors", "pt") as f:
        return {
            k: tuple(f.get_slice(k).get_shape())
            for k in f.keys()  # noqa: SIM118 (safe_open has no __iter__)
            if k.startswith("model.layers.") and k.endswith("proj.weight")
        }


def _imatrix(path: Path, llama: bool = True, skip: str | None = None, width: int = 0) -> Path:
    """Random statistics (a few heavy columns) for tiny-lm's Linears, by llama.cpp's names or
    the checkpoint's; `skip` leaves one out, `width` gives q_proj the wrong input width."""
    shapes = _linears()
    names = llama_names("llama", 2, list(shapes)) if llama else {n: n for n in shapes}
    rng = np.random.default_rng(0)
    entries = {}
    for hf, shape in shapes.items():
        if hf == skip:
            continue
        k = width if (width and hf == Q_PROJ) else shape[1]
        sums = (rng.random((1, k), dtype=np.float32) ** 6 * 1000).astype(np.float32)
        entries[names[hf]] = MatrixStats(sums, np.array([100], dtype=np.int64))
    write_imatrix(path, ImportanceMatrix(entries, 512, 1, ("some.txt",)))
    return path


def _h(path: Path, name: str) -> torch.Tensor:
    from qtool.formats.imatrix import read_imatrix

    imatrix = read_imatrix(path)
    key = llama_names("llama", 2, [name]).get(name, name)
    stats = imatrix.entries.get(key) or imatrix.entries[name]
    return torch.from_numpy(np.array(stats.mean_squares()))


def _quantize(tmp_path: Path, out: str, **kw: object) -> QuantizeSummary:
    options = api.QuantizeOptions(SPEC, **kw)  # type: ignore[arg-type]
    return api.quantize(TINY_LM, tmp_path / out, options)


def _codes(out: Path, name: str) -> torch.Tensor:
    with safe_open(out / "model.safetensors", "pt") as f:
        codes: torch.Tensor = f.get_tensor(name)
    return codes


def test_codes_are_the_weighted_search_and_rows_carry_the_weighted_sqnr(tmp_path: Path) -> None:
    imatrix = _imatrix(tmp_path / "m.imatrix.gguf")
    done = _quantize(tmp_path, "w", imatrix=imatrix)
    with safe_open(TINY_LM / "model.safetensors", "pt") as f:
        x = f.get_tensor(Q_PROJ)
    want = kernels.quantize_tensor(x, SPEC, weights=ColumnWeights(_h(imatrix, Q_PROJ)))
    assert torch.equal(_codes(tmp_path / "w", Q_PROJ), want.q)
    plain = _quantize(tmp_path, "p")
    assert not torch.equal(_codes(tmp_path / "p", Q_PROJ), want.q)  # the weights mattered
    rows = {r.name: r for r in done.rows}
    assert all(rows[n].weighted is not None for n in _linears())
    assert rows["model.layers.0.input_layernorm.weight"].weighted is None
    # the weighted search buys weighted SQNR, pooled over the tensors
    before = {r.name: r for r in plain.rows}
    assert before[Q_PROJ].weighted is None and plain.weighted_overall is None
    assert done.weighted_overall is not None
    row = rows[Q_PROJ]
    assert row.weighted is not None and np.isfinite(row.weighted.sqnr_db)
    # provenance: the file's SHA-256, its datasets, entries and chunks
    assert done.imatrix is not None
    assert done.imatrix["sha256"] == hashlib.sha256(imatrix.read_bytes()).hexdigest()
    assert done.imatrix["entries_count"] == 14 and done.imatrix["chunk_size"] == 512
    assert done.imatrix["datasets"] == [{"name": "some.txt", "sha256": None, "tokens": None}]
    assert done.notes == [] or not any("no entry" in n for n in done.notes)


def test_weighted_sqnr_is_the_definition(tmp_path: Path) -> None:
    """10 log10(sum h w^2 / sum h (w - w^)^2) with w^ restored in the input's dtype."""
    imatrix = _imatrix(tmp_path / "m.imatrix.gguf")
    done = _quantize(tmp_path, "w", imatrix=imatrix)
    with safe_open(TINY_LM / "model.safetensors", "pt") as f:
        x = f.get_tensor(Q_PROJ)
    h = _h(imatrix, Q_PROJ).double()
    q = kernels.quantize_tensor(x, SPEC, weights=ColumnWeights(_h(imatrix, Q_PROJ)))
    x_hat = kernels.dequantize(q.q, q.scale, q.zero_point, SPEC, x.dtype, tuple(x.shape))
    xd = x.double()
    want = 10 * np.log10(float((h * xd**2).sum()) / float((h * (xd - x_hat.double()) ** 2).sum()))
    row = next(r for r in done.rows if r.name == Q_PROJ)
    assert row.weighted is not None
    assert row.weighted.sqnr_db == pytest.approx(want, rel=1e-12)


def test_checkpoint_names_and_llama_names_give_the_same_codes(tmp_path: Path) -> None:
    _quantize(tmp_path, "a", imatrix=_imatrix(tmp_path / "a.gguf", llama=True))
    _quantize(tmp_path, "b", imatrix=_imatrix(tmp_path / "b.gguf", llama=False))
    for name in _linears():
        assert torch.equal(_codes(tmp_path / "a", name), _codes(tmp_path / "b", name))


def test_a_tensor_without_an_entry_is_quantized_without_one_and_said_once(
    tmp_path: Path,
) -> None:
    imatrix = _imatrix(tmp_path / "m.gguf", skip=Q_PROJ)
    done = _quantize(tmp_path, "w", imatrix=imatrix)
    notes = [n for n in done.notes if "no entry" in n]
    assert notes == [
        f"1 of 14 quantized tensors have no entry in m.gguf and were quantized without it "
        f"(e.g. {Q_PROJ})"
    ]
    _quantize(tmp_path, "p")
    assert torch.equal(_codes(tmp_path / "w", Q_PROJ), _codes(tmp_path / "p", Q_PROJ))
    assert next(r for r in done.rows if r.name == Q_PROJ).weighted is None


def test_an_entry_of_another_width_is_refused_naming_both(tmp_path: Path) -> None:
    imatrix = _imatrix(tmp_path / "m.gguf", width=48)
    with pytest.raises(InputError) as caught:
        _quantize(tmp_path, "w", imatrix=imatrix)
    message = str(caught.value)
    assert "m.gguf" in message and Q_PROJ in message
    assert "48 input columns" in message and "takes 64" in message
    assert not (tmp_path / "w").exists()


def test_an_imatrix_of_another_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    stats = MatrixStats(np.ones((1, 8), np.float32), np.array([1], dtype=np.int64))
    write_imatrix(path, ImportanceMatrix({"blk.0.ffn_up.weight.x": stats}, 512, 1))
    with pytest.raises(InputError, match="names none of the input's tensors"):
        _quantize(tmp_path, "w", imatrix=path)


def test_provenance_in_the_outputs_metadata(tmp_path: Path) -> None:
    """compressed-tensors: config.json's quantization_config.qtool.imatrix; qtool's format:
    the sidecar's qtool.imatrix key."""
    imatrix = _imatrix(tmp_path / "m.gguf")
    sha = hashlib.sha256(imatrix.read_bytes()).hexdigest()
    options = api.QuantizeOptions(SPEC, format=FormatName.COMPRESSED_TENSORS, imatrix=imatrix)
    api.quantize(TINY_LM, tmp_path / "ct", options)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert config["quantization_config"]["qtool"]["imatrix"]["sha256"] == sha
    _quantize(tmp_path, "q", imatrix=imatrix)
    sidecar = next((tmp_path / "q").glob("*.qparams.safetensors"))
    with safe_open(sidecar, "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["qtool.imatrix"])["sha256"] == sha


def test_gguf_types_refuse_an_imatrix(tmp_path: Path) -> None:
    """Until the GGUF kernels take quant_weights, a GGUF output refuses it (not ignored)."""
    from qtool.spec import gguf_quantize_spec

    imatrix = _imatrix(tmp_path / "m.gguf")
    src = TINY_LM.parent / "tiny-llama.gguf"
    options = api.QuantizeOptions(
        gguf_quantize_spec("Q8_0"), format=FormatName.GGUF, imatrix=imatrix
    )
    with pytest.raises(UsageError, match="GGUF types do not take an importance matrix yet"):
        api.quantize(src, tmp_path / "o.gguf", options)
    assert not (tmp_path / "o.gguf").exists()
