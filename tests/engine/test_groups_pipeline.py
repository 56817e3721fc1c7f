"""Groups, 4-bit codes and the mse range search through whole files: the stored codes, scales
and zero points equal the plain reference's, dequantize and compare agree, and the sidecar
says version 2 exactly when a version-1 reader could misread it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qtool import api
from qtool.engine.plan import QuantizeOptions
from qtool.errors import SidecarError
from qtool.formats.qtool.manifest import MANIFEST_KEY, sidecar_path
from qtool.numerics.packing import unpack_nibbles
from qtool.numerics.range_methods import search_candidates
from qtool.spec import (
    PerChannel,
    PerGroup,
    PerTensor,
    QSpec,
    RangeMethod,
    Scheme,
    StorageDtype,
)
from tests import reference

FORMATS_DOC = Path(__file__).parents[2] / "docs" / "formats.md"
SPECS = [
    QSpec(Scheme.SYM, StorageDtype.INT8, PerGroup(32)),
    QSpec(Scheme.ASYM, StorageDtype.UINT8, PerGroup(48)),  # 48 does not divide 64 or 128
    QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32), RangeMethod.MSE),
    QSpec(Scheme.ASYM, StorageDtype.UINT4, PerChannel(0)),
    QSpec(Scheme.SYM, StorageDtype.UINT4, PerTensor(), RangeMethod.MSE),
    QSpec(Scheme.ASYM, StorageDtype.INT8, PerChannel(1), RangeMethod.MSE),
]
FILES = ["mlp.safetensors", "mlp-bf16.safetensors", "convnet.pt"]


def _id(spec: QSpec) -> str:
    return spec.describe().replace(" ", "-")


def _reference(x: torch.Tensor, spec: QSpec) -> tuple[np.ndarray, ...]:
    g = spec.granularity
    if isinstance(g, PerGroup):
        granularity: tuple[str, int] = ("group", g.size)
    elif isinstance(g, PerChannel):
        granularity = ("channel", g.axis % x.ndim)
    else:
        granularity = ("tensor", 0)
    candidates = list(search_candidates(spec, tuple(x.shape)))
    method = spec.range_method.value
    return reference.quantize_v2(
        x.float().numpy(), spec.scheme.value, spec.dtype.value, granularity, method, candidates
    )


def _original(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(path)
    loaded = torch.load(path, weights_only=True)
    return dict(loaded.get("state_dict", loaded))


@pytest.mark.parametrize("spec", SPECS, ids=_id)
@pytest.mark.parametrize("name", FILES)
def test_files_hold_the_reference_codes_and_restore(samples: Path, name: str, spec: QSpec) -> None:
    src, qfile = samples / name, samples / "q.safetensors"
    summary = api.quantize(src, qfile, QuantizeOptions(spec), device="cpu")
    original = _original(src)
    codes = load_file(qfile)
    api.dequantize(qfile, samples / "r.safetensors")
    restored = load_file(samples / "r.safetensors")
    quantized = [r for r in summary.rows if r.quantized]
    assert quantized
    with safe_open(sidecar_path(qfile), "pt") as side:
        for row in quantized:
            x = original[row.name]
            ref_q, ref_scale, ref_zp, ref_choice = _reference(x, spec)
            q = codes[row.name]
            if spec.dtype.packed:
                q = unpack_nibbles(q, x.shape[-1], spec.dtype.signed).reshape(x.shape)
            np.testing.assert_array_equal(q.numpy().astype(np.int64), ref_q)
            # (A group at least as long as a row is stored per channel: [C] instead of [C, 1].)
            scale = side.get_tensor(f"{row.name}.scale").numpy()
            np.testing.assert_array_equal(scale, ref_scale.reshape(scale.shape))
            zp = side.get_tensor(f"{row.name}.zero_point").numpy().astype(np.int64)
            np.testing.assert_array_equal(zp, ref_zp.reshape(zp.shape))
            if spec.range_method is RangeMethod.MSE:
                choice = side.get_tensor(f"{row.name}.range_choice").numpy().astype(np.int64)
                np.testing.assert_array_equal(choice, ref_choice.reshape(choice.shape))
            expected = (ref_q - _broadcast(ref_zp, x, spec)) * _broadcast(ref_scale, x, spec)
            got = restored[row.name]
            assert got.dtype == x.dtype and got.shape == x.shape
            assert torch.equal(got, torch.from_numpy(expected.astype(np.float32)).to(x.dtype))


def _broadcast(grid: np.ndarray, x: torch.Tensor, spec: QSpec) -> np.ndarray:
    """A qparam grid spread onto x's elements."""
    g = spec.granularity
    if isinstance(g, PerGroup):
        rows = x.shape[0]
        k = x.numel() // rows
        return np.asarray(grid, dtype=np.float32)[:, np.arange(k) // g.size].reshape(x.shape)
    if isinstance(g, PerChannel):
        shape = [1] * x.ndim
        shape[g.axis % x.ndim] = -1
        return np.asarray(grid, dtype=np.float32).reshape(shape)
    return np.asarray(grid, dtype=np.float32)


@pytest.mark.parametrize("spec", SPECS[:3], ids=_id)
def test_sharded_checkpoints_and_compare(samples: Path, spec: QSpec) -> None:
    out = samples / "sharded-q"
    api.quantize(samples / "sharded-mlp", out, QuantizeOptions(spec), device="cpu")
    single = samples / "single.safetensors"
    api.quantize(samples / "mlp.safetensors", single, QuantizeOptions(spec), device="cpu")
    restored = samples / "sharded-r"
    api.dequantize(out, restored)
    summary = api.compare(samples / "mlp.safetensors", single)
    assert not summary.mismatches and summary.overall is not None
    assert summary.overall.sqnr_db > (15 if spec.dtype.packed else 35)


def _version(side: Path) -> int:
    with safe_open(side, "np") as f:
        return int(json.loads(f.metadata()[MANIFEST_KEY])["format_version"])


@pytest.mark.parametrize(
    "spec, version",
    [
        (QSpec(), 1),
        (QSpec(Scheme.ASYM, StorageDtype.UINT8, PerTensor()), 1),
        (QSpec(granularity=PerGroup(16)), 2),
        (QSpec(dtype=StorageDtype.INT4), 2),
        (QSpec(range_method=RangeMethod.MSE), 2),
    ],
    ids=["int8-channel", "uint8-tensor", "group", "int4", "mse"],
)
def test_sidecar_version_is_1_unless_a_v1_reader_could_misread(
    samples: Path, spec: QSpec, version: int
) -> None:
    q = samples / "q.safetensors"
    api.quantize(samples / "mlp.safetensors", q, QuantizeOptions(spec), device="cpu")
    assert _version(sidecar_path(q)) == version


def test_a_newer_sidecar_version_is_refused_clearly(samples: Path) -> None:
    q = samples / "q.safetensors"
    api.quantize(samples / "mlp.safetensors", q, QuantizeOptions(), device="cpu")
    side = sidecar_path(q)
    with safe_open(side, "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    doc = json.loads(metadata[MANIFEST_KEY])
    doc["format_version"] = 3
    save_file(tensors, side, {MANIFEST_KEY: json.dumps(doc)})
    with pytest.raises(SidecarError, match="version 3 is not supported"):
        api.dequantize(q, samples / "r.safetensors")


def _readme_numpy_snippet() -> str:
    match = re.search(
        r"```python\n(# Dequantize a qtool file without qtool.*?)```", FORMATS_DOC.read_text(), re.S
    )
    assert match, "docs/formats.md: the numpy dequantization snippet is missing"
    return match.group(1)


@pytest.mark.parametrize("spec", [QSpec(), *SPECS], ids=["int8-channel", *map(_id, SPECS)])
def test_readme_numpy_snippet_dequantizes_without_qtool(samples: Path, spec: QSpec) -> None:
    q = samples / "q.safetensors"
    api.quantize(samples / "convnet.safetensors", q, QuantizeOptions(spec), device="cpu")
    api.dequantize(q, samples / "r.safetensors", dtype="float32")
    namespace: dict[str, object] = {}
    exec(_readme_numpy_snippet(), namespace)  # the docs' code, as a reader would run it
    ours = namespace["dequantize_without_qtool"](str(q), str(sidecar_path(q)))  # type: ignore[operator]
    restored = load_file(samples / "r.safetensors")
    assert ours.keys() == restored.keys()
    for name, x in restored.items():
        np.testing.assert_array_equal(ours[name], x.numpy(), err_msg=name)


def test_plot_draws_group_scales_and_the_4bit_grid(samples: Path) -> None:
    pytest.importorskip("matplotlib")
    out = samples / "g.png"
    spec = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32), RangeMethod.MSE)
    info = api.plot_tensor(samples / "mlp.safetensors", "layers.0.fc2.weight", spec, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert info["spec"] == "sym int4 group 32 mse" and 15 < float(str(info["sqnr_db"])) < 40


@pytest.mark.parametrize(
    "args, says",
    [
        (["--group-size", "0"], "--group-size: must be at least 2, got 0"),
        (["--group-size", "1"], "--group-size: must be at least 2, got 1"),
        (["--group-size", "-8"], "--group-size: must be at least 2, got -8"),
        (["--group-size", "x"], "--group-size"),
        (["--group-size", "32", "--per-tensor"], "groups are not per tensor"),
        (["--group-size", "32", "--axis", "1"], "groups run along the rows"),
        (["--dtype", "int2"], "--dtype"),
        (["--range", "best"], "--range"),
    ],
    ids=["zero", "one", "negative", "not-a-number", "per-tensor", "axis", "dtype", "range"],
)
def test_group_and_range_usage_errors_are_one_line_exit_2(
    samples: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    from qtool.cli import main

    out = samples / "q.safetensors"
    with pytest.raises(SystemExit) as info:
        main(["quantize", str(samples / "mlp.safetensors"), "-o", str(out), *args])
    captured = capsys.readouterr()
    assert info.value.code == 2 and captured.out == "" and not out.exists()
    assert captured.err.count("\n") == 1 and says in captured.err


def test_a_group_longer_than_a_row_is_per_channel_and_says_so(samples: Path) -> None:
    options = QuantizeOptions(QSpec(granularity=PerGroup(4096)))
    summary = api.quantize(samples / "mlp.safetensors", None, options, mode="plan")
    assert summary is not None
    row = next(r for r in summary.rows if r.name == "layers.0.fc2.weight")
    assert row.detail == "sym int8 axis 0 (group 4096 >= row length 128: per channel)"


def test_mse_with_nonfinite_values_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    from qtool.errors import NumericError

    w = torch.randn(8, 64)
    w[3, 5] = float("nan")
    save_file({"w": w}, tmp_path / "m.safetensors")
    spec = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32), RangeMethod.MSE)
    with pytest.raises(NumericError, match="1 NaN/Inf") as info:
        api.quantize(tmp_path / "m.safetensors", None, QuantizeOptions(spec), device="cpu")
    assert info.value.tensor == "w" and sorted(p.name for p in tmp_path.iterdir()) == [
        "m.safetensors"
    ]


@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_bytes_out_counts_everything_the_two_files_hold(samples: Path, spec: QSpec) -> None:
    from qtool.io.stformat import read_header

    q = samples / "q.safetensors"
    summary = api.quantize(samples / "mlp.safetensors", q, QuantizeOptions(spec), device="cpu")
    written = sum(read_header(p).data_bytes for p in (q, sidecar_path(q)))
    assert summary.bytes_out == written


def test_plot_refuses_a_quantized_file_and_its_json_says_ok(samples: Path) -> None:
    pytest.importorskip("matplotlib")
    from qtool.errors import QtoolError

    q = samples / "q.safetensors"
    api.quantize(samples / "mlp.safetensors", q, QuantizeOptions(), device="cpu")
    with pytest.raises(QtoolError, match="is a qtool-quantized file"):
        api.plot_tensor(q, "head.weight", QSpec(), samples / "p.png")
    from qtool.report.json import plot_json

    info = api.plot_tensor(samples / "mlp.safetensors", "head.weight", QSpec(), samples / "p.png")
    doc = plot_json("m", "p.png", info)
    assert doc["ok"] is True and doc["spec"]["granularity"] == {"kind": "channel", "axis": 0}
