"""numerics/select.py: QTOOL_KERNEL, the fallback to the torch kernels without numba, the
background load, and byte-identical files through `qtool quantize` / `qtool dequantize` on
either path."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool.errors import UsageError
from qtool.numerics import kernels, select
from qtool.spec import PerGroup, QSpec, RangeMethod
from tests.conftest import Invoke

HAS_NUMBA = select.numba_installed()
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="numba not installed (qtool[fast])")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[select._Loader]:
    """Each test starts as a fresh process would: nothing loaded, nothing planned."""
    loader = select._Loader()
    monkeypatch.setattr(select, "_LOADER", loader)
    monkeypatch.setattr(select, "_METER", select._Meter())  # nor measured
    monkeypatch.delenv(select.ENV, raising=False)
    yield loader


@pytest.fixture
def no_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba made unimportable, as on a machine without the [fast] extra."""
    monkeypatch.setitem(sys.modules, "numba", None)  # type: ignore[arg-type]
    monkeypatch.delitem(sys.modules, "qtool.numerics.fused", raising=False)
    monkeypatch.delitem(sys.modules, "qtool.numerics.fused_jit", raising=False)


def weights() -> torch.Tensor:
    return torch.randn(64, 48, generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- QTOOL_KERNEL


@pytest.mark.parametrize(
    ("value", "kernel"),
    [("", select.Kernel.AUTO), ("auto", select.Kernel.AUTO), (" Torch ", select.Kernel.TORCH)],
    ids=["empty", "auto", "case-and-spaces"],
)
def test_requested_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, kernel: select.Kernel
) -> None:
    monkeypatch.setenv(select.ENV, value)
    assert select.requested() is kernel


def test_unknown_choice_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(select.ENV, "numba")
    with pytest.raises(UsageError, match="QTOOL_KERNEL='numba' is not one of auto, torch, fused"):
        select.expect(CPU, 0)


# ---------------------------------------------------------------- without numba


@pytest.mark.usefixtures("no_numba")
def test_auto_without_numba_runs_the_torch_kernels(fresh_loader: select._Loader) -> None:
    select.expect(CPU, 1 << 40)
    x = weights()
    got = kernels.quantize_with(x, QSpec())
    want = kernels.quantize_tensor(x, QSpec())
    assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
    assert not fresh_loader.tried and fresh_loader.module is None
    assert "qtool.numerics.fused" not in sys.modules


@pytest.mark.usefixtures("no_numba")
def test_fused_without_numba_is_a_usage_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(select.ENV, "fused")
    with pytest.raises(UsageError, match=r"install it with pip install 'qtool\[fast\]'"):
        select.expect(CPU, 0)
    with pytest.raises(UsageError, match="QTOOL_KERNEL=fused"):
        kernels.quantize_with(weights(), QSpec())


@pytest.mark.slow
def test_fused_without_numba_through_the_cli(tmp_path: Path) -> None:
    """Exit 2, one line naming the extra, no output written (numba blocked in the child)."""
    src = tmp_path / "w.safetensors"
    save_file({"w": weights()}, src)
    out = tmp_path / "q.safetensors"
    block = "import sys; sys.modules['numba'] = None; from qtool.cli import main; main()"
    args = [sys.executable, "-c", block, "quantize", str(src), "-o", str(out)]
    env = {**_env(), select.ENV: "fused"}
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'qtool[fast]'" in proc.stderr and proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != select.ENV}


# ---------------------------------------------------------------- with numba


@needs_numba
def test_auto_keeps_small_runs_on_torch(fresh_loader: select._Loader) -> None:
    select.expect(CPU, select.AUTO_MIN_BYTES - 1)
    kernels.quantize_with(weights(), QSpec())
    assert not fresh_loader.tried and fresh_loader.module is None


@needs_numba
def test_auto_uses_the_fused_kernels_for_big_runs(
    fresh_loader: select._Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = weights()
    before = kernels.quantize_with(x, QSpec())  # nothing expected yet: torch
    assert not fresh_loader.tried
    select.expect(CPU, select.AUTO_MIN_BYTES)
    assert fresh_loader.module is not None and fresh_loader.error is None
    calls: list[QSpec] = []
    real = fresh_loader.module.quantize_tensor

    def counting(t: torch.Tensor, spec: QSpec, **kw: object) -> kernels.QuantizedTensor:
        calls.append(spec)
        return real(t, spec, **kw)  # type: ignore[no-any-return]

    monkeypatch.setattr(fresh_loader.module, "quantize_tensor", counting)
    after = kernels.quantize_with(x, QSpec())
    assert calls == [QSpec()]
    assert torch.equal(before.q, after.q) and torch.equal(before.scale, after.scale)
    monkeypatch.setenv(select.ENV, "torch")
    kernels.quantize_with(x, QSpec())
    assert calls == [QSpec()]  # QTOOL_KERNEL=torch wins over a loaded fused module


@needs_numba
@pytest.mark.parametrize(
    "spec",
    [QSpec(granularity=PerGroup(8), range_method=RangeMethod.MSE), QSpec()],
    ids=["mse-group", "minmax-channel"],
)
def test_forced_fused_covers_what_it_supports_and_leaves_the_rest_to_torch(
    monkeypatch: pytest.MonkeyPatch, spec: QSpec
) -> None:
    monkeypatch.setenv(select.ENV, "fused")
    for x in (weights(), torch.tensor(0.5)):  # a 0-d tensor stays on torch
        got = kernels.quantize_with(x, spec if x.ndim else QSpec(granularity=PerGroup(2)))
        want = kernels.quantize_tensor(x, spec if x.ndim else QSpec(granularity=PerGroup(2)))
        assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)


