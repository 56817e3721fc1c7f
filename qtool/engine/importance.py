"""`quantize --imatrix FILE`: an importance matrix matched to the tensors a run quantizes.

The file (llama-imatrix's GGUF or legacy .dat, or qtool calibrate's GGUF) is keyed by
llama.cpp's names (`blk.0.attn_q.weight`) or by the checkpoint's own: an entry whose name the
checkpoint holds is taken as it is; the others are mapped to the checkpoint's Hugging Face names
with gguf-py's map (formats/imatrix.hf_names_of: the architecture from config.json's
model_type, the block count from num_hidden_layers). For each quantized tensor of shape
[out, in] (or stacked experts [E, out, in]) its entry's h = sums / counts per input column
becomes the ColumnWeights the range search takes (numerics/range_methods.py). A checkpoint
storing each expert of a mixture-of-experts layer as its own Linear
(`block_sparse_moe.experts.3.w1.weight`, `mlp.experts.3.gate_proj.weight`) takes row 3 of the
stacked entry llama.cpp keys them under (`blk.N.ffn_gate_exps.weight`, one row and one count per
expert): what llama-quantize gives expert 3's rows of the merged GGUF tensor. A tensor with no
entry is quantized without one (one note for them all); an entry whose input width or matrix
count does not fit the tensor is refused naming both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qtool.calibrate_results import DatasetInfo
from qtool.engine.tied import embedding_or_head
from qtool.errors import InputError, QtoolError
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats, quant_weights
from qtool.results import WeightedError
from qtool.spec import Codec, PerChannel, PerGroup, QSpec

if TYPE_CHECKING:
    import torch

    from qtool.engine.decision import TensorPlan
    from qtool.io.checkpoint import Checkpoint
    from qtool.numerics.kernels import QuantizedTensor
    from qtool.numerics.range_methods import ColumnWeights

ERROR_SLAB_ELEMS = 1 << 20  # values per slab of the weighted error (float64 temporaries: 8 MiB)
_BLOCK_NUMBER = re.compile(r"(?:^|\.)(?:layers|h|blocks|blk)\.(\d+)\.")


@dataclass(frozen=True)
class Provenance:
    """What an output quantized with an imatrix records of it (llama-quantize's
    quantize.imatrix.* keys hold the same): the file, its SHA-256, its datasets (with qtool's
    SHA-256 and token counts where the file holds them), entries, chunks and chunk size."""

    file: str
    sha256: str
    datasets: tuple[DatasetInfo, ...]
    entries: int
    chunk_count: int
    chunk_size: int

    def as_dict(self) -> dict[str, object]:
        return {
            "file": self.file,
            "sha256": self.sha256,
            "datasets": [
                {"name": d.name, "sha256": d.sha256, "tokens": d.tokens} for d in self.datasets
            ],
            "entries_count": self.entries,
            "chunks_count": self.chunk_count,
            "chunk_size": self.chunk_size,
        }


@dataclass(frozen=True)
class Importance:
    """An importance matrix by checkpoint tensor name, with its provenance."""

    path: Path
    stats: Mapping[str, MatrixStats]
    provenance: Provenance
    unused: tuple[str, ...] = ()  # entries naming no tensor of the input (another model's blocks)
    entry_names: Mapping[str, str] | None = None  # checkpoint name -> the file's entry name
    llama: Mapping[str, str] | None = None  # checkpoint name -> llama.cpp's, every tensor mapped
    flat: Mapping[str, str] | None = None  # an expert's name -> its one-count entry, as it was cut

    def weights(self, name: str, shape: tuple[int, ...]) -> ColumnWeights | None:
        """The column weights of tensor `name` of `shape` (None: the file has no entry for it),
        as llama-quantize derives its quant_weights (numerics/imatrix.quant_weights)."""
        import torch

        from qtool.numerics.range_methods import ColumnWeights

        stats = self.stats.get(name)
        if stats is None:
            return None
        h = quant_weights(stats, *_width_and_matrices(shape))
        return ColumnWeights(torch.from_numpy(h), self.path.name)

    def check(self, plans: Iterable[TensorPlan]) -> list[str]:
        """InputError for an entry that does not fit its quantized tensor or weighs it all 0;
        the run's notes on the quantized tensors without an entry and the entries unused."""
        plans = list(plans)
        for plan in plans:
            stats = self.stats.get(plan.entry.name)
            if plan.spec is None or stats is None:
                continue
            problem = _misfit(stats, plan.entry.shape, (self.flat or {}).get(plan.entry.name))
            if problem is not None:
                raise InputError(self.path, problem, plan.entry.name)
            _refuse_weightless(self.path, plan.entry.name, stats)
        return self.notes(plans)

    def notes(self, plans: Iterable[TensorPlan]) -> list[str]:
        """The notes on the tensors `plans` quantize that have no entry, and the entries
        unused: given the final plans, as the check's plans may quantize a tensor that an
        allocation then keeps float (one without an alpha)."""
        missing: list[str] = []
        quantized = 0
        for plan in plans:
            if plan.spec is None:
                continue
            quantized += 1
            # llama.cpp's imatrix never has the embedding (a row lookup, no matmul) and may
            # lack the head (tied to it): their absence is every imatrix's, not a mismatch
            if plan.entry.name not in self.stats and not embedding_or_head(plan.entry.name):
                missing.append(plan.entry.name)
        notes = []
        if missing:
            notes.append(
                f"{len(missing)} of {quantized} quantized tensors have no entry in "
                f"{self.path.name} and were quantized without it (e.g. {missing[0]})"
            )
        if self.unused:
            notes.append(
                f"{len(self.unused)} of {self.provenance.entries} entries of {self.path.name} "
                "name no tensor of the input "
                f"and were not used (e.g. {self.unused[0]}); check it was computed on this model"
            )
        return notes


