"""Hostile mixture-of-experts entries, read for a checkpoint storing one Linear per expert:
an entry holding another number of experts than the model has is refused naming the file, the
entry and the expert's tensor (llama-quantize refuses an entry whose size is not the tensor's:
"imatrix size ... is different from tensor size"); an expert the calibration text never routed
to (count 0, sums 0) is weighted 1.0 on every column, as llama-quantize's imatrix loader gives
it (tools/quantize/quantize.cpp: `e[j*ne0 + i] = 1` for a count of 0), not refused as weightless
and not left without weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from qtool.numerics import kernels  # noqa: E402
from qtool.numerics.range_methods import ColumnWeights  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.engine.test_moe_imatrix import (  # noqa: E402
    SPEC,
    codes,
    quantize,
    stacked_imatrix,
    weight,
)
from tests.moe_models import EXPERTS, build_moe  # noqa: E402


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe(tmp_path_factory.mktemp("moe") / "mixtral", "mixtral")


def test_an_entry_of_another_expert_count_is_refused(
    mixtral: Path, tmp_path: Path, invoke: Invoke
) -> None:
    imatrix = stacked_imatrix(mixtral, "mixtral", tmp_path / "three.gguf", experts=EXPERTS - 1)
    code, out, err = invoke(
        "quantize", str(mixtral), "--dtype", "int4", "--range", "mse",
        "--imatrix", str(imatrix), "-o", str(tmp_path / "q"),
    )  # fmt: skip
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"qtool: error: {imatrix}: tensor 'model.layers."), err
    assert "_exps.weight holds statistics for 3 experts" in err, err
    assert "the model has 4 experts" in err, err
    assert not (tmp_path / "q").exists()


def test_an_expert_never_routed_to_is_weighted_one_everywhere(
    mixtral: Path, tmp_path: Path
) -> None:
    imatrix = stacked_imatrix(mixtral, "mixtral", tmp_path / "z.gguf", counts=[100, 0, 30, 7])
    done = quantize(mixtral, tmp_path / "w", imatrix)
    name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    x = weight(mixtral, name)
    ones = ColumnWeights(torch.ones(1, x.shape[1]))
    want = kernels.quantize_tensor(x, SPEC, weights=ones)
    assert torch.equal(codes(tmp_path / "w", name), want.q)
    row = next(r for r in done.rows if r.name == name)
    assert row.weighted is not None  # weighted (by ones), not quantized without an entry


@pytest.mark.parametrize(("count", "in_file"), [(5, 4), (3, 3), (0, 4), (1_000_000_000, 4),
                                                ("4", 4)])  # fmt: skip
def test_a_config_expert_count_the_checkpoint_does_not_store_is_blamed_on_config_json(
    mixtral: Path, tmp_path: Path, invoke: Invoke, count: object, in_file: int
) -> None:
    """config.json's num_local_experts is checked against the experts the checkpoint stores
    before any entry is cut by it: a wrong count was reported as the imatrix's fault ('the
    model has 5 experts; give the imatrix computed on this model'), 0 was ignored."""
    model = tmp_path / "m"
    shutil.copytree(mixtral, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"num_local_experts": count}))
    imatrix = stacked_imatrix(mixtral, "mixtral", tmp_path / "i.gguf", experts=in_file)
    code, out, err = invoke(
        "quantize", str(model), "--dtype", "int4", "--range", "mse",
        "--imatrix", str(imatrix), "-o", str(tmp_path / "q"),
    )  # fmt: skip
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"qtool: error: {model / 'config.json'}: num_local_experts is"), err
    assert "the checkpoint stores 4 experts" in err and "fix the count in config.json" in err
    assert not (tmp_path / "q").exists()


def test_a_one_count_entry_cut_into_experts_is_reported_as_the_file_holds_it(
    mixtral: Path, tmp_path: Path, invoke: Invoke
) -> None:
    """An experts entry of one matrix and one count (a dense model's [1, 64] under an _exps
    name) is cut into 4 rows as a legacy flat entry is; when that does not fit, the message
    says what the file holds and how it was read, not '16 input columns', which no file held."""
    from qtool.formats.imatrix import read_imatrix_file, write_imatrix
    from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats

    full = read_imatrix_file(stacked_imatrix(mixtral, "mixtral", tmp_path / "s.gguf")).imatrix
    entries = dict(full.entries)
    gate = entries["blk.0.ffn_gate_exps.weight"]
    entries["blk.0.ffn_gate_exps.weight"] = MatrixStats(gate.sums[:1], gate.counts[:1])
    flat = tmp_path / "flat.gguf"
    write_imatrix(flat, ImportanceMatrix(entries, full.chunk_size, full.chunk_count, ()))
    code, out, err = invoke(
        "quantize", str(mixtral), "--dtype", "int4", "--range", "mse",
        "--imatrix", str(flat), "-o", str(tmp_path / "q"),
    )  # fmt: skip
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert "blk.0.ffn_gate_exps.weight holds one matrix of 64 columns (one count)" in err, err
    assert "read as 4 experts of 16, but the tensor [96, 64] takes 64" in err, err