@needs_numba
def test_broken_numba_leaves_auto_on_torch(
    fresh_loader: select._Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A numba that fails to import (say, a numpy it was not built for) costs nothing."""

    def broken(name: str) -> object:
        raise ImportError(f"{name}: numpy version mismatch")

    monkeypatch.setattr(select.importlib, "import_module", broken)
    select.expect(CPU, 1 << 40)
    got = kernels.quantize_with(weights(), QSpec())
    assert torch.equal(got.q, kernels.quantize_tensor(weights(), QSpec()).q)
    assert isinstance(fresh_loader.error, ImportError) and fresh_loader.module is None


# ---------------------------------------------------------------- the files are the same

CONFIGS = {
    "int8-channel": [],
    "asym-uint8-tensor": ["--scheme", "asym", "--dtype", "uint8", "--per-tensor"],
    "int4-group32-bf16": ["--dtype", "int4", "--group-size", "32"],
    "asym-uint4-group7-odd": ["--scheme", "asym", "--dtype", "uint4", "--group-size", "7"],
    "int8-mse-group64": ["--group-size", "64", "--range", "mse"],
    "int8-axis1": ["--axis", "1"],
}


@needs_numba
@pytest.mark.parametrize("options", list(CONFIGS.values()), ids=list(CONFIGS))
def test_both_paths_write_the_same_bytes(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: list[str]
) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {
        "a.weight": torch.randn(96, 130, generator=g),
        "b.weight": (torch.randn(40, 3, 5, generator=g) * 1e-3).to(torch.bfloat16),
        "c.weight": torch.randn(33, 65, generator=g).to(torch.float16),
        "c.bias": torch.randn(33, generator=g),
    }
    tensors["a.weight"][3] = 0.0
    src = tmp_path / "m.safetensors"
    save_file(tensors, src)
    outputs = {}
    for kernel in ("torch", "fused"):
        monkeypatch.setenv(select.ENV, kernel)
        out = tmp_path / kernel
        out.mkdir()
        assert invoke("quantize", str(src), "-o", str(out / "q.safetensors"), *options)[0] == 0
        assert (
            invoke("dequantize", str(out / "q.safetensors"), "-o", str(out / "d.safetensors"))[0]
            == 0
        )
        outputs[kernel] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert list(outputs["torch"]) == ["d.safetensors", "q.qparams.safetensors", "q.safetensors"]
    assert select._LOADER.module is not None  # the fused run did use the fused kernels
    assert outputs["torch"] == outputs["fused"]


@needs_numba
def test_dequantize_both_ways_of_one_file_agree(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same quantized file restored by either kernel, to every float dtype."""
    src = tmp_path / "m.safetensors"
    x = torch.randn(50, 70, generator=torch.Generator().manual_seed(2)) * 100
    save_file({"w": x}, src)
    assert (
        invoke("quantize", str(src), "-o", str(tmp_path / "q.safetensors"), "--scheme", "asym")[0]
        == 0
    )
    for dtype in ("float32", "bfloat16", "float16"):
        restored = []
        for kernel in ("torch", "fused"):
            monkeypatch.setenv(select.ENV, kernel)
            out = tmp_path / f"{kernel}-{dtype}.safetensors"
            assert (
                invoke(
                    "dequantize", str(tmp_path / "q.safetensors"), "-o", str(out), "--to", dtype
                )[0]
                == 0
            )
            restored.append(out.read_bytes())
        assert restored[0] == restored[1]


@needs_numba
@pytest.mark.parametrize(
    "options", [["--dtype", "int4", "--group-size", "32"], []], ids=["int4-group32", "int8"]
)
def test_both_paths_export_the_same_compressed_tensors_model(
    invoke: Invoke,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    samples: Path,
    options: list[str],
) -> None:
    """Scales rounded to the weight dtype (the compressed-tensors path) match too."""
    outputs = {}
    for kernel in ("torch", "fused"):
        monkeypatch.setenv(select.ENV, kernel)
        out = tmp_path / kernel / "model"
        out.parent.mkdir()
        llama = samples / "tiny-llama"
        assert (
            invoke(
                "quantize", str(llama), "--format", "compressed-tensors", "-o", str(out), *options
            )[0]
            == 0
        )
        outputs[kernel] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert "model.safetensors" in outputs["torch"]
    assert select._LOADER.module is not None  # the fused run did use the fused kernels
    assert outputs["torch"] == outputs["fused"]


def test_fused_with_an_unwritable_cache_names_numba_cache_dir(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """numba raises at import when neither NUMBA_CACHE_DIR, the package's __pycache__ nor
    ~/.cache can be written; auto then stays on torch, a forced choice says what to set."""

    def uncached(name: str) -> object:
        raise RuntimeError("cannot cache function '_key': no locator available for file 'x.py'")

    monkeypatch.setattr(select.importlib, "import_module", uncached)
    monkeypatch.setenv(select.ENV, "fused")
    with pytest.raises(UsageError, match="set NUMBA_CACHE_DIR to a writable directory"):
        select.expect(CPU, 0)
