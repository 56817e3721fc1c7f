"""What the loaders do with an export, said before it is written (torch-free): one warning per
choice that will not run everywhere (vLLM kernels, transformers' paths), and whether the export
asks transformers to dequantize at load time (`"dequantize": true`, for sentence-transformers
and asymmetric exports)."""

from __future__ import annotations

from collections.abc import Sequence

from qtool.formats.compressed_tensors.config import config_groups
from qtool.formats.compressed_tensors.selection import VLLM_GROUP_SIZES, Selection
from qtool.spec import PerGroup, Scheme, StorageDtype


def dequantize_at_load(
    selections: Sequence[Selection], sentence_transformers: bool
) -> tuple[bool, str | None]:
    """Whether the export writes `"dequantize": true` (transformers then dequantizes every
    Linear at load time), and a warning when it cannot. Two exports need it. A
    sentence-transformers directory: sentence-transformers calls the model's `forward`
    directly, which skips the forward pre-hook through which transformers' default path
    decompresses the model, so `encode` fails on weights still packed. An asymmetric one:
    transformers 5.23's default path cannot load an asymmetric checkpoint at all
    (compressed-tensors 0.20 expects an unpacked zero point). transformers' load-time
    dequantization reads every module with one config group's args, so it is written only for
    a single group (vLLM and compressed-tensors ignore the key)."""
    asym = any(s.spec is not None and s.spec.scheme is Scheme.ASYM for s in selections)
    if not (sentence_transformers or asym):
        return False, None
    if len(config_groups(selections)) == 1:
        return True, None
    if not sentence_transformers:
        return False, None  # asymmetric with several schemes: export_warnings says it
    return False, (
        "sentence-transformers (modules.json): this export mixes schemes, which transformers "
        "cannot dequantize at load time, so SentenceTransformer(out).encode fails until the "
        "model is decompressed by hand (docs/formats.md, sentence-transformers); with one "
        "scheme for every Linear it loads as it is"
    )


def export_warnings(selections: Sequence[Selection], *, dequantize: bool = False) -> list[str]:
    """One line per choice that will not run everywhere (vLLM kernels, transformers paths);
    `dequantize`: the export asks transformers to dequantize at load time."""
    specs = {s.spec for s in selections if s.spec is not None}
    warnings = []
    if any(s.scheme is Scheme.ASYM and s.dtype is StorageDtype.INT8 for s in specs):
        warnings.append(
            "asymmetric int8 runs on few vLLM kernels (Hopper/Machete, or Conch); "
            "symmetric int8 runs on Marlin and Machete"
        )
    odd = sorted(
        {
            s.granularity.size
            for s in specs
            if isinstance(s.granularity, PerGroup) and s.granularity.size not in VLLM_GROUP_SIZES
        }
    )
    if odd:
        sizes = ", ".join(map(str, odd))
        warnings.append(f"group size {sizes}: vLLM has kernels for groups of 32, 64 and 128 only")
    asym = any(s.scheme is Scheme.ASYM for s in specs)
    if asym and len(config_groups(selections)) > 1:
        warnings.append(
            "asymmetric with several schemes (e.g. a group fallback): transformers 5.23 with "
            "compressed-tensors 0.20 has no path that loads it correctly; vLLM and qtool read it"
        )
    if asym and dequantize:
        warnings.append(
            'asymmetric: the export asks transformers to dequantize at load time ("dequantize": '
            "true; its packed path cannot load asymmetric weights), so transformers holds it as "
            "float; vLLM ignores the key and runs it packed"
        )
    return warnings
