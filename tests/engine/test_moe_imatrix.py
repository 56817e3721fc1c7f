"""`quantize HF_MOE_DIR --imatrix FILE` on a checkpoint storing one Linear per expert: each
expert's Linear is weighted by its own row of the stacked entry llama.cpp keys the experts under
(`blk.N.ffn_{gate,up,down}_exps.weight`, [n_expert, n_in] sums and n_expert counts), as
llama-quantize weights expert e's rows of the merged GGUF tensor; the router and Qwen2-MoE's
shared expert are ordinary entries. Tiny Mixtral and Qwen2-MoE built offline
(tests/moe_models.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from qtool import api  # noqa: E402
from qtool.formats.imatrix import write_imatrix  # noqa: E402
from qtool.formats.imatrix.naming import IMATRIX_ARCHS, llama_names  # noqa: E402
from qtool.numerics import kernels  # noqa: E402
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats  # noqa: E402
from qtool.numerics.range_methods import ColumnWeights  # noqa: E402
from qtool.results import QuantizeSummary  # noqa: E402
from qtool.spec import PerGroup, QSpec, RangeMethod, Scheme, StorageDtype  # noqa: E402
from tests.moe_models import EXPERTS, build_moe  # noqa: E402

SPEC = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32), RangeMethod.MSE)
# checkpoint name of expert E's Linear of block B (by kind) -> llama.cpp's stacked entry
EXPERT_LINEARS = {
    "mixtral": {"block_sparse_moe.experts.{e}.w1": "ffn_gate_exps",
                "block_sparse_moe.experts.{e}.w3": "ffn_up_exps",
                "block_sparse_moe.experts.{e}.w2": "ffn_down_exps"},
    "qwen2_moe": {"mlp.experts.{e}.gate_proj": "ffn_gate_exps",
                  "mlp.experts.{e}.up_proj": "ffn_up_exps",
                  "mlp.experts.{e}.down_proj": "ffn_down_exps"},
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {kind: build_moe(root / kind, kind) for kind in EXPERT_LINEARS}


def shapes(model: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(model / "model.safetensors", "pt") as f:
        return {
            k: tuple(f.get_slice(k).get_shape())
            for k in f.keys()  # noqa: SIM118 (safe_open has no __iter__)
            if k.startswith("model.layers.") and len(f.get_slice(k).get_shape()) == 2
        }


def stacked_imatrix(
    model: Path, kind: str, path: Path, counts: list[int] | None = None, experts: int = EXPERTS
) -> Path:
    """Random statistics (a few heavy columns, different per expert) under llama.cpp's names:
    one [experts, n_in] entry per stacked weight with `counts` (one per expert), one [1, n_in]
    entry per other Linear of the blocks (the router, attention, the shared expert)."""
    counts = counts or [100, 50, 30, 7]
    rng = np.random.default_rng(1)
    all_shapes = shapes(model)
    dense = llama_names(IMATRIX_ARCHS[kind], 2, list(all_shapes))
    entries: dict[str, MatrixStats] = {}
    for hf, shape in all_shapes.items():
        if ".experts." in hf and ".shared_expert" not in hf:
            continue
        sums = (rng.random((1, shape[1]), dtype=np.float32) ** 6 * 1000).astype(np.float32)
        entries[dense[hf]] = MatrixStats(sums, np.array([100], np.int64))
    for block in range(2):
        for local, stacked in EXPERT_LINEARS[kind].items():
            k = all_shapes[f"model.layers.{block}.{local.format(e=0)}.weight"][1]
            sums = (rng.random((experts, k), dtype=np.float32) ** 6 * 1000).astype(np.float32)
            sums[np.array(counts[:experts]) == 0] = 0
            entries[f"blk.{block}.{stacked}.weight"] = MatrixStats(
                sums, np.array(counts[:experts], np.int64)
            )
    write_imatrix(path, ImportanceMatrix(entries, 512, 1, ("some.txt",)))
    return path


def quantize(model: Path, out: Path, imatrix: Path | None) -> QuantizeSummary:
    return api.quantize(model, out, api.QuantizeOptions(SPEC, imatrix=imatrix))


def codes(out: Path, name: str) -> torch.Tensor:
    with safe_open(out / "model.safetensors", "pt") as f:
        found: torch.Tensor = f.get_tensor(name)
    return found


def weight(model: Path, name: str) -> torch.Tensor:
    with safe_open(model / "model.safetensors", "pt") as f:
        found: torch.Tensor = f.get_tensor(name)
    return found


def expert_h(imatrix: Path, entry: str) -> np.ndarray:
    from qtool.formats.imatrix import read_imatrix

    return np.array(read_imatrix(imatrix).entries[entry].mean_squares())


@pytest.mark.parametrize("kind", list(EXPERT_LINEARS))
def test_each_expert_is_weighted_by_its_own_row(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    model = models[kind]
    imatrix = stacked_imatrix(model, kind, tmp_path / "m.imatrix.gguf")
    done = quantize(model, tmp_path / "w", imatrix)
    assert not any("no entry" in n for n in done.notes), done.notes
    assert not any("not used" in n for n in done.notes), done.notes
    rows = {r.name: r for r in done.rows}
    another_row_differs = 0
    for block in range(2):
        for local, stacked in EXPERT_LINEARS[kind].items():
            h = expert_h(imatrix, f"blk.{block}.{stacked}.weight")
            for e in range(EXPERTS):
                name = f"model.layers.{block}.{local.format(e=e)}.weight"
                x = weight(model, name)
                mine = ColumnWeights(torch.tensor(h[e : e + 1]))
                want = kernels.quantize_tensor(x, SPEC, weights=mine)
                got = codes(tmp_path / "w", name)
                assert torch.equal(got, want.q), name
                assert rows[name].weighted is not None
                other = h[(e + 1) % EXPERTS][None]
                wrong = kernels.quantize_tensor(x, SPEC, weights=ColumnWeights(torch.tensor(other)))
                another_row_differs += not torch.equal(got, wrong.q)
    assert another_row_differs > 0  # the row taken is the one that decides the codes
    # the router (and Qwen2-MoE's shared expert) are ordinary entries
    router = next(n for n in rows if n.endswith(".0.block_sparse_moe.gate.weight")
                  or n.endswith(".0.mlp.gate.weight"))  # fmt: skip
    assert rows[router].weighted is not None
    if kind == "qwen2_moe":
        assert rows["model.layers.0.mlp.shared_expert.down_proj.weight"].weighted is not None
        assert rows["model.layers.0.mlp.shared_expert_gate.weight"].weighted is not None


def test_one_count_over_every_experts_columns_is_cut_per_expert(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """An entry of one count over n_expert x n_in sums (a legacy .dat's shape, or a GGUF written
    before llama-imatrix counted experts apart) is cut into n_expert rows of that count, as
    llama-quantize slices it flat."""
    model = models["mixtral"]
    per_expert = stacked_imatrix(model, "mixtral", tmp_path / "a.gguf", counts=[100] * EXPERTS)
    from qtool.formats.imatrix import read_imatrix

    read = read_imatrix(per_expert)
    flat = {
        name: MatrixStats(s.sums.reshape(1, -1).copy(), s.counts[:1].copy())
        if name.endswith("_exps.weight") else s
        for name, s in read.entries.items()
    }  # fmt: skip
    one_count = tmp_path / "b.gguf"
    write_imatrix(one_count, ImportanceMatrix(flat, 512, 1))
    quantize(model, tmp_path / "a", per_expert)
    quantize(model, tmp_path / "b", one_count)
    quantize(model, tmp_path / "plain", None)
    unweighted = 0
    for e in range(EXPERTS):
        name = f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"
        assert torch.equal(codes(tmp_path / "a", name), codes(tmp_path / "b", name))
        unweighted += torch.equal(codes(tmp_path / "b", name), codes(tmp_path / "plain", name))
    assert unweighted < EXPERTS


def test_merge_adds_sums_and_counts_per_expert(models: dict[str, Path], tmp_path: Path) -> None:
    """calibrate --merge on stacked entries: expert e's sums and count are the sum of the
    files' row e (llama-imatrix --in-file adds them so), round-tripped through the GGUF."""
    from qtool.engine.calibrate.run import merge_files
    from qtool.formats.imatrix import read_imatrix

    model = models["mixtral"]
    a = stacked_imatrix(model, "mixtral", tmp_path / "a.gguf", counts=[100, 0, 30, 7])
    b = stacked_imatrix(model, "mixtral", tmp_path / "b.gguf", counts=[1, 2, 0, 4])
    merge_files([a, b], tmp_path / "c.gguf", force=False)
    got, ra, rb = (read_imatrix(p) for p in (tmp_path / "c.gguf", a, b))
    entry = "blk.1.ffn_down_exps.weight"
    assert got.entries[entry].counts.tolist() == [101, 2, 30, 11]
    np.testing.assert_array_equal(
        got.entries[entry].sums, ra.entries[entry].sums + rb.entries[entry].sums
    )
    assert got.entries[entry].sums.shape == (EXPERTS, 96)


