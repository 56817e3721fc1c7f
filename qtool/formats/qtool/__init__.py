"""qtool's own format: codes under the original tensor names, and a qparams sidecar beside each
quantized file (manifest.py: the sidecar and the binding; writer.py; reader.py; inspect.py).

Registered as FormatName.QTOOL, with three detectors (detect.PRIORITY has the order): a
sidecar, a quantized file, and a directory of quantized files (an index with a `qtool`
section, or one quantized weight file beside its sidecar); detection.py holds them and the
reader of what they find. This module is the registration alone: it imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtool.formats import detect, registry
from qtool.spec import FormatName

if TYPE_CHECKING:
    from qtool.formats.base import FormatContext, OutputFormat

NAME = FormatName.QTOOL.value
SIDECAR_SUFFIX = ".qparams.safetensors"
INDEX_SECTION = "qtool"  # the key of a sharded output's index that lists its sidecars
_FOUND = "qtool.formats.qtool.detection"


def _output(context: FormatContext) -> OutputFormat:
    from qtool.formats.qtool.writer import QtoolFormat

    return QtoolFormat(context)


detect.register("qtool-sidecar", registry.lazy(_FOUND, "sidecar"))
detect.register("qtool-file", registry.lazy(_FOUND, "quantized_file"))
detect.register("qtool-directory", registry.lazy(_FOUND, "directory"))
detect.register_header(registry.lazy(_FOUND, "header"))
registry.register(
    registry.FormatEntry(
        NAME, registry.lazy(_FOUND, "reader"), registry.lazy(_FOUND, "inspect"), _output,
        registry.lazy(_FOUND, "belongings"), help="codes plus a qparams sidecar.",
        groups="the qtool format stores groups of any size",
    )
)  # fmt: skip
