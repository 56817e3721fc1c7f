"""transformers imports torch._dynamo, which makes its compile cache, $TMPDIR/torchinductor_<user>,
as it is imported: a name anyone who can write to $TMPDIR may take first. A file planted there
failed a --target-kl run blaming the model's config.json (FileExistsError); a link was followed
into another directory, which torch then used. qtool points TORCHINDUCTOR_CACHE_DIR at a new
private directory of its own (engine/model/hf.py), removed once torch._dynamo is imported (a
link to a directory, followed, leaves no trace to test: torch writes there only to compile).
In a subprocess: the directory is made once per process, at the first import."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.test_target_kl_measured import TINY_LM, _imatrix

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("planted", ["file", "dangling-link"])
def test_a_planted_torch_cache_name_neither_fails_the_run_nor_is_used(
    tmp_path: Path, planted: str
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    name = temp / f"torchinductor_{getpass.getuser()}"
    if planted == "file":
        name.write_text("x")
    else:
        name.symlink_to(tmp_path / "nowhere" / "x")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env |= {"TMPDIR": str(temp), "PYTHONPATH": str(ROOT)}
    imatrix = _imatrix(tmp_path / "s.gguf")
    done = subprocess.run(
        [sys.executable, "-m", "qtool", "quantize", str(TINY_LM), "--target-kl", "0.01",
         "--imatrix", str(imatrix), "-o", str(tmp_path / "o"), "--threads", "1"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert (tmp_path / "o").is_dir()
    assert [p.name for p in temp.iterdir()] == [name.name]  # nothing of the run's left behind


def test_the_private_cache_name_is_not_left_in_the_environment(tmp_path: Path) -> None:
    """Once its directory is removed, TORCHINDUCTOR_CACHE_DIR no longer names it: a later
    torch.compile in the same process (a library caller), or a child process, would make the
    directory again under a name others have seen in $TMPDIR."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env |= {"TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = ("import os; from qtool.engine.model.hf import transformers_module; "
            "transformers_module(); print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
