"""Docs drift: gguf.md's section on GGUF specs describes the codec qtool has (codecs/gguf.py's
GGUFSpec), not the design before it (a QSpec with a `gguf` field, `QSpec.gguf`): every
function, class or attribute it names in code exists, and its JSON example is the codec's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import qtool.codecs.gguf as codec_module
import qtool.formats.registry as registry
import qtool.spec as spec_module
from qtool.codecs.base import Codec
from qtool.codecs.gguf import GGUFSpec, gguf_spec

DOCS = Path(__file__).parents[2] / "docs"
PLACES = (spec_module, codec_module, registry, GGUFSpec, Codec)


def _section() -> str:
    text = (DOCS / "gguf.md").read_text(encoding="utf-8")
    start = text.index("## Specs:")
    return text[start : text.index("\n## ", start + 1)]


def _exists(dotted: str) -> bool:
    head, *rest = dotted.split(".")
    for place in PLACES:
        found: object = place
        for part in (head, *rest):
            fields = getattr(found, "__dataclass_fields__", {})
            found = fields[part] if part in fields else getattr(found, part, None)
            if found is None:
                break
        if found is not None:
            return True
    return False


def test_every_name_the_section_gives_exists() -> None:
    section = _section()
    assert "QSpec.gguf" not in section
    code = re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)(?:\([^`]*\))?`", section)
    identifiers = {c for c in code if "_" in c or re.search(r"[A-Z].*[a-z]", c)}
    named = {c for c in identifiers if not GGUFSpec.names(c)}  # not a type's name ("Q6_K")
    assert {"GGUFSpec", "gguf_spec", "code_layout"} <= named  # the pattern still finds them
    assert not [n for n in sorted(named) if not _exists(n)]


def test_the_json_example_is_the_codecs() -> None:
    example = re.search(r'`(\{"gguf_type": "(\w+)".*?\})`', _section(), re.S)
    assert example is not None
    assert json.loads(example.group(1)) == gguf_spec(example.group(2)).to_json()
