"""--save-recipe and --tensor-type-file are outputs of the run like -o: checked with it before any
work (never an input, the recipe included; no collision with another output; nothing replaced
without --force; only regular files replaced; never inside an output directory qtool writes
whole), written through the atomic writer (a link is replaced, never followed; no predictable
temp name), and only once the run's own outputs are committed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from qtool.errors import InputError
from tests.conftest import Invoke

TINY = Path(__file__).resolve().parents[2] / "sample_weights"
GGUF_RUN = ("--format", "gguf", "--target-bpw", "5", "--threads", "1", "--json")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    src = tmp_path / "m.gguf"
    shutil.copyfile(TINY / "tiny-llama.gguf", src)
    return src


def _refused(invoke: Invoke, *args: str) -> str:
    """The run's one-line JSON error (exit 1, as -o's), stdout empty."""
    code, out, err = invoke("quantize", *args)
    assert (code, out) == (1, ""), err
    error = json.loads(err)["error"]
    assert error["code"] == "output"
    return str(error["message"])


@pytest.mark.parametrize("flag", ["--save-recipe", "--tensor-type-file"])
@pytest.mark.parametrize("victim", ["model", "recipe", "itself as -o"])
@pytest.mark.parametrize("dry", [(), ("--dry-run", "--estimate")], ids=["run", "dry-run"])
def test_a_plan_file_never_replaces_an_input_or_another_output(
    invoke: Invoke, tmp_path: Path, model: Path, flag: str, victim: str, dry: tuple[str, ...]
) -> None:
    recipe = tmp_path / "in.toml"
    recipe.write_text("# no rules\n")
    out = tmp_path / "o.gguf"
    path = {"model": model, "recipe": recipe, "itself as -o": out}[victim]
    before = {p: p.read_bytes() for p in (model, recipe)}
    message = _refused(invoke, str(model), *GGUF_RUN, "--recipe", str(recipe), "-o", str(out),
                       flag, str(path), "--force", *dry)  # fmt: skip
    wanted = "two outputs of this run" if victim == "itself as -o" else "would overwrite the input"
    assert wanted in message
    assert {p: p.read_bytes() for p in (model, recipe)} == before
    assert not out.exists()


def test_the_two_plan_files_never_share_a_path(invoke: Invoke, tmp_path: Path, model: Path) -> None:
    plan = tmp_path / "plan.txt"
    message = _refused(invoke, str(model), *GGUF_RUN, "-o", str(tmp_path / "o.gguf"),
                       "--save-recipe", str(plan), "--tensor-type-file", str(plan))  # fmt: skip
    assert "two outputs of this run" in message
    assert not plan.exists()


def test_a_plan_file_replaces_only_regular_files_and_only_when_asked(
    invoke: Invoke, tmp_path: Path, model: Path
) -> None:
    """An existing file needs --force; a FIFO or a directory is refused even with it; a link to
    a file is replaced by a new file, the file it named untouched."""
    out = str(tmp_path / "o.gguf")
    existing = tmp_path / "exists.toml"
    existing.write_text("mine\n")
    message = _refused(invoke, str(model), *GGUF_RUN, "-o", out, "--save-recipe", str(existing))
    assert "already exists" in message and existing.read_text() == "mine\n"
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    message = _refused(invoke, str(model), *GGUF_RUN, "-o", out, "--save-recipe", str(fifo),
                       "--force")  # fmt: skip
    assert "not a regular file" in message
    message = _refused(invoke, str(model), *GGUF_RUN, "-o", out, "--save-recipe", str(tmp_path),
                       "--force")  # fmt: skip
    assert "is a directory" in message
    victim, link = tmp_path / "victim.txt", tmp_path / "link.toml"
    victim.write_text("precious\n")
    link.symlink_to(victim)
    code, _, err = invoke("quantize", str(model), *GGUF_RUN, "-o", out, "--save-recipe",
                          str(link), "--force")  # fmt: skip
    assert code == 0, err
    assert victim.read_text() == "precious\n"
    assert not link.is_symlink() and link.read_text().startswith("# qtool allocation")


def test_a_plan_file_is_written_through_no_predictable_temp_name(
    invoke: Invoke, tmp_path: Path, model: Path
) -> None:
    """A link planted where a temp name `.NAME.tmpPID` would be is never written through (the
    atomic writer creates its temp with O_EXCL|O_NOFOLLOW under a random name)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    plan = tmp_path / "plan.toml"
    trap = tmp_path / f".{plan.name}.tmp{os.getpid()}"
    trap.symlink_to(victim)
    code, _, err = invoke("quantize", str(model), *GGUF_RUN, "-o", str(tmp_path / "o.gguf"),
                          "--save-recipe", str(plan))  # fmt: skip
    assert code == 0, err
    assert victim.read_text() == "precious\n"
    assert plan.read_text().startswith("# qtool allocation")
    leftovers = [p.name for p in tmp_path.iterdir() if "qtool-tmp" in p.name]
    assert leftovers == []


