"""quantize's files written beside its outputs (--save-recipe, --tensor-type-file, --plot) are
never new files inside the input model's directory, as calibrate's -o and eval's --save-logits
are not: a stray file there changes the model (a *.safetensors.index.json makes it sharded).
Refused before any work, every route (the engine's directory outputs, the HF-to-GGUF
conversion), with nothing written; only an existing input file was refused before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import Invoke

TINY = Path(__file__).resolve().parents[2] / "sample_weights" / "tiny-llama"
ROUTES = {  # output format -> (-o name, the plan file flags it takes)
    "qtool": ("q", ["--save-recipe"]),
    "compressed-tensors": ("ct", ["--save-recipe"]),
    "gguf": ("q.gguf", ["--save-recipe", "--tensor-type-file"]),  # converted from HF first
}
CASES = [(fmt, flag) for fmt, (_, flags) in ROUTES.items() for flag in flags]


@pytest.mark.parametrize(("fmt", "flag"), CASES)
@pytest.mark.parametrize("dry", [(), ("--dry-run", "--estimate")], ids=["run", "dry-run"])
@pytest.mark.parametrize("where", ["top", "via a subdirectory's .."])
def test_a_plan_file_is_never_a_new_file_in_the_model_directory(
    invoke: Invoke, tmp_path: Path, fmt: str, flag: str, dry: tuple[str, ...], where: str
) -> None:
    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    (model / "sub").mkdir()
    plan = model / "plan.txt" if where == "top" else model / "sub" / ".." / "plan.txt"
    before = sorted(p.name for p in model.iterdir())
    out = tmp_path / ROUTES[fmt][0]
    code, stdout, err = invoke("quantize", str(model), "--format", fmt, "--target-bpw", "5",
                               "-o", str(out), flag, str(plan), "--threads", "1", "--json",
                               *dry)  # fmt: skip
    assert (code, stdout) == (1, ""), err
    error = json.loads(err)["error"]
    assert error["code"] == "output"
    assert str(plan) in error["message"] and "inside the input directory" in error["message"]
    assert sorted(p.name for p in model.iterdir()) == before
    assert not out.exists()


def test_a_plot_is_never_a_new_file_in_the_model_directory(invoke: Invoke, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    code, stdout, err = invoke("quantize", str(model), "-o", str(tmp_path / "q"),
                               "--plot", str(model / "p.png"), "--threads", "1")  # fmt: skip
    assert (code, stdout) == (1, ""), err
    assert "inside the input directory" in err
    assert not (model / "p.png").exists()


def test_a_plan_file_beside_the_model_directory_is_written(invoke: Invoke, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    recipe = tmp_path / "m.recipe.toml"  # a sibling whose name starts like the directory's
    code, _, err = invoke("quantize", str(model), "--format", "qtool", "--target-bpw", "5",
                          "-o", str(tmp_path / "q"), "--save-recipe", str(recipe),
                          "--threads", "1")  # fmt: skip
    assert code == 0, err
    assert recipe.read_text().strip()
