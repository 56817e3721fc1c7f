from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from qtool.errors import InputError, UnsafeInputError
from qtool.io import writer as io_writer
from qtool.io.checkpoint import (
    READ_GAP,
    TORCH_TO_ST,
    open_checkpoint,
    tensor_bytes,
)
from qtool.io.stformat import build_header
from qtool.io.writer import StreamingWriter


def test_streaming_writer_output_is_byte_identical_to_save_file() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(33, 7, generator=gen),
        "a.bias": torch.randn(7, generator=gen).to(torch.bfloat16),
        "codes": torch.randint(-128, 127, (5, 5), generator=gen, dtype=torch.int8),
        "ids": torch.arange(9),
        "flag": torch.tensor(True),
        "empty": torch.zeros(0, 3),
    }
    specs = [(n, TORCH_TO_ST[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    header_bytes, header = build_header(specs, {"format": "pt"})
    buf = io.BytesIO()
    writer = StreamingWriter(buf, header_bytes, header)
    for entry in header.tensors:
        writer.write(entry.name, tensor_bytes(tensors[entry.name]))
    writer.finish()
    assert buf.getvalue() == save(tensors, metadata={"format": "pt"})


def test_streaming_writer_refuses_out_of_order_or_missing_tensors() -> None:
    header_bytes, header = build_header([("a", "F32", (2,)), ("b", "F32", (2,))])
    writer = StreamingWriter(io.BytesIO(), header_bytes, header)
    with pytest.raises(AssertionError):
        writer.write("b", memoryview(b"\0" * 8))
    writer = StreamingWriter(io.BytesIO(), header_bytes, header)
    writer.write("a", memoryview(b"\0" * 8))
    with pytest.raises(AssertionError):
        writer.finish()


def test_safetensors_tensors_are_zero_copy_views(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, path)
    ckpt = open_checkpoint(path)
    t = ckpt.tensor(ckpt.entries[0])
    assert t.tolist() == torch.arange(12.0).reshape(3, 4).tolist()
    assert bytes(ckpt.raw(ckpt.entries[0])) == t.numpy().tobytes()
    ckpt.close()


@pytest.mark.parametrize(
    "wrap",
    [lambda sd: sd, lambda sd: {"state_dict": sd, "epoch": 3}, lambda sd: {"model": sd}],
    ids=["flat", "state_dict", "model"],
)
def test_pickle_state_dicts_and_wrappers(tmp_path: Path, wrap: object) -> None:
    sd = {"w": torch.randn(3, 3), "b": torch.randn(3)}
    path = tmp_path / "m.pt"
    torch.save(wrap(sd), path)  # type: ignore[operator]
    ckpt = open_checkpoint(path)
    assert {e.name for e in ckpt.entries} == {"w", "b"}
    assert torch.equal(ckpt.tensor(ckpt.by_name()["w"]), sd["w"])


def test_non_tensor_entries_are_skipped_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2, 2), "note": "hello", "step": 5}, path)
    ckpt = open_checkpoint(path)
    assert [e.name for e in ckpt.entries] == ["w"]
    assert ckpt.skipped == ["note", "step"]


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Exploit(marker)}, path)
    with pytest.raises(UnsafeInputError, match="refused.*system"):
        open_checkpoint(path)
    assert not marker.exists()


def test_legacy_pickle_with_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps({"x": _Exploit(marker)}, protocol=2))
    with pytest.raises(InputError):
        open_checkpoint(path)
    assert not marker.exists()


def test_compressed_archive_member_is_refused_as_a_zip_bomb(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(1000)}, src)
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    with pytest.raises(UnsafeInputError, match="compressed"):
        open_checkpoint(bomb)


