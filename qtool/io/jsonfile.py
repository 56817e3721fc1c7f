"""Config files (config.json, an index, --config) read one way: a regular file only, opened
non-blocking (a FIFO cannot hang the run), at most `limit` bytes read (`/dev/zero` cannot eat
memory), UTF-8, strict JSON (duplicate keys and NaN refused) nested at most MAX_JSON_DEPTH
levels (checked before json.loads, so 200,000 `[` are a clear error, never RecursionError).
Inside a checkpoint directory the file is opened through the directory's descriptor without
following links (safeopen.InputDir). Torch-free."""

from __future__ import annotations

from pathlib import Path

from qtool.errors import InputError
from qtool.io.safeopen import InputDir, read_bounded
from qtool.io.stformat import HeaderError, strict_json

MAX_CONFIG_BYTES = 16_000_000  # config.json of real models: a few kB; tokenizer files differ


def parse_json(data: bytes, path: Path, what: str) -> object:
    """`data` as strict JSON (InputError naming `path` and saying what is wrong)."""
    try:
        return strict_json(data)
    except HeaderError as err:
        message = str(err).removeprefix("header ").replace("is not valid JSON", "invalid JSON")
        if "Exceeds the limit" in message:  # Python's int digit limit: not the user's to raise
            message = "invalid JSON: a number of more than 4,300 digits"
        raise InputError(path, f"not a valid {what}: {message}") from None


def read_json(
    path: Path, *, within: InputDir | None = None, limit: int = MAX_CONFIG_BYTES, what: str
) -> object:
    """The JSON document in `path` (or in the file of that name inside `within`)."""
    data = within.read(path.name, limit, what) if within else read_bounded(path, limit, what)
    return parse_json(data, path, what)


def read_json_object(
    path: Path, *, within: InputDir | None = None, limit: int = MAX_CONFIG_BYTES, what: str
) -> dict[str, object]:
    """read_json, refusing anything but a JSON object."""
    doc = read_json(path, within=within, limit=limit, what=what)
    if not isinstance(doc, dict):
        raise InputError(path, f"not a valid {what}: expected a JSON object")
    return doc
