"""config.json of a qtool-format model directory: marked so that no float loader takes the codes
for weights (transformers would cast the int8 codes to bf16 and answer garbage, silently).

The mark changes `model_type`, which transformers' AutoConfig (behind every Auto class and
sentence-transformers) refuses with its "does not recognize this architecture" error quoting
the value, and adds a `quantization_config` whose `quant_method` no loader knows (vLLM refuses
it; transformers warns when a model class is named directly). The `qtool` section keeps the
original `model_type`: qtool's readers see the unmarked config, and dequantize writes it back.
Directories written before the mark have a plain config.json and read as before. Torch-free.
"""

from __future__ import annotations

import json

MODEL_TYPE = "qtool-quantized: integer codes, not float weights; run qtool dequantize on it"
QUANT_METHOD = "qtool"
SECTION = "qtool"


def marked(doc: dict[str, object]) -> dict[str, object]:
    """The model's config as the qtool format writes it (see the module docstring)."""
    section = {"format": "qtool", "model_type": doc.get("model_type")}
    return doc | {
        "model_type": MODEL_TYPE,
        "quantization_config": {"quant_method": QUANT_METHOD, "format": "qtool"},
        SECTION: section,
    }


def is_marked(doc: object) -> bool:
    if not isinstance(doc, dict):
        return False
    qconfig = doc.get("quantization_config")
    return (
        doc.get("model_type") == MODEL_TYPE
        and isinstance(qconfig, dict)
        and qconfig.get("quant_method") == QUANT_METHOD
        and isinstance(doc.get(SECTION), dict)
    )


def unmarked(doc: object) -> object:
    """The model's own config: a marked one without the mark, anything else as it is."""
    if not is_marked(doc):
        return doc
    assert isinstance(doc, dict)
    section = doc[SECTION]
    assert isinstance(section, dict)
    out = {k: v for k, v in doc.items() if k not in (SECTION, "quantization_config")}
    original = section.get("model_type")
    if isinstance(original, str):
        out["model_type"] = original
    else:
        del out["model_type"]
    return out


def config_bytes(doc: object) -> bytes:
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()