@pytest.mark.parametrize("again", [False, True], ids=["new", "forced-over-previous"])
def test_a_plan_file_never_goes_inside_a_model_directory_output(
    invoke: Invoke, tmp_path: Path, again: bool
) -> None:
    """A recipe inside the compressed-tensors export would be lost when the directory is
    published, or block the next --force (not a file of the export): refused up front."""
    out = tmp_path / "ct"
    run = [str(TINY / "tiny-llama"), "--format", "compressed-tensors", "--target-size", "0.09MB",
           "--threads", "1", "--json", "-o", str(out)]  # fmt: skip
    if again:
        code, _, err = invoke("quantize", *run)
        assert code == 0, err
    listed = sorted(p.name for p in out.iterdir()) if again else None
    message = _refused(invoke, *run, "--save-recipe", str(out / "plan.toml"), "--force")
    assert "lies inside the output directory" in message
    assert (sorted(p.name for p in out.iterdir()) if again else None) == listed
    if again:  # and the export is still one --force replaces
        code, _, err = invoke("quantize", *run, "--force")
        assert code == 0, err


def test_a_failed_run_leaves_no_plan_file(
    invoke: Invoke, tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan files are written after the outputs are committed: a run failing while it
    writes the output (after the allocation decided) writes neither."""
    import qtool.engine.loop as loop

    def fail(*args: object, **kwargs: object) -> None:
        raise InputError(model, "cannot read this tensor")

    monkeypatch.setattr(loop, "write_shard", fail)
    recipe, types = tmp_path / "plan.toml", tmp_path / "types.txt"
    code, _, _ = invoke("quantize", str(model), *GGUF_RUN, "-o", str(tmp_path / "o.gguf"),
                        "--save-recipe", str(recipe), "--tensor-type-file", str(types))  # fmt: skip
    assert code == 1
    assert not recipe.exists() and not types.exists()
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "console"])
@pytest.mark.parametrize("dry", [(), ("--dry-run", "--estimate")], ids=["run", "dry-run"])
def test_the_plan_files_are_listed_as_outputs_and_a_dry_run_writes_none(
    invoke: Invoke, tmp_path: Path, model: Path, as_json: bool, dry: tuple[str, ...]
) -> None:
    """Every file the run writes is reported beside the model (JSON `outputs`, the console's
    "wrote ..."); a dry run reports the same files as "would write" and writes none of them."""
    out, recipe, types = tmp_path / "o.gguf", tmp_path / "plan.toml", tmp_path / "types.txt"
    args = GGUF_RUN if as_json else GGUF_RUN[:-1]
    code, stdout, err = invoke("quantize", str(model), *args, "-o", str(out), "--save-recipe",
                               str(recipe), "--tensor-type-file", str(types), *dry)  # fmt: skip
    assert code == 0, err
    files = [out, recipe, types]
    if as_json:
        document = json.loads(stdout)
        assert document["outputs"] == [str(p) for p in files]
        assert document["dry_run"] is bool(dry)
    else:
        text = " ".join(stdout.split())
        verb = "would write" if dry else "wrote"
        assert f"{verb} {out}, {recipe}, {types}" in text
    assert [p.exists() for p in files] == [not dry] * 3