def test_gate_and_up_fused_take_row_e_of_the_fused_entry(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """An imatrix of a GGUF converted with --fuse-gate-up-exps keys gate and up of every expert
    under blk.N.ffn_gate_up_exps.weight (one input for both): expert e's gate and up are
    weighted by its row e, as by separate entries holding that row; an entry name of the
    converter's that qtool did not map left them unweighted."""
    from qtool.formats.imatrix import read_imatrix

    model = models["mixtral"]
    read = read_imatrix(stacked_imatrix(model, "mixtral", tmp_path / "a.gguf")).entries
    separate, fused = dict(read), dict(read)
    for block in range(2):
        gate, up = (f"blk.{block}.ffn_{k}_exps.weight" for k in ("gate", "up"))
        separate[up] = read[gate]  # one input: llama-imatrix sums the same rows for both
        fused[f"blk.{block}.ffn_gate_up_exps.weight"] = fused.pop(gate)
        del fused[up]
    for name, entries in (("separate", separate), ("fused", fused)):
        write_imatrix(tmp_path / f"{name}.gguf", ImportanceMatrix(entries, 512, 1))
    done = quantize(model, tmp_path / "fused", tmp_path / "fused.gguf")
    assert not any("not used" in n or "no entry" in n for n in done.notes), done.notes
    quantize(model, tmp_path / "separate", tmp_path / "separate.gguf")
    quantize(model, tmp_path / "plain", None)
    unweighted = 0
    for block in range(2):
        for e in range(EXPERTS):
            for w in ("w1", "w3"):
                name = f"model.layers.{block}.block_sparse_moe.experts.{e}.{w}.weight"
                got = codes(tmp_path / "fused", name)
                assert torch.equal(got, codes(tmp_path / "separate", name)), name
                unweighted += torch.equal(got, codes(tmp_path / "plain", name))
    assert unweighted < 2 * 2 * EXPERTS