def test_pickle_named_safetensors_is_never_unpickled(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(InputError, match="pickle"):
        open_checkpoint(path)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_and_truncated_archives(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({"w": torch.randn(100)}, src)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(src.read_bytes()[:-200])
    with pytest.raises(InputError, match="corrupt|truncated"):
        open_checkpoint(cut)
    script = tmp_path / "script.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), script)
    with pytest.raises(InputError):
        open_checkpoint(script)


def test_tied_tensors_are_read_under_both_names(tmp_path: Path) -> None:
    embed = torch.randn(8, 4)
    torch.save({"embed.weight": embed, "lm_head.weight": embed}, tmp_path / "tied.pt")
    ckpt = open_checkpoint(tmp_path / "tied.pt")
    a, b = (ckpt.tensor(ckpt.by_name()[n]) for n in ("embed.weight", "lm_head.weight"))
    assert torch.equal(a, b) and torch.equal(a, embed)


def test_views_of_a_larger_storage_write_only_their_elements(tmp_path: Path) -> None:
    big = torch.arange(100, dtype=torch.float32)
    torch.save({"w": big[10:16].view(2, 3)}, tmp_path / "view.pt")
    ckpt = open_checkpoint(tmp_path / "view.pt")
    entry = ckpt.entries[0]
    assert entry.nbytes == 24 and bytes(ckpt.raw(entry)) == big[10:16].numpy().tobytes()


def test_old_torch_is_refused_for_pickles_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qtool.io.checkpoint as checkpoint

    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    called = []
    monkeypatch.setattr(checkpoint, "torch_version", lambda: (2, 9))
    monkeypatch.setattr(torch, "load", lambda *a, **k: called.append(1))
    with pytest.raises(UnsafeInputError, match="torch >= 2.10"):
        open_checkpoint(tmp_path / "m.pt")
    assert called == []
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    assert open_checkpoint(tmp_path / "m.safetensors").entries  # safetensors unaffected


def test_env_cannot_turn_off_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "pwned"
    torch.save({"x": _Exploit(marker)}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeInputError):
        open_checkpoint(tmp_path / "evil.pt")
    assert not marker.exists()


def test_every_torch_load_passes_weights_only_true_literally() -> None:
    """A static guard: no code path may ever load a pickle without weights_only=True."""
    import ast

    package = Path(__file__).parents[2] / "qtool"
    calls = 0
    for source in package.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.load", "load"):
                kw = {k.arg: k.value for k in node.keywords}
                assert isinstance(kw.get("weights_only"), ast.Constant), source
                assert kw["weights_only"].value is True, source  # type: ignore[attr-defined]
                calls += 1
        assert "pickle.load" not in source.read_text()
        assert "add_safe_globals" not in source.read_text()
    assert calls == 1


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_reading_several_tensors_at_once_gives_each_as_read_alone(
    tmp_path: Path, suffix: str
) -> None:
    """Tensors read together (one pread per run of nearby tensors) equal one-by-one reads, in
    the order asked for, across gaps wider than READ_GAP and every dtype."""
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5).bfloat16(),
        "c": torch.zeros(READ_GAP // 2 + 7, dtype=torch.uint8),  # a gap if skipped
        "d": torch.randn(2, 2).half(),
        "e": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "f": torch.randn(0, 3),
        "g": torch.randn(7).double(),
    }
    path = tmp_path / f"m{suffix}"
    save_file(tensors, path) if suffix == ".safetensors" else torch.save(tensors, path)
    ckpt = open_checkpoint(path)
    entries = ckpt.by_name()
    wanted = [entries[n] for n in ("g", "a", "d", "b", "f", "e")]
    together = ckpt.tensors(wanted)
    for entry, t in zip(wanted, together, strict=True):
        alone = ckpt.tensor(entry)
        assert t.dtype == alone.dtype and t.shape == alone.shape and torch.equal(t, alone)
        assert torch.equal(t, tensors[entry.name])


def test_reading_several_tensors_of_a_file_cut_short_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(4, 4) for i in range(10)}, path)
    ckpt = open_checkpoint(path)
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(InputError, match="changed while reading"):
        ckpt.tensors(list(ckpt.entries))


def test_large_tensors_are_handed_to_the_disk_as_they_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tensor of at least WRITEBACK_MIN_BYTES starts its own writeback (its exact byte
    range), so the commit's fsync has little left; the file's bytes are unchanged."""
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(
        io_writer, "_FADVISE", lambda fd, off, n, advice: calls.append((off, n, advice))
    )
    big = io_writer.WRITEBACK_MIN_BYTES // 4
    tensors = {"a": torch.randn(big), "b": torch.randn(3), "c": torch.randn(big + 5)}
    specs = [(n, TORCH_TO_ST[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    header_bytes, header = build_header(specs)
    path = tmp_path / "out.safetensors"
    with open(path, "wb") as f:
        writer = StreamingWriter(f, header_bytes, header)
        for entry in header.tensors:
            writer.write(entry.name, tensor_bytes(tensors[entry.name]))
        writer.finish()
    assert path.read_bytes() == save(tensors)
    start = len(header_bytes)
    by_name = header.by_name()
    assert calls == [
        (start + by_name[n].begin, by_name[n].nbytes, os.POSIX_FADV_DONTNEED) for n in ("a", "c")
    ]