def read_importance(path: Path) -> tuple[ImportanceMatrix, Provenance]:
    """The imatrix at `path` and its provenance (InputError for a file that is not one), read
    through one descriptor: the SHA-256 is of the bytes parsed."""
    from qtool.formats.imatrix import read_imatrix_file
    from qtool.formats.imatrix.provenance import dataset_infos

    read = read_imatrix_file(path)
    imatrix = read.imatrix
    provenance = Provenance(
        str(path),
        read.sha256,
        dataset_infos(path, read.metadata, imatrix.datasets),
        len(imatrix.entries),
        imatrix.chunk_count,
        imatrix.chunk_size,
    )
    return imatrix, provenance


def match_importance(
    path: Path,
    read: tuple[ImportanceMatrix, Provenance],
    names: list[str],
    config: Mapping[str, object] | None,
    config_path: Path | None = None,
) -> Importance:
    """The imatrix `read` from `path` keyed by the checkpoint's tensor `names` (see the module
    doc), `config` read from `config_path`; InputError when it names none of them."""
    imatrix, provenance = read
    stats, used, flat = _by_checkpoint_name(path, imatrix, names, config, config_path)
    if not stats:
        first = next(iter(imatrix.entries))
        model_type = (config or {}).get("model_type")
        why = "give the imatrix computed on this model"
        if not isinstance(model_type, str):  # llama.cpp's names are mapped through config.json
            why = (
                "llama.cpp's names are matched through the model's config.json (model_type), "
                "which this input has none of: quantize the model's directory"
            )
        raise InputError(
            path, f"names none of the input's tensors (its first entry: {first}); {why}"
        )
    unused = tuple(n for n in imatrix.entries if n not in used)
    entry_of = {id(s): n for n, s in imatrix.entries.items()}
    # an expert's row is not its entry: the entry's sensitivity is the stacked weight's
    names_in_file = {name: entry_of[id(s)] for name, s in stats.items() if id(s) in entry_of}
    return Importance(path, stats, provenance, unused, names_in_file, _llama(names, config), flat)


def _llama(names: list[str], config: Mapping[str, object] | None) -> dict[str, str]:
    """llama.cpp's name of each of the checkpoint's `names` (calibrate's map), whether or not the
    file has an entry for it: sensitivities are keyed so for tensors the statistics never see
    (the embedding, the head). Empty without config.json or a name map for its architecture."""
    model_type = (config or {}).get("model_type")
    if not isinstance(model_type, str):
        return {}
    from qtool.formats.imatrix.naming import IMATRIX_ARCHS, llama_names

    try:
        return llama_names(IMATRIX_ARCHS.get(model_type, model_type), _block_count(config, names),
                           names)  # fmt: skip
    except (ValueError, KeyError, QtoolError):
        return {}


