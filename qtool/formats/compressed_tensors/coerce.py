"""compressed-tensors' own reading of a config, without compressed-tensors (torch-free).

compressed-tensors (0.20) validates `quantization_config` with pydantic models in lax mode:
QuantizationConfig (unknown keys ignored), QuantizationScheme and QuantizationArgs (unknown
keys refused), plus their validators. qtool must read a config exactly as they do: a
`"symmetric": "false"` IS asymmetric there, `"num_bits": "4"` IS 4, and what they refuse is
refused. This module is that reading, field by field; tests/formats/test_ct_coerce.py compares
it with the real pydantic models over a grid of values (CI installs the interop extra, so they
run).

Each function returns the coerced value or raises ValueError saying what compressed-tensors
would not accept.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

ARGS_FIELDS = frozenset(
    {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
     "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}
)  # fmt: skip
SCHEME_FIELDS = frozenset(
    {"targets", "weights", "input_activations", "output_activations", "format"}
)
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
FORMATS = (
    "dense", "sparse-bitmask", "sparse-24-bitmask", "int-quantized", "float-quantized",
    "naive-quantized", "pack-quantized", "marlin-24", "mixed-precision", "nvfp4-pack-quantized",
    "mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized",
)  # fmt: skip
STATUSES = ("initialized", "calibration", "frozen", "compressed", "decompressed")
ACTORDERS = ("weight", "static", "group", "dynamic")
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_TEXT = re.compile(r"[+-]?[0-9](?:_?[0-9])*(?:\.0*)?")
_TORCH_DTYPES = frozenset(
    {"float32", "float", "float64", "double", "float16", "half", "bfloat16", "int8", "uint8",
     "int16", "short", "int32", "int", "int64", "long", "bool", "float8_e4m3fn", "float8_e5m2",
     "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64", "complex64",
     "complex128", "cfloat", "cdouble", "chalf", "complex32", "float8_e8m0fnu",
     "float4_e2m1fn_x2", "quint8", "qint8", "qint32", "quint4x2", "quint2x4", "int1", "int2",
     "int3", "int4", "int5", "int6", "int7", "uint1", "uint2", "uint3", "uint4", "uint5",
     "uint6", "uint7", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"}
)  # fmt: skip


def as_int(value: object, field: str) -> int:
    """pydantic's lax int: bools, whole floats, and decimal text (spaces, `_`, `+`, `.0`)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{field} {value!r} is not a whole number")
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if text.isascii() and _INT_TEXT.fullmatch(text):
            return int(text.split(".")[0].replace("_", ""))
    raise ValueError(f"{field} {value!r} is not an integer")


