"""qtool calibrate --sensitivity's keys in an imatrix GGUF: alpha per weight (numerics/
sensitivity.py), as metadata, not tensors, so that llama-quantize --imatrix (which looks its
own keys up by name and reads every tensor as a weight's statistics) takes the file as it is.

    qtool.sensitivity.names      array of strings: llama.cpp's weight names
    qtool.sensitivity.alpha      array of float64: alpha of each name, in the same order
    qtool.sensitivity.reference  string: the perturbation alpha was measured with
    qtool.sensitivity.tokens     uint64: tokens the KL was averaged over
    qtool.sensitivity.joint      array of 3 float64, optional: gain, saturation, additivity.
                                 Predicted KL of a plan = gain S / (1 + saturation S), S = sum
                                 alpha r (numerics.sensitivity.joint_kl), fitted through the
                                 joint KL of every tensor at the reference and at half of it on
                                 all the calibration windows; additivity = joint KL / sum of the
                                 single KLs on the sensitivity windows (1: KL adds up), a record.
                                 Absent: predicted KL = S.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qtool.errors import InputError
from qtool.gguf_types import ValueType
from qtool.io.gguf_layout import GGUFValue
from qtool.numerics.sensitivity import joint_kl, sum_within

NAMES_KEY, ALPHA_KEY = "qtool.sensitivity.names", "qtool.sensitivity.alpha"
REFERENCE_KEY, TOKENS_KEY = "qtool.sensitivity.reference", "qtool.sensitivity.tokens"
KEYS = (NAMES_KEY, ALPHA_KEY, REFERENCE_KEY, TOKENS_KEY)
JOINT_KEY = "qtool.sensitivity.joint"


@dataclass(frozen=True)
class Sensitivities:
    """alpha per llama.cpp weight name, with how it was measured."""

    alpha: Mapping[str, float]
    reference: str
    tokens: int
    joint: tuple[float, float, float] | None = None  # gain, saturation, additivity

    def predicted(self, total: float) -> float:
        """The predicted KL of a plan whose sum alpha r is `total`."""
        return total if self.joint is None else joint_kl(total, *self.joint[:2])

    def sum_within(self, target: float) -> float:
        """The largest sum alpha r whose predicted KL stays within `target`."""
        return target if self.joint is None else sum_within(target, *self.joint[:2])


def sensitivity_keys(found: Sensitivities) -> dict[str, GGUFValue]:
    """The metadata keys of `found`, names in sorted order."""
    names = tuple(sorted(found.alpha))
    return {
        NAMES_KEY: GGUFValue(ValueType.ARRAY, names, ValueType.STRING),
        ALPHA_KEY: GGUFValue(
            ValueType.ARRAY,
            np.array([found.alpha[n] for n in names], np.float64),
            ValueType.FLOAT64,
        ),  # fmt: skip
        REFERENCE_KEY: GGUFValue(ValueType.STRING, found.reference),
        TOKENS_KEY: GGUFValue(ValueType.UINT64, found.tokens),
    } | ({} if found.joint is None else {
        JOINT_KEY: GGUFValue(ValueType.ARRAY, np.array(found.joint, np.float64), ValueType.FLOAT64)
    })  # fmt: skip


def sensitivities(metadata: Mapping[str, GGUFValue]) -> dict[str, float] | None:
    """alpha per weight name from an imatrix's `metadata`; None when it has none of the keys;
    ValueError (read_sensitivities: InputError naming the file) when they are malformed."""
    found = parse(metadata)
    return None if found is None else dict(found.alpha)


def read_sensitivities(path: Path, metadata: Mapping[str, GGUFValue]) -> Sensitivities | None:
    """parse(), with InputError naming the file."""
    try:
        return parse(metadata)
    except ValueError as err:
        raise InputError(path, f"{err}; remove them or calibrate again with "
                         "sensitivities") from None  # fmt: skip


def parse(metadata: Mapping[str, GGUFValue]) -> Sensitivities | None:
    """The sensitivities `metadata` holds; None when it has none of the keys; ValueError when
    they are incomplete or not one finite, non-negative alpha per distinct name."""
    present = [k for k in KEYS if k in metadata]
    if not present:
        return None
    names, alphas = _items(metadata.get(NAMES_KEY)), _items(metadata.get(ALPHA_KEY))
    reference, tokens = metadata.get(REFERENCE_KEY), metadata.get(TOKENS_KEY)
    valid = (
        len(present) == len(KEYS)
        and len(names) == len(alphas) == len(set(names))
        and all(isinstance(n, str) for n in names)
        and all(_is_alpha(a) for a in alphas)
        and reference is not None and isinstance(reference.value, str)
        and tokens is not None and isinstance(tokens.value, (int, np.integer))
        and 0 < int(tokens.value) < 1 << 63
    )  # fmt: skip
    if not valid or reference is None or tokens is None:
        raise ValueError("qtool.sensitivity.* must hold one finite, non-negative alpha for each "
                         "distinct weight name, the reference and a token count")  # fmt: skip
    alpha = {str(n): float(a) for n, a in zip(names, alphas, strict=True)}  # type: ignore[arg-type]
    return Sensitivities(alpha, str(reference.value), int(tokens.value),  # type: ignore[arg-type]
                         _joint(metadata))  # fmt: skip


def _joint(metadata: Mapping[str, GGUFValue]) -> tuple[float, float, float] | None:
    """The optional joint fit; ValueError when present and not 3 finite numbers, gain > 0."""
    if JOINT_KEY not in metadata:
        return None
    items = _items(metadata.get(JOINT_KEY))
    if len(items) != 3 or not all(isinstance(v, (float, int, np.floating, np.integer))
                                  and math.isfinite(float(v)) for v in items):  # fmt: skip
        raise ValueError(f"{JOINT_KEY} must hold 3 finite numbers (gain, saturation, additivity)")
    gain, saturation, additivity = (float(v) for v in items)  # type: ignore[arg-type]
    if gain <= 0:
        raise ValueError(f"{JOINT_KEY}'s gain must be positive")
    return gain, saturation, additivity


def _items(value: GGUFValue | None) -> list[object]:
    items = value.value if value is not None else None
    return list(items) if isinstance(items, (tuple, np.ndarray)) else []


def _is_alpha(value: object) -> bool:
    return isinstance(value, (float, int, np.floating, np.integer)) and (
        math.isfinite(float(value)) and float(value) >= 0.0
    )


def merged(found: Mapping[Path, Sensitivities | None]) -> Sensitivities | None:
    """The sensitivities of a merge of the files `found` describes: None when none has them;
    the token-weighted mean of each alpha when all have them for the same weights and
    reference (alpha is a mean over tokens, as the summed statistics are); InputError naming
    a file that breaks that rule, since a merged file must not claim a measurement of weights
    that some of its statistics were not measured with."""
    have = {p: s for p, s in found.items() if s is not None}
    if not have:
        return None
    first_path, first = next(iter(have.items()))
    for path, s in found.items():
        if s is None:
            raise InputError(path, f"has no sensitivities, {first_path} has: merge files "
                             "calibrated alike (all with --sensitivity or none)")  # fmt: skip
        if set(s.alpha) != set(first.alpha) or s.reference != first.reference:
            raise InputError(path, f"its sensitivities cover other weights or another reference "
                             f"than {first_path}'s; calibrate them alike")  # fmt: skip
    tokens = 0
    for path, s in have.items():
        tokens += s.tokens
        if tokens >= 1 << 63:  # what a reader takes (read_sensitivities)
            raise InputError(
                path, "its sensitivity token count with the other files' reaches 2^63, more "
                "than an importance matrix holds: merge fewer files",
            )  # fmt: skip
    # weights of at most 1: finite alphas give a finite mean (alpha x tokens could overflow)
    alpha = {n: sum(s.alpha[n] * (s.tokens / tokens) for s in have.values()) for n in first.alpha}
    # the joint fit is of one run's windows: a merge keeps none (predicted KL = sum alpha r)
    return Sensitivities(alpha, first.reference, tokens)


def describe(metadata: Mapping[str, GGUFValue]) -> str | None:
    """The sensitivities `metadata` holds, in one line for inspect (None: it holds none; keys
    that are malformed are said to be, as inspect shows any file)."""
    try:
        found = parse(metadata)
    except ValueError as err:
        return f"malformed: {err}"
    if found is None:
        return None
    joint = (
        "no joint fit (predicted KL = sum alpha r)"
        if found.joint is None
        else "joint fit: gain {:.4g}, saturation {:.4g}, additivity {:.4g}".format(*found.joint)
    )
    return (
        f"sensitivities of {len(found.alpha)} weights, reference {found.reference}, "
        f"{found.tokens} tokens, {joint}"
    )
