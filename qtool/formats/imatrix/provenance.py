"""qtool calibrate's provenance keys in an imatrix GGUF: one SHA-256 and one token count per
dataset (`imatrix.datasets`), which llama-imatrix does not write. calibrate --merge and
quantize --imatrix read them with the same rules."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from qtool.calibrate_results import DatasetInfo
from qtool.errors import InputError
from qtool.io.gguf_layout import GGUFValue

SHA_KEY, TOKENS_KEY = "qtool.datasets.sha256", "qtool.datasets.tokens"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def dataset_infos(
    path: Path, metadata: Mapping[str, GGUFValue], names: Sequence[str]
) -> tuple[DatasetInfo, ...]:
    """The datasets `names` of the imatrix at `path`, with qtool's SHA-256 and token counts
    where its `metadata` holds them (files from llama-imatrix, .dat files: names only);
    InputError when qtool's keys are there but are not one SHA-256 and one token count (an
    integer from 0 to 2^63 - 1) per dataset."""
    shas, tokens = metadata.get(SHA_KEY), metadata.get(TOKENS_KEY)
    if shas is None and tokens is None:
        return tuple(DatasetInfo(d, None, None) for d in names)
    sha_list, token_list = _items(shas), _items(tokens)
    valid = (
        len(sha_list) == len(names) == len(token_list)
        and all(isinstance(s, str) and _SHA256.fullmatch(s) for s in sha_list)
        and all(_is_count(t) for t in token_list)
    )
    if not valid:
        raise InputError(
            path, f"{SHA_KEY} and {TOKENS_KEY} must hold one SHA-256 and one token count for "
            f"each of its {len(names)} datasets; remove them or calibrate again",
        )  # fmt: skip
    counts = [int(t) for t in token_list if isinstance(t, (int, np.integer))]
    return tuple(
        DatasetInfo(name, str(sha), count)
        for name, sha, count in zip(names, sha_list, counts, strict=True)
    )


def _items(value: GGUFValue | None) -> list[object]:
    items = value.value if value is not None else None
    return list(items) if isinstance(items, (tuple, np.ndarray)) else []


def _is_count(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and 0 <= int(value) < 1 << 63


class SameText(UserWarning):
    """Two merged files made from the same text (the same SHA-256 recorded in both)."""


def warn_same_text(files: Sequence[tuple[Path, Sequence[DatasetInfo]]], skip: int = 0) -> None:
    """One warning line when a text's SHA-256 is recorded in two of the merged `files`: its
    tokens are counted twice (a merge of slices wants different slices). Pairs that are one file
    twice (by device and inode; warned of apart) are left out."""
    first: dict[str, tuple[Path, DatasetInfo]] = {}
    repeats: list[tuple[Path, Path, DatasetInfo]] = []
    for path, infos in files:
        for info in infos:
            if info.sha256 is None:
                continue
            seen = first.setdefault(info.sha256, (path, info))
            if seen[0] is not path and not _same_file(seen[0], path):
                repeats.append((seen[0], path, info))
    if not repeats:
        return
    a, b, info = repeats[0]
    more = f" (and {len(repeats) - 1} more)" if len(repeats) > 1 else ""
    warnings.warn(
        f"{a} and {b} were both made from the same text ({info.name}, sha256 "
        f"{info.sha256 and info.sha256[:16]}){more}: the merge counts its tokens twice; merge "
        "files calibrated on different slices of the text",
        SameText, stacklevel=2 + skip,
    )  # fmt: skip


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False