def as_bool(value: object, field: str) -> bool:
    """pydantic's lax bool: true/false/yes/no/on/off/t/f/y/n/1/0 text (any case), 0/1."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ValueError(f"{field} {value!r} is not a boolean")


def as_str(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field} {value!r} is not a string")
    return value


def as_str_list(value: object, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field} must be a list of strings")
    return list(value)


def as_choice(value: object, field: str, choices: tuple[str, ...], *, lower: bool) -> str:
    """An enum field: text (lower-cased first where compressed-tensors does) among `choices`."""
    if isinstance(value, str):
        text = value.lower() if lower else value
        if text in choices:
            return text
    raise ValueError(f"{field} {value!r} is not one of {', '.join(choices)}")


def _group_size(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):  # compressed-tensors compares it with -1 first: TypeError
        raise ValueError(f"group_size {value!r} is not a number")
    if isinstance(value, int | float) and value < -1:
        raise ValueError(f"invalid group_size {value}: use > 0 for groups, -1 for channel")
    return as_int(value, "group_size")


def _dynamic(value: object) -> bool | str:
    if isinstance(value, str):
        return as_choice(value, "dynamic", ("local",), lower=True)
    return as_bool(value, "dynamic")


def _actorder(value: object) -> str | bool | None:
    if value is None:
        return None
    if isinstance(value, bool):
        if value:
            raise ValueError("actorder=True (group activation ordering) has been removed")
        return None
    if isinstance(value, str):
        if value.lower() in ("group", "dynamic"):
            raise ValueError(f"actorder={value!r} has been removed")
        return as_choice(value, "actorder", ACTORDERS, lower=False)
    return as_bool(value, "actorder")


def _torch_dtype(value: object, field: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value.removeprefix("torch.") in _TORCH_DTYPES:
        return value.removeprefix("torch.")
    raise ValueError(f"{field} {value!r} is not a torch dtype")


def quantization_args(w: Mapping[str, object]) -> dict[str, object]:
    """A QuantizationArgs dict as compressed-tensors validates it: every field coerced,
    `strategy` inferred, its cross-field rules applied (ValueError otherwise)."""
    unknown = sorted(set(w) - ARGS_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}")
    args: dict[str, object] = {
        "num_bits": as_int(w.get("num_bits", 8), "num_bits"),
        "type": as_choice(w.get("type", "int"), "type", ("int", "float"), lower=True),
        "symmetric": as_bool(w.get("symmetric", True), "symmetric"),
        "group_size": _group_size(w.get("group_size")),
        "dynamic": _dynamic(w.get("dynamic", False)),
        "actorder": _actorder(w.get("actorder")),
        "scale_dtype": _torch_dtype(w.get("scale_dtype"), "scale_dtype"),
        "zp_dtype": _torch_dtype(w.get("zp_dtype"), "zp_dtype"),
    }
    strategy = w.get("strategy")
    args["strategy"] = None if strategy is None else as_choice(
        strategy, "strategy", STRATEGIES, lower=True)  # fmt: skip
    block = w.get("block_structure")
    args["block_structure"] = None if block is None else _block(block)
    if w.get("observer") is not None:
        as_str(w["observer"], "observer")
    if "observer_kwargs" in w and not isinstance(w["observer_kwargs"], dict):
        raise ValueError("observer_kwargs must be an object")
    _check_args(args)
    return args


def _block(value: object) -> list[int]:
    if isinstance(value, str):
        try:
            value = [int(x) for x in value.split("x")]
        except ValueError:
            raise ValueError(f"invalid block_structure {value!r}") from None
    if isinstance(value, list) and len(value) == 2 and all(
        type(v) is int and v > 0 for v in value
    ):  # fmt: skip
        return list(value)
    raise ValueError(f"invalid block_structure {value!r}")


def _check_args(args: dict[str, object]) -> None:
    """QuantizationArgs.validate_model_after: strategy inference and its constraints."""
    size, strategy, dynamic = args["group_size"], args["strategy"], args["dynamic"]
    assert size is None or isinstance(size, int)
    if strategy is None:
        if size is None:
            strategy = "tensor"
        elif size > 0:
            strategy = "group"
        elif size == -1:
            strategy = "channel"
        else:
            raise ValueError(f"invalid group_size {size}: use > 0 for groups, -1 for channel")
        args["strategy"] = strategy
    if strategy == "token" and not dynamic:
        raise ValueError("static token quantization is not possible (dynamic must be true)")
    grouped = strategy in ("group", "tensor_group")
    if grouped and (size is None or size <= 0):
        raise ValueError(f"strategy {strategy} needs a positive group_size")
    if size is not None and size > 0 and not grouped:
        raise ValueError(f"group_size {size} needs strategy 'group', not {strategy!r}")
    if (strategy == "block") != (args["block_structure"] is not None):
        raise ValueError("block_structure and strategy 'block' go together")
    if dynamic and strategy not in ("token", "tensor", "tensor_group", "group"):
        raise ValueError(f"dynamic quantization cannot use strategy {strategy!r}")
    if dynamic == "local" and strategy != "tensor_group":
        raise ValueError("dynamic 'local' needs strategy tensor_group")
    if args["zp_dtype"] is None and args["type"] == "float" and args["num_bits"] not in (4, 6, 8):
        raise ValueError(f"float weights of {args['num_bits']} bits are not supported")


def quantization_scheme(g: object, name: str) -> dict[str, object]:
    """A QuantizationScheme dict as compressed-tensors validates it."""
    if isinstance(g, list):
        raise ValueError(
            f"config group {name} is a preset scheme name with targets; qtool reads only "
            "groups written out (targets, weights, format)"
        )
    if not isinstance(g, dict):
        raise ValueError(f"config group {name} is not an object")
    unknown = sorted(set(g) - SCHEME_FIELDS)
    if unknown:
        raise ValueError(f"config group {name}: unknown field(s) {unknown}")
    if "targets" not in g:
        raise ValueError(f"config group {name}: no targets")
    scheme: dict[str, object] = {"targets": as_str_list(g["targets"], f"group {name} targets")}
    for key in ("weights", "input_activations", "output_activations"):
        value = g.get(key)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config group {name}: {key} is not an object")
        try:
            scheme[key] = None if value is None else quantization_args(value)
        except ValueError as err:
            raise ValueError(f"config group {name} {key}: {err}") from None
    fmt = g.get("format")
    scheme["format"] = None if fmt is None else as_choice(fmt, "format", FORMATS, lower=False)
    _check_scheme(scheme, name)
    return scheme


def _check_scheme(scheme: dict[str, object], name: str) -> None:
    inputs, outputs = scheme["input_activations"], scheme["output_activations"]
    if isinstance(inputs, dict):
        if inputs["strategy"] not in ("token", "tensor", "group", "tensor_group", "attn_head"):
            raise ValueError(f"config group {name}: {inputs['strategy']} activations")
        if inputs["actorder"] is not None:
            raise ValueError(f"config group {name}: actorder on input activations")
    if isinstance(outputs, dict) and outputs["actorder"] is not None:
        raise ValueError(f"config group {name}: actorder on output activations")
    if scheme["format"] == "mixed-precision":
        raise ValueError(f"config group {name}: mixed-precision is not a group format")


def quantization_config(q: Mapping[str, object]) -> dict[str, object]:
    """A QuantizationConfig dict as compressed-tensors validates it (unknown keys ignored)."""
    groups = q.get("config_groups")
    if not isinstance(groups, dict):
        raise ValueError("config_groups must be an object")
    config: dict[str, object] = {
        "config_groups": {str(n): quantization_scheme(g, str(n)) for n, g in groups.items()},
        "quant_method": as_str(q.get("quant_method", "compressed-tensors"), "quant_method"),
        "format": as_str(q.get("format", "fakequant"), "format"),
        "quantization_status": as_choice(
            q.get("quantization_status", "initialized"),
            "quantization_status",
            STATUSES,
            lower=False,
        ),  # fmt: skip
    }
    ignore = q.get("ignore", [])
    config["ignore"] = [] if ignore is None else as_str_list(ignore, "ignore")
    kv = q.get("kv_cache_scheme")
    if kv is not None:
        if not isinstance(kv, dict):
            raise ValueError("kv_cache_scheme is not an object")
        quantization_args(kv)
    ratio = q.get("global_compression_ratio")
    numeric = isinstance(ratio, int | float) and not isinstance(ratio, bool)
    if ratio is not None and not numeric and not (isinstance(ratio, str) and _is_float_text(ratio)):
        raise ValueError(f"global_compression_ratio {ratio!r} is not a number")
    return config


def _is_float_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
