"""`calibrate` on mixture-of-experts checkpoints (tiny Mixtral, Qwen2-MoE with its shared
expert, Qwen3-MoE; one Linear per expert on disk) against a reference written with plain
PyTorch loops: the whole float model loaded by transformers, the input of each block's MoE
layer caught by a hook, the routing recomputed from the router's weight (softmax, top-k), and
each expert's Linears read from the checkpoint file as stored. Expert e's row sums the squared
rows routed to it (gate and up: the normed hidden states; down: silu(gate) * up of those rows),
its count is the number of routings to it, under llama.cpp's names (blk.N.ffn_{gate,up,down}
_exps.weight, [n_expert, n_in]); the router and the shared expert are ordinary entries. The
file is then read back for `quantize --imatrix` on the same checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import transformers  # noqa: E402

from qtool.engine.calibrate.data import take_windows  # noqa: E402
from qtool.engine.calibrate.run import CalibrateOptions, calibrate  # noqa: E402
from qtool.engine.model import hf  # noqa: E402
from qtool.engine.model.text import read_text  # noqa: E402
from qtool.formats.imatrix import read_imatrix  # noqa: E402
from qtool.formats.imatrix.naming import IMATRIX_ARCHS, llama_names  # noqa: E402
from tests.moe_models import (  # noqa: E402
    EXPERTS,
    KINDS,
    ORACLE_CHUNKS,
    ORACLE_CTX,
    ORACLE_TEXT,
    build_moe,
)

CTX = 32
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma. Delta{i}: epsilon {i % 5}!" for i in range(60))
# (gate, up, down) of expert e in each kind's checkpoint, under the block's MoE module
LINEARS = {
    "mixtral": ("block_sparse_moe", "experts.{e}.w1", "experts.{e}.w3", "experts.{e}.w2"),
    "qwen2_moe": ("mlp", "experts.{e}.gate_proj", "experts.{e}.up_proj", "experts.{e}.down_proj"),
    "qwen3_moe": ("mlp", "experts.{e}.gate_proj", "experts.{e}.up_proj", "experts.{e}.down_proj"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    (root / "t.txt").write_text(TEXT)
    return {kind: build_moe(root / kind, kind) for kind in KINDS}


def _stored(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k).float() for k in f.keys()}  # noqa: SIM118


def _squares(x: torch.Tensor) -> np.ndarray:
    return x.double().square().sum(dim=0).numpy()


def _reference(model_dir: Path, kind: str, text: Path, tokens: int) -> dict[str, Any]:
    """(sums [n_mat, K] float64, counts [n_mat]) by checkpoint-style name: every Linear of the
    blocks by a plain hook; the router over the MoE layer's input rows; the experts by loops
    over the routing recomputed from the stored router weight and the stored expert Linears."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = hf.tokenizer(model_dir, "the model", config)
    sources = take_windows([read_text(text)], tokenizer, tokens, CTX)
    stored = _stored(model_dir)
    moe, gate, up, down = LINEARS[kind]
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name: str) -> Any:
        return lambda _m, args, *_: seen.setdefault(name, []).append(args[0].detach().reshape(
            -1, args[0].shape[-1]))  # fmt: skip

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.mlp.register_forward_pre_hook(keep(f"model.layers.{i}.{moe}")))
        for name, m in layer.named_modules():
            if isinstance(m, torch.nn.Linear):
                handles.append(m.register_forward_pre_hook(keep(f"model.layers.{i}.{name}")))
    with torch.no_grad():
        for window in sources[0].windows:
            model(input_ids=torch.tensor([window]))
    for h in handles:
        h.remove()
    out: dict[str, Any] = {}
    top_k = config.num_experts_per_tok
    for name, xs in seen.items():
        x = torch.cat(xs)
        if not name.endswith(moe):
            out[f"{name}.weight"] = (_squares(x)[None], [x.shape[0]])
            continue
        out[f"{name}.gate.weight"] = (_squares(x)[None], [x.shape[0]])
        router = stored[f"{name}.gate.weight"]
        chosen = torch.topk(torch.softmax(x @ router.T, dim=-1), top_k, dim=-1).indices
        rows: dict[str, list[np.ndarray]] = {"gate": [], "up": [], "down": []}
        counts = []
        for e in range(EXPERTS):
            mine = x[(chosen == e).any(dim=-1)]
            w1, w3, w2 = (stored[f"{name}.{p.format(e=e)}.weight"] for p in (gate, up, down))
            act = torch.nn.functional.silu(mine @ w1.T) * (mine @ w3.T)
            assert act.shape[1] == w2.shape[1]
            rows["gate"].append(_squares(mine))
            rows["up"].append(_squares(mine))
            rows["down"].append(_squares(act))
            counts.append(mine.shape[0])
        for part in rows:
            out[f"{name}.experts.{part}"] = (np.stack(rows[part]), counts)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_experts_routed_rows_and_counts_equal_the_reference(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    text = models[kind].parent / "t.txt"
    out = tmp_path / "moe.imatrix.gguf"
    calibrate(models[kind], out, CalibrateOptions((text,), tokens=8 * CTX, ctx=CTX))
    got = read_imatrix(out)
    want = _reference(models[kind], kind, text, 8 * CTX)
    moe = LINEARS[kind][0]
    arch = IMATRIX_ARCHS[kind]
    dense = llama_names(arch, 2, [n for n in want if ".experts." not in n])
    for block in range(2):
        for part in ("gate", "up", "down"):
            dense[f"model.layers.{block}.{moe}.experts.{part}"] = (
                f"blk.{block}.ffn_{part}_exps.weight"
            )
    assert set(got.entries) == set(dense.values())
    routed = 0
    for name, (sums, counts) in want.items():
        stats = got.entries[dense[name]]
        assert stats.counts.tolist() == counts, name
        np.testing.assert_allclose(stats.sums, sums, rtol=2e-5, atol=1e-5, err_msg=name)
        if ".experts." in name:
            assert stats.sums.shape == (EXPERTS, sums.shape[1])
            routed += sum(counts)
    # top-2 of 4 experts: every token is routed twice, to each of gate, up and down, per block
    assert routed == 2 * 3 * 2 * 8 * CTX


def test_one_block_at_a_time_and_merges_add_per_expert(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stacked experts are loaded with their block only (a spy on the probe each block
    opens: what of the whole model is real then); two runs over halves of the windows merge
    into the run over all of them, expert by expert."""
    from qtool.engine.calibrate import run as calibrate_run
    from qtool.engine.calibrate import sequential as block_pass
    from qtool.engine.calibrate.run import merge_files
    from qtool.engine.imatrix_hooks import ImatrixProbe

    seen: list[set[str]] = []
    whole: list[Any] = []

    def run_blocks(model: Any, *args: Any) -> Any:
        whole.append(model)
        return block_pass.run_blocks(model, *args)

    class Spy(ImatrixProbe):
        def __init__(self, block: Any) -> None:
            super().__init__(block)
            seen.append({n for n, p in whole[0].named_parameters() if not p.is_meta})

    monkeypatch.setattr(calibrate_run, "run_blocks", run_blocks)
    monkeypatch.setattr(block_pass, "ImatrixProbe", Spy)
    model = models["mixtral"]
    half = tmp_path / "half.txt"
    half.write_text(TEXT[: len(TEXT) // 2])
    other = tmp_path / "other.txt"
    other.write_text(TEXT[len(TEXT) // 2 :])
    one, two, both = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "ab.gguf"
    calibrate(model, one, CalibrateOptions((half,), tokens=4 * CTX, ctx=CTX))
    for index, real in enumerate(seen[:2]):
        assert {n.split(".")[2] for n in real if n.startswith("model.layers.")} == {str(index)}
        assert f"model.layers.{index}.mlp.experts.gate_up_proj" in real
    calibrate(model, two, CalibrateOptions((other,), tokens=4 * CTX, ctx=CTX))
    calibrate(model, both, CalibrateOptions((half, other), tokens=8 * CTX, ctx=CTX))
    merge_files([one, two], tmp_path / "m.gguf", force=False)
    got, want = read_imatrix(tmp_path / "m.gguf"), read_imatrix(both)
    assert sorted(got.entries) == sorted(want.entries)
    for name, stats in got.entries.items():
        assert stats.counts.tolist() == want.entries[name].counts.tolist(), name
        np.testing.assert_allclose(stats.sums, want.entries[name].sums, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_quantize_reads_calibrates_file_for_the_same_checkpoint(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    from qtool import api
    from qtool.spec import PerGroup, QSpec, RangeMethod, Scheme, StorageDtype

    text = models[kind].parent / "t.txt"
    imatrix = tmp_path / "moe.imatrix.gguf"
    calibrate(models[kind], imatrix, CalibrateOptions((text,), tokens=4 * CTX, ctx=CTX))
    spec = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32), RangeMethod.MSE)
    done = api.quantize(models[kind], tmp_path / "q", api.QuantizeOptions(spec, imatrix=imatrix))
    assert not any("no entry" in n or "not used" in n for n in done.notes), done.notes
    experts = [r for r in done.rows if ".experts." in r.name]
    assert len(experts) == 2 * 3 * EXPERTS
    assert all(r.weighted is not None for r in experts)


LLAMA_FILE = Path(__file__).resolve().parents[1] / "data" / "tiny_mixtral_llama_imatrix.gguf"
"""llama-imatrix's own file for tests/moe_models.py's tiny Mixtral (seed 0), recorded by
scripts/moe_imatrix_oracle.py: the model converted by llama.cpp's convert_hf_to_gguf.py to F32,
llama-imatrix -c 32 -b 32 --chunks 8 -ctk f32 -ctv f32 -fa off over the script's text (the
same 256 token ids as the model's tokenizer gives; llama.cpp source of llama-cpp-python
0.3.36). The weights come from torch's seeded initialisation: another torch may draw others."""


def test_calibrate_equals_llama_imatrixs_recorded_file(tmp_path: Path) -> None:
    model = build_moe(tmp_path / "mixtral", "mixtral")
    text = tmp_path / "t.txt"
    text.write_text(ORACLE_TEXT)
    out = tmp_path / "qtool.imatrix.gguf"
    options = CalibrateOptions((text,), tokens=ORACLE_CTX * ORACLE_CHUNKS, ctx=ORACLE_CTX)
    calibrate(model, out, options)
    theirs, ours = read_imatrix(LLAMA_FILE), read_imatrix(out)
    assert sorted(theirs.entries) == sorted(ours.entries)
    assert theirs.entries["blk.1.ffn_down_exps.weight"].sums.shape == (EXPERTS, 96)
    for name, want in theirs.entries.items():
        got = ours.entries[name]
        assert got.counts.tolist() == want.counts.tolist(), name
        np.testing.assert_allclose(got.sums, want.sums, rtol=1e-5, err_msg=name)
    assert (theirs.chunk_size, theirs.chunk_count) == (ours.chunk_size, ours.chunk_count)


def test_quantize_weights_each_expert_by_llama_imatrixs_row(
    models: dict[str, Path], tmp_path: Path
) -> None:
    from qtool import api
    from qtool.numerics import kernels
    from qtool.numerics.range_methods import ColumnWeights
    from qtool.spec import PerGroup, QSpec, RangeMethod, Scheme, StorageDtype

    spec = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32), RangeMethod.MSE)
    model = models["mixtral"]
    done = api.quantize(model, tmp_path / "q", api.QuantizeOptions(spec, imatrix=LLAMA_FILE))
    assert not any("no entry" in n or "not used" in n for n in done.notes), done.notes
    stacked = read_imatrix(LLAMA_FILE).entries["blk.1.ffn_down_exps.weight"]
    h = stacked.mean_squares()
    stored = _stored(model)
    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:
        for e in range(EXPERTS):
            name = f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"
            x = stored[name].to(torch.bfloat16)
            want = kernels.quantize_tensor(
                x, spec, weights=ColumnWeights(torch.tensor(h[e : e + 1]))
            )
            assert torch.equal(f.get_tensor(name), want.q), name


