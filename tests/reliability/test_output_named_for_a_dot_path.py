"""A model directory given as a path that does not end in its name (`.` from inside it,
`m/sub/..`) gets the default output its name gives, beside it, as `quantize m` does:
`cd m && quantize . --format gguf` was an internal error (ValueError: PosixPath('.') has an
empty name), from the default output's name and from the protected files' sidecar names,
for every type, with -o a directory too (the default name inside it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qtool.engine.plan import default_quantized_path
from tests.conftest import Invoke
from tests.formats.gguf.sp_models import build

pytest.importorskip("sentencepiece")
pytest.importorskip("gguf")


@pytest.mark.parametrize(
    ("given", "named"),
    [(".", "m"), ("m/.", "m"), ("m/sub/..", "m"), ("..", "m"), ("m", "m"), ("/", "model")],
)
def test_the_default_name_is_the_directorys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str, named: str
) -> None:
    cwd = tmp_path / "m" / "sub" if given == ".." else tmp_path / "m" if given == "." else tmp_path
    cwd.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(cwd)
    found = default_quantized_path(Path(given), "Q8_0", ".gguf")
    beside = Path("/") if given == "/" else tmp_path
    assert os.path.abspath(found) == str(beside / f"{named}.Q8_0.gguf")


@pytest.mark.parametrize("dtype", ["Q8_0", "F16"])
@pytest.mark.parametrize("to_dir", [False, True], ids=["default", "-o dir"])
def test_a_model_directory_given_as_dot_is_converted(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dtype: str, to_dir: bool
) -> None:
    src = build(tmp_path, "llama2")  # a Llama 2 directory, tmp_path/llama2
    before = sorted(p.name for p in src.iterdir())
    monkeypatch.chdir(src)
    outdir = tmp_path / "out"
    outdir.mkdir()
    args = ["-o", str(outdir)] if to_dir else []
    code, stdout, err = invoke("quantize", ".", "--format", "gguf", "--dtype", dtype,
                               "--json", *args)  # fmt: skip
    assert code == 0, err
    assert "internal error" not in err
    expected = (outdir if to_dir else tmp_path) / f"llama2.{dtype}.gguf"
    assert json.loads(stdout)["outputs"] == [str(expected)]
    assert expected.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in src.iterdir()) == before  # nothing written inside
