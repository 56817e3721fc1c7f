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
from qtool.errors import InputError
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


def _gguf_tensor(path: Path, name: str) -> tuple[np.ndarray, str]:
    import gguf

    found = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return np.array(found.data), found.tensor_type.name


def test_gguf_blocks_are_ggmls_with_quant_weights_and_keys_as_llama_quantize(
    tmp_path: Path,
) -> None:
    """A GGUF output: each tensor's blocks are ggml's quantizer's given the entry's h as
    quant_weights (numerics/gguf, byte-identical to ggml's C code), and the file carries
    llama-quantize's quantize.imatrix.* keys, last, with its types."""
    from qtool.io.gguf_file import GGUFFile
    from qtool.numerics.gguf.tensor import quantize_tensor
    from qtool.spec import gguf_quantize_spec

    imatrix = _imatrix(tmp_path / "m.gguf")
    src = TINY_LM.parent / "tiny-llama.gguf"
    spec = gguf_quantize_spec("Q4_0")
    runs = {}
    for out, given in (("w.gguf", imatrix), ("p.gguf", None)):
        options = api.QuantizeOptions(spec, format=FormatName.GGUF, imatrix=given)
        runs[out] = api.quantize(src, tmp_path / out, options)
    raw, _ = _gguf_tensor(src, "blk.0.attn_q.weight")
    x = torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(64, 64)
    h = _h(imatrix, Q_PROJ)
    want = quantize_tensor(x, spec, quant_weights=h).q.numpy().reshape(-1)
    got, kind = _gguf_tensor(tmp_path / "w.gguf", "blk.0.attn_q.weight")
    assert kind == "Q4_0" and np.array_equal(got.reshape(-1), want)
    plain, _ = _gguf_tensor(tmp_path / "p.gguf", "blk.0.attn_q.weight")
    assert not np.array_equal(plain.reshape(-1), want)  # the weights mattered
    rows = {
        out: next(r for r in d.rows if r.name == "blk.0.attn_q.weight") for out, d in runs.items()
    }
    weighted = rows["w.gguf"].weighted  # measured on the blocks as ggml restores them
    assert weighted is not None and np.isfinite(weighted.sqnr_db)
    assert rows["p.gguf"].weighted is None
    with GGUFFile(tmp_path / "w.gguf") as f:
        meta = f.header.metadata
    keys = list(meta)
    assert keys[-4:] == [
        "quantize.imatrix.file",
        "quantize.imatrix.dataset",
        "quantize.imatrix.entries_count",
        "quantize.imatrix.chunks_count",
    ]
    assert meta["quantize.imatrix.file"].value == str(imatrix)
    assert meta["quantize.imatrix.dataset"].value == "some.txt"
    assert meta["quantize.imatrix.entries_count"].type.name == "UINT32"
    assert meta["quantize.imatrix.entries_count"].value == 14
    assert meta["quantize.imatrix.chunks_count"].value == 1


def test_provenance_keeps_qtool_calibrates_dataset_keys(tmp_path: Path) -> None:
    """A file from qtool calibrate records each text's SHA-256 and token count: the output's
    provenance keeps them (llama-imatrix's files: names only, as above)."""
    from qtool.formats.imatrix.provenance import SHA_KEY, TOKENS_KEY
    from qtool.gguf_types import ValueType
    from qtool.io.gguf_layout import GGUFValue

    plain = _imatrix(tmp_path / "plain.gguf")
    from qtool.formats.imatrix import read_imatrix

    sha = "ab" * 32
    extra = {
        SHA_KEY: GGUFValue(ValueType.ARRAY, (sha,), ValueType.STRING),
        TOKENS_KEY: GGUFValue(ValueType.ARRAY, np.array([4096], np.uint64), ValueType.UINT64),
    }
    path = tmp_path / "qtool.gguf"
    write_imatrix(path, read_imatrix(plain), extra)
    done = _quantize(tmp_path, "w", imatrix=path)
    assert done.imatrix is not None
    assert done.imatrix["datasets"] == [{"name": "some.txt", "sha256": sha, "tokens": 4096}]