def test_the_probes_chunk_count_is_the_busiest_experts(models: dict[str, Path]) -> None:
    """ImatrixProbe on the experts alone: chunk_count = the largest count // chunk_size (the
    busiest expert's, as llama-imatrix counts chunks), not expert 0's."""
    from qtool.engine.imatrix_hooks import ImatrixProbe

    model = transformers.AutoModelForCausalLM.from_pretrained(models["mixtral"])
    torch.manual_seed(0)
    ids = torch.randint(6, 200, (1, 256))
    with torch.no_grad(), ImatrixProbe(model, include=lambda n: n.endswith(".experts")) as probe:
        model(input_ids=ids)
    matrix = probe.imatrix(chunk_size=16)
    counts = matrix.entries["model.layers.0.mlp.experts.down_proj.weight"].counts
    top = max(int(s.counts.max()) for s in matrix.entries.values())
    assert counts.sum() == 2 * 256 and top > int(counts[0])
    assert matrix.chunk_count == top // 16


@pytest.mark.filterwarnings("always")  # shown as the CLI shows it, not raised by pytest
@pytest.mark.parametrize("kind", KINDS)
def test_experts_the_text_never_reached_are_named(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """One token goes to 2 of 4 experts per block: the others have count 0, and quantize weighs
    them 1.0 everywhere. calibrate was silent about it (llama-imatrix warns of 'partial data'); it
    now names each, once per block, in one line. A text that reaches every expert: no warning."""
    from tests.conftest import run_qtool

    text = models[kind].parent / "t.txt"
    out = tmp_path / "one.gguf"
    args = ("calibrate", str(models[kind]), "--text", str(text), "--threads", "1")
    rc, _, err = run_qtool(*args, "--tokens", "1", "--ctx", "1", "-o", str(out))
    assert rc == 0, err
    idle = {
        (name.split(".ffn_")[0], e)
        for name, s in read_imatrix(out).entries.items()
        if len(s.counts) > 1
        for e in np.flatnonzero(s.counts == 0).tolist()
    }
    assert len(idle) == 2 * 2  # two blocks, two experts each
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "never reached 4 of 8 experts" in lines[0], err
    for block in {b for b, _ in idle}:
        experts = ", ".join(str(e) for b, e in sorted(idle) if b == block)
        assert f"{block} experts {experts}" in lines[0], (block, experts, err)
    rc, _, err = run_qtool(*args, "--tokens", str(4 * CTX), "--ctx", str(CTX),
                           "-o", str(tmp_path / "all.gguf"))  # fmt: skip
    assert rc == 0 and "never reached" not in err, err