def _refuse_weightless(path: Path, name: str, stats: MatrixStats) -> None:
    """InputError for an entry one of whose matrices weighs every column 0 (sums all 0 over
    rows, or so small that the float32 mean underflows): ggml's quantizers would round that
    matrix to all zeros, and its weighted error would read as exact."""
    h = stats.mean_squares()
    empty = [e for e in range(h.shape[0]) if not np.any(h[e] > 0)]
    if not empty:
        return
    which = f"matrix {empty[0]} of {h.shape[0]}" if h.shape[0] > 1 else "every column"
    raise InputError(
        path, f"its entry weighs {which} 0 (sums 0, or too small for float32, over rows "
        "counted): the tensor would be rounded to zeros; re-create it with llama-imatrix or "
        "qtool calibrate on text that reaches this layer", name,
    )  # fmt: skip


def _by_checkpoint_name(
    path: Path,
    imatrix: ImportanceMatrix,
    names: list[str],
    config: Mapping[str, object] | None,
    config_path: Path | None = None,
) -> tuple[dict[str, MatrixStats], set[str], dict[str, str]]:
    """The entries by checkpoint name, and the imatrix names used; an entry under both its
    llama.cpp name and the checkpoint's is refused naming both (which one holds the statistics
    is not for qtool to guess)."""
    held = set(names)
    found = {n: s for n, s in imatrix.entries.items() if n in held}
    others = [n for n in imatrix.entries if n not in held]
    model_type = (config or {}).get("model_type")
    if not others or not isinstance(model_type, str):
        return found, set(found), {}  # no config.json: exact names only
    from qtool.formats.imatrix import hf_names_of
    from qtool.formats.imatrix.naming import IMATRIX_ARCHS, fused_expert_entry, llama_expert_names

    arch = IMATRIX_ARCHS.get(model_type, model_type)
    try:
        mapped = hf_names_of(imatrix, arch, _block_count(config, names), names)
        experts = llama_expert_names(
            arch, _block_count(config, names), [n for n in names if n not in found]
        )
    except (ValueError, KeyError, InputError):
        return found, set(found), {}  # no name map for this architecture: exact names only
    used = set(found)
    flat: dict[str, str] = {}
    for gguf_name, hf_name in mapped.items():
        if gguf_name not in others:
            continue
        if hf_name in found:
            raise InputError(
                path, f"holds entries {gguf_name} and {hf_name}, one tensor under llama.cpp's "
                "name and the checkpoint's: keep one (re-create it with llama-imatrix or qtool "
                "calibrate)", hf_name,
            )  # fmt: skip
        found[hf_name] = imatrix.entries[gguf_name]
        used.add(gguf_name)
    n_experts = _expert_counts(config, experts, config_path)
    for hf_name, (stacked_name, e) in experts.items():
        # gate and up fused (--fuse-gate-up-exps) when the file has no entry of their own
        fused = fused_expert_entry(stacked_name)
        gguf_name = fused if stacked_name not in imatrix.entries and fused else stacked_name
        stacked = imatrix.entries.get(gguf_name)
        if stacked is None or hf_name in found:
            continue
        n = n_experts[stacked_name]
        found[hf_name] = _expert_row(path, gguf_name, stacked, e, n, hf_name)
        used.add(gguf_name)
        if stacked.n_mat == 1 and n > 1:  # cut as a legacy flat entry: say so if it misfits
            flat[hf_name] = (
                f"{gguf_name} holds one matrix of {stacked.k} columns (one count), read as "
                f"{n} experts of {stacked.k // n}"
            )
    return found, used, flat


def _expert_counts(
    config: Mapping[str, object] | None,
    experts: Mapping[str, tuple[str, int]],
    config_path: Path | None,
) -> dict[str, int]:
    """The experts of each stacked weight: one more than the largest index the checkpoint
    stores, which config.json's num_local_experts (Mixtral) or num_experts (Qwen MoE), where
    it has one, must equal: InputError naming config.json otherwise (a wrong count was blamed
    on the imatrix, or 0 ignored)."""
    out: dict[str, int] = {}
    for gguf_name, e in experts.values():
        out[gguf_name] = max(out.get(gguf_name, 0), e + 1)
    key = next((k for k in ("num_local_experts", "num_experts") if k in (config or {})), None)
    if key is None or not out:
        return out
    value = (config or {})[key]
    whole = isinstance(value, int) and not isinstance(value, bool)
    wrong = [(g, n) for g, n in out.items() if not whole or n != value]
    if not wrong:
        return out
    gguf_name, held = wrong[0]
    raise InputError(
        config_path, f"{key} is {value!r}, but the checkpoint stores {held} experts for "
        f"{gguf_name}; fix the count in config.json",
    )  # fmt: skip


