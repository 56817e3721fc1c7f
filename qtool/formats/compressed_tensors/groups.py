"""Group sizes in a compressed-tensors export: compressed-tensors and vLLM need whole groups, so
the group size G must divide the row length K of every quantized tensor; which tensors break
that, and the --group-fallback applied to them (channel, keep, or an error naming them)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from qtool.errors import InputError
from qtool.formats.compressed_tensors.selection import Selection
from qtool.spec import GroupFallback, PerChannel, PerGroup, matrix_shape


@dataclass(frozen=True)
class GroupViolation:
    """A tensor whose row length K is not a multiple of its group size G."""

    name: str
    k: int
    group_size: int

    def describe(self) -> str:
        return f"{self.name} (K={self.k}, G={self.group_size})"


def group_violations(selections: Iterable[Selection]) -> list[GroupViolation]:
    """Every quantized tensor whose K is not a multiple of its group size (compressed-tensors
    and vLLM need whole groups)."""
    found = []
    for s in selections:
        if s.spec is not None and isinstance(s.spec.granularity, PerGroup):
            k, g = matrix_shape(s.entry.shape)[1], s.spec.granularity.size
            if k % g:
                found.append(GroupViolation(s.entry.name, k, g))
    return found


def apply_group_fallback(selection: Selection, fallback: GroupFallback) -> Selection:
    """The selection with the fallback applied when its K is not a multiple of G; InputError
    (hint "group-fallback") under `error`."""
    violations = group_violations([selection])
    if not violations:
        return selection
    v = violations[0]
    if fallback is GroupFallback.CHANNEL:
        assert selection.spec is not None
        spec = replace(selection.spec, granularity=PerChannel(0))
        return replace(selection, spec=spec, note=f"K={v.k} not a multiple of {v.group_size}")
    if fallback is GroupFallback.KEEP:
        return replace(selection, spec=None, reason=f"K={v.k} not a multiple of {v.group_size}")
    raise InputError(
        None,
        f"group size {v.group_size} does not divide the row length of {v.describe()}",
        v.name,
        hint="group-fallback",
    )


LISTED_VIOLATIONS = 3  # a model's every layer breaks alike: name a few, count the rest


def resolve_groups(selections: Sequence[Selection], fallback: GroupFallback) -> list[Selection]:
    """Every selection with the fallback applied; under `error`, one InputError naming every
    tensor whose K is not a multiple of G (hint "group-fallback")."""
    violations = group_violations(selections)
    if violations and fallback is GroupFallback.ERROR:
        listed = ", ".join(v.describe() for v in violations[:LISTED_VIOLATIONS])
        if len(violations) > LISTED_VIOLATIONS:
            listed += f" and {len(violations) - LISTED_VIOLATIONS} more"
        raise InputError(
            None,
            f"the group size must divide the row length K of every quantized tensor: {listed}",
            hint="group-fallback",
        )
    return [apply_group_fallback(s, fallback) for s in selections]
