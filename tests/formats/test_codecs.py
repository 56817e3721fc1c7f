"""Codecs (qtool/codecs): every spec is one registered value type, and no module outside a
codec's own asks which codec a spec is (issue 29 item 1)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, is_dataclass
from pathlib import Path

import pytest

from qtool.codecs.base import CODECS, Codec
from qtool.codecs.gguf_float import gguf_float_spec
from qtool.spec import (
    GGUFSpec,
    QSpec,
    RangeMethod,
    SpecPatch,
    StorageDtype,
    gguf_spec,
    parse_spec_label,
)

ROOT = Path(__file__).resolve().parents[2] / "qtool"
OWN = ("codecs", "formats/gguf", "numerics/gguf")  # the GGUF codec's module, format and kernels
ASKING = re.compile(r"\bspec\.gguf\b|\.gguf is (not )?None|QSpec\(gguf=|\bstores_gguf\b")


def test_no_module_outside_a_codecs_own_asks_whether_a_spec_is_a_gguf_type() -> None:
    """A spec's family answers through its methods (labels, bytes, fitting, kernels); a branch
    on `spec.gguf` elsewhere is one more place a new codec would have to find and edit."""
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted(ROOT.rglob("*.py"))
        if not str(path.relative_to(ROOT)).startswith(OWN)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ASKING.search(line)
    ]
    assert not found, "\n".join(found)


def test_no_module_outside_a_codecs_own_asks_whether_a_spec_is_a_float_conversion() -> None:
    """Whether a run converts (--dtype F16: no codes) is the spec's `conversion`; a stored
    dtype compared with the float types' names is the family asked by another name."""
    asking = re.compile(r"stored_dtype\(\) (not )?in\b|\bstored (not )?in FLOAT_TYPES")
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted(ROOT.rglob("*.py"))
        if not str(path.relative_to(ROOT)).startswith("codecs")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if asking.search(line)
    ]
    assert not found, "\n".join(found)
    assert gguf_float_spec("F16").conversion and not gguf_spec("Q8_0").conversion


@pytest.mark.parametrize("label", ["int8", "int4 g32", "Q4_0", "Q6_K", "F16", "BF16"])
def test_the_code_layout_names_the_codes_rows_per_row_of_the_tensor(label: str) -> None:
    """code_layout's third figure is how many rows of the codes one row of the tensor's first
    dimension gives (the slab writer's stride): the codes' rows over the tensor's."""
    spec = gguf_float_spec(label) if label in ("F16", "BF16") else parse_spec_label(label)
    shape = (6, 4, 256)
    codes, _, per_row = spec.code_layout(shape)
    assert codes[0] == shape[0] * per_row


def test_reports_and_eval_ask_the_registry_not_a_format_name() -> None:
    """What differs between formats (the budget's 8-bit reference, who loads a directory) is a
    FormatEntry field; a name compared in the report or eval is one more place a new format
    would have to find (issue 29 item 4)."""
    naming = re.compile(r"FormatName\.[A-Z_]+|== \"(qtool|gguf|compressed-tensors)\"")
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for where in ("report", "engine/evaluate", "engine/model")
        for path in sorted((ROOT / where).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if naming.search(line)
    ]
    assert not found, "\n".join(found)


def test_every_family_is_a_registered_frozen_value_type() -> None:
    assert CODECS["grid"] is QSpec and CODECS["gguf"] is GGUFSpec
    for kind, family in CODECS.items():
        assert issubclass(family, Codec) and family.kind == kind and family.what
        assert is_dataclass(family) and family.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_a_family_whose_kind_is_taken_is_refused() -> None:
    with pytest.raises(TypeError, match="codec kind 'gguf' is taken by GGUFSpec"):

        class Other(Codec, kind="gguf", what="another"):  # noqa: F841  (refused on creation)
            pass


@pytest.fixture
def toy_family() -> Iterator[type[Codec]]:
    """A codec family made in the test, as a new codec's module would make it, and removed
    again so other tests see the built-in families only."""

    @dataclass(frozen=True)
    class Toy(Codec, kind="toy", what="a toy codec"):
        bits: int = 3

        @classmethod
        def from_label(cls, text: str, *, writable: bool = False) -> Toy | None:
            return Toy(int(text[3:])) if re.fullmatch(r"toy\d", text) else None

        def describe(self) -> str:
            return f"toy{self.bits}"

        def label(self) -> str:
            return self.describe()

        def to_json(self) -> dict[str, object]:
            return {"toy_bits": self.bits}

        @property
        def tag(self) -> str:
            return self.describe()

        def fit(self, shape: tuple[int, ...]) -> tuple[Toy, str]:
            return self, ""

        def stored_dtype(self) -> str:
            return "U8"

        def code_layout(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str, int]:
            return shape, "U8", 1

        def code_nbytes(self, shape: tuple[int, ...]) -> int:
            n = 1
            for d in shape:
                n *= d
            return n

    # labels are tried in the order registered, the grid's last (it says what is wrong)
    order = dict(CODECS)
    CODECS.clear()
    CODECS.update({"toy": Toy, **order})
    try:
        yield Toy
    finally:
        CODECS.clear()
        CODECS.update(order)


def test_a_new_family_is_found_by_labels_and_patches_without_other_edits(
    toy_family: type[Codec],
) -> None:
    toy = parse_spec_label("toy5")
    assert isinstance(toy, toy_family) and toy.describe() == "toy5"
    assert toy.restored_dtype("BF16") == "BF16" and toy.sidecar_nbytes((4, 4)) == 0
    assert SpecPatch(codec=toy).apply(QSpec()) == toy
    assert SpecPatch().apply(toy) == toy  # an empty patch keeps any codec
    assert parse_spec_label("int4 g32") == parse_spec_label("g32 int4")
    assert parse_spec_label("Q4_K") == gguf_spec("Q4_K")


def test_a_grid_patch_over_a_whole_codec_starts_from_the_grid_defaults() -> None:
    patched = SpecPatch(range_method=RangeMethod.MSE).apply(gguf_spec("Q6_K"))
    assert patched == QSpec(range_method=RangeMethod.MSE)
    with pytest.raises(ValueError, match="Q6_K fixes its own block layout"):
        SpecPatch(dtype=StorageDtype.INT4, codec=gguf_spec("Q6_K"))