def _expert_row(
    path: Path, gguf_name: str, stacked: MatrixStats, e: int, n_experts: int, hf_name: str
) -> MatrixStats:
    """Expert e's statistics in the entry of its stacked weight: its row of sums and its count.
    An entry of one count over n_experts x K sums (a legacy .dat, or a GGUF entry written
    before llama-imatrix counted experts apart) is cut into n_experts rows of that count, as
    llama-quantize slices it; any other number of rows is refused (llama-quantize refuses an
    entry whose size is not the tensor's)."""
    if stacked.n_mat == 1 and n_experts > 1 and stacked.sums.size % n_experts == 0:
        k = stacked.sums.size // n_experts
        in_sum = None if stacked.in_sum is None else stacked.in_sum.reshape(n_experts, k)
        counts = np.repeat(stacked.counts, n_experts)
        stacked = MatrixStats(stacked.sums.reshape(n_experts, k), counts, in_sum)
    if stacked.n_mat != n_experts:
        raise InputError(
            path, f"its entry {gguf_name} holds statistics for {stacked.n_mat} experts of "
            f"{stacked.k} columns, but the model has {n_experts} experts; give the imatrix "
            "computed on this model", hf_name,
        )  # fmt: skip
    rows = slice(e, e + 1)
    row_in_sum = None if stacked.in_sum is None else stacked.in_sum[rows]
    return MatrixStats(stacked.sums[rows], stacked.counts[rows], row_in_sum)


def _block_count(config: Mapping[str, object] | None, names: list[str]) -> int:
    """num_hidden_layers from config.json, else one more than the largest block number."""
    value = (config or {}).get("num_hidden_layers")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    numbers = [int(m.group(1)) for n in names if (m := _BLOCK_NUMBER.search(n))]
    return max(numbers, default=-1) + 1


def _width_and_matrices(shape: tuple[int, ...]) -> tuple[int, int]:
    """(input width, matrices) of a weight: [out, in] is one matrix, [E, out, in] E."""
    return (shape[-1] if shape else 1), (shape[0] if len(shape) == 3 else 1)


def _misfit(stats: MatrixStats, shape: tuple[int, ...], flat: str | None = None) -> str | None:
    """Why an entry does not fit a tensor of `shape`, or None; `flat`: how an expert's row was
    cut from a one-count entry (the entry's own size is what to report, not the cut's)."""
    width, matrices = _width_and_matrices(shape)
    if stats.sums.size == width * matrices:
        return None
    mats = f" x {matrices} matrices" if matrices > 1 else ""
    held = f" x {stats.n_mat} matrices" if stats.n_mat > 1 else ""
    has = flat or f"has statistics for {stats.k} input columns{held}"
    return (
        f"its entry {has}, but the tensor {list(shape)} takes {width}{mats}; give the imatrix "
        "computed on this model"
    )


def weighted_error(
    ckpt: Checkpoint, plan: TensorPlan, result: QuantizedTensor, weights: ColumnWeights
) -> WeightedError:
    """sum h_j w_ij^2 and sum h_j (w_ij - w^_ij)^2 of a quantized tensor, w^ restored from its
    codes in the input's dtype (as the error figures measure it), a slab of rows at a time
    (the whole tensor where its qparams are not per row)."""
    entry, spec = plan.entry, plan.spec
    assert spec is not None and entry.shape
    shape = entry.shape
    row_elems = max(1, entry.numel // shape[0])
    by_rows = not isinstance(spec, QSpec) or (
        isinstance(spec.granularity, PerGroup) or spec.granularity == PerChannel(0)
    )
    step = max(1, ERROR_SLAB_ELEMS // row_elems) if by_rows else shape[0]
    signal = error = 0.0
    for a in range(0, shape[0], step):
        b = min(a + step, shape[0])
        x = ckpt.rows(entry, a, b).to(result.q.device)
        x_hat = _restored(result, spec, a, b, x).double()
        h = weights.rows(a, b).full(tuple(x.shape)).double()
        xd = x.double()
        signal += float((xd.square() * h).sum())
        error += float((xd.sub_(x_hat).square_().mul_(h)).sum())
    return WeightedError(signal, error)


def _restored(
    result: QuantizedTensor, spec: Codec, a: int, b: int, x: torch.Tensor
) -> torch.Tensor:
    """Rows a:b (of the first dim) of the tensor as its codes restore it: a grid's in x's dtype
    (as the error figures measure it; the whole tensor when its qparams are not per row), a GGUF
    type's as ggml dequantizes its blocks (float32)."""
    from qtool.numerics.kernels import restored_rows

    return restored_rows(result, spec, a, b, x)
