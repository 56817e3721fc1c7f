"""What `qtool inspect` shows of a compressed-tensors model directory (torch-free): every stored
tensor, each quantized module's scheme on the row of its codes, the config's ignore list."""

from __future__ import annotations

from qtool.errors import InputError
from qtool.formats import listing
from qtool.formats.compressed_tensors.config import read_config
from qtool.formats.compressed_tensors.schemes import args_spec, quantized_modules
from qtool.formats.compressed_tensors.selection import FORMAT
from qtool.formats.detect import Detected
from qtool.io.stformat import HeaderError, read_header_file
from qtool.results import InspectSummary


def inspect(found: Detected) -> InspectSummary:
    assert found.directory is not None and found.within is not None
    config_file = found.config_path
    assert config_file is not None
    config = read_config(found.config, config_file)
    headers = []
    for shard in found.weights:  # config, index and shards read through one descriptor
        with found.within.open(shard.name) as f:
            try:
                headers.append(read_header_file(f))
            except HeaderError as err:
                raise InputError(shard, f"not a valid safetensors file: {err}") from None
    entries = [e for h in headers for e in h.tensors]
    try:
        modules = quantized_modules([e.name for e in entries], config)
    except ValueError as err:
        raise InputError(config_file, str(err)) from None
    by_name = {e.name: e for e in entries}
    qinfo: dict[str, dict[str, object]] = {}
    for m in modules:
        codes = f"{m.module}.weight_packed"
        codes = codes if codes in by_name else f"{m.module}.weight"
        scale = by_name.get(f"{m.module}.weight_scale")
        qinfo[codes] = {
            **args_spec(m.group.weights).to_json(),
            "dtype": f"int{m.group.weights.num_bits}",
            "bits": m.group.weights.num_bits,
            "orig_dtype": scale.dtype if scale is not None else "?",
            "format": m.group.format,
        }
    rows = [listing.row(e, qinfo.get(e.name)) for e in entries]
    return InspectSummary(
        str(found.directory), FORMAT, rows, headers[0].metadata, shards=len(headers),
        quantized_modules=len(modules), ignore=list(config.ignore),
    )  # fmt: skip
