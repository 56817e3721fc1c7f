"""`qtool eval ... --save-logits FILE` is an output like any other qtool output: it replaces an
existing file (or link) only with --force, never lands in a model's directory (a new file there
changes the model), appears only once the whole run is done (an interrupt leaves nothing), and
a write error is one line naming it; the same QUANT twice is a usage error. Tiny models built
offline (tests/eval_models.py); needs the interop extra."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

REASON = "needs the interop extra: pip install -c constraints.txt -e '.[interop]'"
pytest.importorskip("transformers", reason=REASON)

import torch  # noqa: E402

from qtool import api  # noqa: E402
from qtool.engine.evaluate import many  # noqa: E402
from qtool.engine.evaluate.quant import load_quant  # noqa: E402
from qtool.errors import OutputError, UsageError  # noqa: E402
from qtool.spec import FormatName, PerChannel, QSpec, Scheme, StorageDtype  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.eval_models import build  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

TEXT = "Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!\n" * 8


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    r = tmp_path_factory.mktemp("save")
    (r / "text.txt").write_text(TEXT)
    build(r / "llama", "llama")
    spec = QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(0))
    api.quantize(
        r / "llama", r / "q8", api.QuantizeOptions(spec, (), format=FormatName.QTOOL), device="cpu"
    )
    torch.set_num_threads(before)
    return r


def args(root: Path, out: Path, *quants: str) -> list[str]:
    return ["eval", str(root / "llama"), *(str(root / q) for q in quants), "--save-logits",
            str(out), "--text", str(root / "text.txt"), "--tokens", "100", "--ctx", "32",
            "--threads", "1"]  # fmt: skip


def one_line_error(code: int, out: str, err: str, *words: str) -> None:
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err


def test_an_existing_file_or_link_is_replaced_only_with_force(
    root: Path, invoke: Invoke, tmp_path: Path
) -> None:
    """It replaced any file silently; a dangling link too (the global rule: --force)."""
    existing = tmp_path / "notes.txt"
    existing.write_text("mine")
    dangling = tmp_path / "dangling.qlogits"
    dangling.symlink_to(tmp_path / "nowhere")
    for target in (existing, dangling):
        one_line_error(*invoke(*args(root, target)), str(target), "--force")
    assert existing.read_text() == "mine" and dangling.is_symlink()
    code, _, err = invoke(*args(root, existing), "--force")
    assert code == 0 and existing.read_bytes().startswith(b"QTLOGITS"), err


def test_never_a_new_file_in_a_model_directory(root: Path, invoke: Invoke, tmp_path: Path) -> None:
    """A new *.safetensors.index.json in FLOAT's or a QUANT's directory made it a sharded model
    (broken): refused whatever the spelling (a link to the directory included)."""
    link = tmp_path / "link"
    link.symlink_to(root / "llama")
    names = [root / "llama" / "model.safetensors.index.json",
             link / "new.qlogits", root / "q8" / "x.qlogits"]  # fmt: skip
    for target in names:
        one_line_error(*invoke(*args(root, target, "q8"), "--force"), "model directory")
        assert not os.path.lexists(target)


def test_the_same_quant_twice_is_a_usage_error(root: Path, tmp_path: Path) -> None:
    link = tmp_path / "again"
    link.symlink_to(root / "q8")
    opts = api.EvalOptions(root / "text.txt", 100, 32, threads=1)
    with pytest.raises(UsageError, match="give each QUANT once"):
        api.evaluate_all(root / "llama", [root / "q8", link], opts)


def test_nothing_is_written_before_the_last_candidate_is_done(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt while a candidate runs ("no output was written") left the file replaced;
    it is renamed into place after the last candidate, and no temp stays."""
    out = tmp_path / "f.qlogits"
    out.write_text("before")
    loaded: list[Path] = []

    def interrupted(path: Path, *a: Any) -> Any:
        loaded.append(path)
        if len(loaded) == 2:
            raise KeyboardInterrupt
        return load_quant(path, *a)

    monkeypatch.setattr(many, "load_quant", interrupted)
    opts = api.EvalOptions(root / "text.txt", 100, 32, threads=1)
    with pytest.raises(KeyboardInterrupt):
        api.evaluate_all(root / "llama", [root / "q8", root / "llama"], opts, None, None, out,
                         force=True)  # fmt: skip
    assert len(loaded) == 2 and out.read_text() == "before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.qlogits"]


def test_a_write_error_is_one_line_naming_the_file(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file-size limit (ulimit -f) or a full disk was "internal error: OSError"."""
    out = tmp_path / "f.qlogits"

    def too_large(*a: Any) -> None:
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(many, "write_logits", too_large)
    opts = api.EvalOptions(root / "text.txt", 100, 32, threads=1)
    with pytest.raises(OutputError, match="file too large") as err:
        api.evaluate_all(root / "llama", [root / "q8"], opts, None, None, out)
    message = str(err.value)
    assert err.value.path == str(out) and "\n" not in message and "with -o" not in message
    assert list(tmp_path.iterdir()) == []
