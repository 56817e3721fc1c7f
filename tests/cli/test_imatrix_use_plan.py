"""quantize --imatrix-use plan: the importance matrix chooses each tensor's spec (its statistics
weigh the allocation's output errors, its sensitivities the loss) while the codes are those of
a run without it, so the saved recipe alone writes the same bytes and the output claims no
imatrix; misuse is a one-line error."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from qtool.formats.imatrix import write_imatrix
from qtool.formats.imatrix.sensitivity import Sensitivities, sensitivity_keys
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from tests.conftest import Invoke

TINY = Path(__file__).resolve().parents[2] / "sample_weights"
WIDTHS = {"attn_q": 64, "attn_k": 64, "attn_v": 64, "attn_output": 64, "ffn_gate": 64,
          "ffn_up": 64, "ffn_down": 128}  # fmt: skip


def _imatrix(path: Path, alpha: dict[str, float] | None) -> Path:
    """An imatrix for tiny-llama (llama.cpp's names) whose column weights differ by orders of
    magnitude, so weighing a range search changes its codes; sensitivities `alpha` if given."""
    rng = np.random.default_rng(7)
    entries = {
        f"blk.{b}.{k}.weight": MatrixStats(
            (10.0 ** rng.uniform(-3, 3, (1, w))).astype(np.float32), np.array([3])
        )
        for b in range(2)
        for k, w in WIDTHS.items()
    }
    extra = sensitivity_keys(Sensitivities(alpha, "test", 100, None)) if alpha else None
    write_imatrix(path, ImportanceMatrix(entries, 512, 1, ("t.txt",)), extra)
    return path


def _alpha(steep: str | None = None) -> dict[str, float]:
    alpha = {f"blk.{b}.{k}.weight": 1e-3 for b in range(2) for k in WIDTHS}
    alpha |= {"token_embd.weight": 1e-3, "output.weight": 1e-3}  # else kept float: no alpha
    if steep is not None:
        alpha[steep] = 1e3
    return alpha


def _run(invoke: Invoke, *args: str) -> Any:
    code, out, err = invoke("quantize", *args, "--threads", "1", "--json")
    assert code == 0, err
    return json.loads(out)


def _tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    """Every tensor the output holds (codes, scales, zero points, kept floats) with its type,
    and the sidecar's qparams: what the codes are, not the provenance metadata beside them
    (a plan-only run records the imatrix's text, which chose the plan)."""
    if path.is_file():
        reader = gguf.GGUFReader(path)
        return {t.name: (t.tensor_type.name, t.data.tobytes()) for t in reader.tensors}
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            found |= {k: (str(f.get_tensor(k).dtype), _raw(f.get_tensor(k))) for k in f.keys()}  # noqa: SIM118
            qparams = (f.metadata() or {}).get("qtool.qparams")
            if qparams is not None:
                found[f"{file.name}:qparams"] = ("json", qparams.encode())
    return found


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    ("src", "fmt", "target"),
    [
        ("tiny-llama", "qtool", ("--target-size", "60KiB")),
        ("tiny-llama.gguf", "gguf", ("--target-bpw", "5")),
    ],
    ids=["qtool", "gguf"],
)
def test_the_codes_are_unweighted_and_the_recipe_alone_reproduces_them(
    invoke: Invoke, tmp_path: Path, src: str, fmt: str, target: tuple[str, str]
) -> None:
    """plan: the saved recipe run without any imatrix writes the same tensors, byte for byte.
    all (the default): its recipe without the imatrix writes other codes, so the weights
    used here do change codes and the first equality is no accident."""
    imatrix = _imatrix(tmp_path / "s.gguf", _alpha())
    suffix = ".gguf" if fmt == "gguf" else ""
    common = [str(TINY / src), "--format", fmt]
    any_type = ["--dtype", "Q8_0"] if fmt == "gguf" else []
    outs = {}
    for use in ("plan", "all"):
        out, recipe = tmp_path / f"{use}{suffix}", tmp_path / f"{use}.toml"
        doc = _run(invoke, *common, *target, "--imatrix", str(imatrix), "--imatrix-use", use,
                   "-o", str(out), "--save-recipe", str(recipe))  # fmt: skip
        again = tmp_path / f"{use}-recipe{suffix}"
        _run(invoke, *common, *any_type, "--recipe", str(recipe), "-o", str(again))
        outs[use] = (_tensors(out), _tensors(again), doc, recipe.read_text())
    plan_out, plan_again, plan_doc, plan_recipe = outs["plan"]
    all_out, all_again, _, all_recipe = outs["all"]
    assert plan_out == plan_again
    assert all_out != all_again
    assert "--imatrix-use plan" in plan_recipe and "this recipe alone" in plan_recipe
    assert "the same bytes need that" in all_recipe
    assert plan_doc["imatrix"]["use"] == "plan"
    assert any("the codes are unweighted" in n for n in plan_doc["notes"])
    if fmt == "gguf":  # llama.cpp's keys say an imatrix weighed the codes: not here
        assert b"quantize.imatrix" not in (tmp_path / "plan.gguf").read_bytes()
        assert b"quantize.imatrix" in (tmp_path / "all.gguf").read_bytes()


def test_the_plan_follows_the_sensitivities(invoke: Invoke, tmp_path: Path) -> None:
    """A Linear with a large alpha gets more bytes than the same Linear when another one is
    the sensitive one: the imatrix still steers the plan when it weighs no code."""
    name = "model.layers.1.mlp.down_proj.weight"
    spent = {}
    for label, steep in (("down", "blk.1.ffn_down.weight"), ("q", "blk.0.attn_q.weight")):
        imatrix = _imatrix(tmp_path / f"{label}.gguf", _alpha(steep))
        doc = _run(invoke, str(TINY / "tiny-llama"), "--target-size", "56KiB", "--imatrix",
                   str(imatrix), "--imatrix-use", "plan", "-o", str(tmp_path / label))  # fmt: skip
        row = next(t for t in doc["tensors"] if t["name"] == name)
        # the reason names the candidate's bytes as written, codes and qparams (bytes_out: codes)
        found = re.search(r"(\d+) bytes$", row["decided_by"]["reason"])
        assert found is not None
        spent[label] = int(found.group(1))
    assert spent["down"] > spent["q"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--target-size", "60KiB", "--imatrix-use", "plan"], "add --imatrix FILE"),
        (["--imatrix-use", "plan", "--range", "mse", "--imatrix", "IM"], "guides an allocation"),
    ],
    ids=["no-imatrix", "no-target"],
)
def test_misuse_is_one_line(invoke: Invoke, tmp_path: Path, args: list[str], says: str) -> None:
    imatrix = _imatrix(tmp_path / "s.gguf", None)
    args = [str(imatrix) if a == "IM" else a for a in args]
    code, out, err = invoke("quantize", str(TINY / "tiny-llama"), "-o", str(tmp_path / "o"),
                            *args)  # fmt: skip
    assert code == 2 and out == "", err
    assert says in " ".join(err.split())
    assert not (tmp_path / "o").exists()


def test_a_library_caller_gets_the_same_refusal(tmp_path: Path) -> None:
    """QuantizeOptions itself refuses an imatrix that weighs no code without a plan to guide
    (the CLI's check is not the only one)."""
    from qtool.engine.plan import QuantizeOptions
    from qtool.errors import UsageError

    imatrix = _imatrix(tmp_path / "s.gguf", None)
    with pytest.raises(UsageError, match="only guides an allocation"):
        QuantizeOptions(imatrix=imatrix, imatrix_weighs_codes=False)
    with pytest.raises(UsageError, match="only guides an allocation"):
        QuantizeOptions(imatrix_weighs_codes=False)
