"""Issue 18 item 2: a directory output carries the input's subdirectories a user expects
(sentence-transformers module directories, other directories of plain files) under the rules of
companions, says what it left behind and why, and `--force` replaces them only as qtool wrote
them. The hostile cases are the ones a local attacker would try: links, FIFOs, deep and wide
trees, huge and growing files, a directory swapped for a link between listing and copying."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from qtool import api
from qtool.api import QuantizeOptions
from qtool.engine import companions as comp
from qtool.errors import InputError, OutputError
from qtool.formats.compressed_tensors import config as ct_config
from qtool.formats.compressed_tensors import loaders
from qtool.io.safeopen import InputDir
from tests.conftest import SAMPLES, Invoke

CT = ("--format", "compressed-tensors")
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    {
        "idx": 3,
        "name": "3",
        "path": "3_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """tiny-llama in sentence-transformers layout, with the subdirectories real models have."""
    m = tmp_path / "m"
    shutil.copytree(SAMPLES / "tiny-llama", m)
    (m / "modules.json").write_text(json.dumps(MODULES))
    (m / "1_Pooling").mkdir()
    (m / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 64}')
    (m / "2_Dense").mkdir()
    (m / "2_Dense" / "config.json").write_text('{"in_features": 64}')
    (m / "2_Dense" / "model.safetensors").write_bytes(b"dense weights")  # the module's own
    (m / "3_Normalize").mkdir()  # empty, as sentence-transformers saves it
    (m / "additional_chat_templates").mkdir()
    (m / "additional_chat_templates" / "tool.jinja").write_text("{{ x }}")
    (m / "onnx").mkdir()
    (m / "onnx" / "model.onnx").write_bytes(b"float model again")
    (m / "onnx" / "config.json").write_text("{}")
    (m / ".git").mkdir()
    (m / ".git" / "HEAD").write_text("ref")
    return m


def tree(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) + ("/" if p.is_dir() else "")
        for p in root.rglob("*")
        if not p.name.endswith(".safetensors") or p.parent != root
    )


EXPECTED = [
    ".qtool-export.json",
    "1_Pooling/",
    "1_Pooling/config.json",
    "2_Dense/",
    "2_Dense/config.json",
    "2_Dense/model.safetensors",
    "3_Normalize/",
    "additional_chat_templates/",
    "additional_chat_templates/tool.jinja",
    "config.json",
    "generation_config.json",
    "modules.json",
]


@pytest.mark.parametrize("fmt", [(), CT], ids=["qtool", "compressed-tensors"])
def test_module_and_plain_subdirectories_are_copied_and_weights_elsewhere_are_not(
    invoke: Invoke, model: Path, tmp_path: Path, fmt: tuple[str, ...]
) -> None:
    out = tmp_path / "out"
    code, _, err = invoke("quantize", str(model), *fmt, "-o", str(out))
    assert code == 0, err
    assert tree(out) == EXPECTED
    assert (out / "2_Dense" / "model.safetensors").read_bytes() == b"dense weights"
    assert (
        err.count("not copied") == 1 and "onnx/: not copied: holds weights (onnx/model.onnx)" in err
    )
    manifest = json.loads((out / ".qtool-export.json").read_text())
    assert "1_Pooling/config.json" in manifest["files"]
    assert manifest["directories"] == [
        "1_Pooling", "2_Dense", "3_Normalize", "additional_chat_templates"
    ]  # fmt: skip
    # --force replaces the export it wrote, subdirectories and all
    code, _, err = invoke("quantize", str(model), *fmt, "-o", str(out), "--force")
    assert code == 0, err
    assert tree(out) == EXPECTED
    # and the dequantized directory carries them too
    back = tmp_path / "back"
    code, _, err = invoke("dequantize", str(out), "-o", str(back))
    assert code == 0, err
    assert "1_Pooling/config.json" in tree(back) and "3_Normalize/" in tree(back)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda o: (o / "1_Pooling" / "extra.txt").write_text("mine"), "1_Pooling/extra.txt"),
        (lambda o: (o / "1_Pooling" / "config.json").write_text("edited"), "1_Pooling/config.json"),
        (lambda o: (o / "3_Normalize" / "notes").mkdir(), "3_Normalize/notes/"),
        (lambda o: (shutil.rmtree(o / "3_Normalize"), (o / "3_Normalize").symlink_to(o.parent)),
         "3_Normalize"),
    ],
    ids=["new-file", "edited-file", "new-directory", "directory-now-a-link"],
)  # fmt: skip
def test_force_replaces_a_subdirectory_only_as_qtool_wrote_it(
    invoke: Invoke, model: Path, tmp_path: Path, change: object, named: str
) -> None:
    out = tmp_path / "out"
    assert invoke("quantize", str(model), "-o", str(out))[0] == 0
    change(out)  # type: ignore[operator]
    before = tree(out)
    code, _, err = invoke("quantize", str(model), "-o", str(out), "--force")
    assert code == 1 and "holds files qtool did not write" in err and named in err, err
    assert tree(out) == before


def test_old_manifests_without_directories_still_protect_them(
    invoke: Invoke, model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert invoke("quantize", str(model), "-o", str(out))[0] == 0
    manifest = out / ".qtool-export.json"
    doc = json.loads(manifest.read_text())
    del doc["directories"]
    manifest.write_text(json.dumps(doc))
    code, _, err = invoke("quantize", str(model), "-o", str(out), "--force")
    assert code == 1 and "1_Pooling/" in err, err


# ---------------------------------------------------------------- hostile inputs


def notes_of(model: Path) -> tuple[list[str], list[str]]:
    from qtool.engine.source import open_source

    found = comp.companions(open_source(model))
    return found.names, list(found.notes)


def test_links_fifos_and_special_files_in_subdirectories_are_never_followed(
    model: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.txt").write_text("API_KEY=hunter2")
    shutil.rmtree(model / "1_Pooling")
    (model / "1_Pooling").symlink_to(secret)  # a module directory that is a link
    (model / "2_Dense" / "leak.json").symlink_to(secret / "key.txt")
    (model / "2_Dense" / "env.json").symlink_to("/proc/self/environ")
    (model / "2_Dense" / "same.json").symlink_to("config.json")  # beside it: copied
    os.mkfifo(model / "2_Dense" / "pipe.json")
    (model / "2_Dense" / "up").symlink_to("..")
    names, notes = notes_of(model)
    assert "2_Dense/same.json" in names
    assert not any("1_Pooling" in n or "leak" in n or "pipe" in n or "env" in n for n in names)
    text = "\n".join(notes)
    assert "1_Pooling: not copied: a symlink to" in text
    assert "leak.json: not copied: a symlink to" in text and "env.json: not copied" in text
    assert "pipe.json: not copied: not a regular file (a FIFO)" in text
    assert "up: not copied" in text


def test_deep_and_wide_trees_and_huge_files_are_bounded(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = model / "templates"
    for i in range(8):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "x.txt").write_text("x")
    (model / "templates" / "t.txt").write_text("t")
    names, notes = notes_of(model)
    assert "templates/t.txt" in names and not any(n.endswith("x.txt") for n in names)
    assert any("not copied: deeper than 4 levels" in n for n in notes)

    monkeypatch.setattr(comp, "MAX_BYTES", 1000)
    with open(model / "1_Pooling" / "huge.bin.txt", "wb") as f:
        f.truncate(10**12)  # sparse: a terabyte that takes no disk
    names, notes = notes_of(model)
    assert "1_Pooling/huge.bin.txt" not in names
    assert any("huge.bin.txt: not copied: over the" in n for n in notes)

    monkeypatch.setattr(comp, "MAX_ENTRIES", 5)
    for i in range(20):
        (model / "additional_chat_templates" / f"t{i}.jinja").write_text("x")
    names, notes = notes_of(model)
    assert sum(n.startswith("additional_chat_templates/") for n in names) < 5
    assert any("not copied: over 5 entries" in n for n in notes)


@pytest.mark.parametrize(
    "bad",
    ["[[[[", '[{"path": "../../etc"}, {"path": "/abs"}]', "fifo", '{"not": "a list"}'],
    ids=["invalid-json", "paths-outside", "fifo", "not-a-list"],
)
def test_a_bad_modules_json_is_a_note_and_weightless_directories_still_come(
    model: Path, bad: str
) -> None:
    (model / "modules.json").unlink()
    if bad == "fifo":
        os.mkfifo(model / "modules.json")
    else:
        (model / "modules.json").write_text(bad)
    names, notes = notes_of(model)
    assert "1_Pooling/config.json" in names and "2_Dense/config.json" not in names
    assert any("2_Dense/: not copied: holds weights" in n for n in notes)
    if bad.startswith("[{"):
        assert any("'../../etc' is not a path inside the directory" in n for n in notes)
    elif bad != '{"not": "a list"}':
        assert any("modules.json" in n for n in notes), notes


def test_a_subdirectory_swapped_for_a_link_after_listing_is_never_copied(
    invoke: Invoke, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "config.json").write_text("API_KEY=hunter2")
    listed = comp.companions

    def then_swap(source: object) -> comp.Companions:
        found = listed(source)  # type: ignore[arg-type]
        shutil.rmtree(model / "1_Pooling")
        (model / "1_Pooling").symlink_to(secret)  # the attacker's move, after the listing
        return found

    monkeypatch.setattr("qtool.engine.layout.companions", then_swap)
    out = tmp_path / "out"
    code, _, err = invoke("quantize", str(model), "-o", str(out))
    assert code == 1 and "1_Pooling: changed while qtool ran" in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m", "secret"]


def test_a_file_that_grows_or_shrinks_after_listing_stops_the_run(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = comp.companions
    target = model / "1_Pooling" / "config.json"

    def then_grow(source: object) -> comp.Companions:
        found = listed(source)  # type: ignore[arg-type]
        target.write_text("x" * 100_000)
        return found

    monkeypatch.setattr("qtool.engine.layout.companions", then_grow)
    with pytest.raises(InputError, match="changed while qtool ran"):
        api.quantize(model, tmp_path / "out", QuantizeOptions(), device="cpu")
    assert not (tmp_path / "out").exists()


def test_a_file_appended_to_while_it_is_copied_is_copied_as_listed(tmp_path: Path) -> None:
    """A writer racing the copy cannot make it endless: it stops at the size it listed."""
    (tmp_path / "d").mkdir()
    src = tmp_path / "d" / "grows.txt"
    src.write_bytes(b"a" * 4096)
    stop = threading.Event()

    def append() -> None:
        with open(src, "ab") as f:
            while not stop.is_set():
                f.write(b"b" * 4096)

    within = InputDir(tmp_path / "d")
    with within.open("grows.txt") as fin:
        exact = comp._Exactly(fin, 4096, src)
        writer = threading.Thread(target=append)
        writer.start()
        try:
            data = b"".join(iter(lambda: exact.read(1000), b""))
        finally:
            stop.set()
            writer.join()
    assert data == b"a" * 4096


def test_the_output_subdirectory_is_built_inside_the_transaction(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure while copying a subdirectory leaves nothing behind, not even the directory."""
    real = comp._copy

    def failing(outputs: object, within: InputDir, name: str, size: int, dest: Path) -> None:
        if dest.parent.name == "2_Dense":
            raise OutputError(dest, "cannot write: disk full")
        real(outputs, within, name, size, dest)  # type: ignore[arg-type]

    monkeypatch.setattr(comp, "_copy", failing)
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="disk full"):
        api.quantize(model, out, QuantizeOptions(), device="cpu")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.parametrize(
    "name",
    ["extra.safetensors", "model.qparams.safetensors", "model.safetensors.index.json",
     "pytorch_model.bin"],
)  # fmt: skip
@pytest.mark.parametrize("fmt", [(), CT], ids=["qtool", "compressed-tensors"])
def test_a_directory_named_like_an_output_file_is_left_behind(
    invoke: Invoke, model: Path, tmp_path: Path, name: str, fmt: tuple[str, ...]
) -> None:
    """Before: `extra.safetensors/` made detection count two checkpoint files, an index-named
    one two indexes, and `model.qparams.safetensors/` was created in the output where qtool
    writes its sidecar (`is a directory, not a regular file`)."""
    (model / name).mkdir()
    (model / name / "notes.txt").write_text("not weights")
    out = tmp_path / "out"
    code, _, err = invoke("quantize", str(model), *fmt, "-o", str(out))
    assert code == 0, err
    assert f"{name}/: not copied: a directory named like a weight file or an index" in err
    assert not (out / name).is_dir() and not (out / name / "notes.txt").exists()
    assert tree(out) == EXPECTED


@pytest.mark.slow
def test_a_subdirectory_on_another_filesystem_is_not_entered(
    invoke: Invoke, model: Path, tmp_path: Path
) -> None:
    """A mount inside the checkpoint directory (tmpfs on 1_Pooling/) is left behind with a
    warning, in a private mount namespace so nothing leaks out of the test."""
    import subprocess
    import sys

    unshare = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
    if subprocess.run([*unshare, "true"], capture_output=True).returncode != 0:
        pytest.skip("no private mount namespaces here (unshare failed)")
    out = tmp_path / "out"
    pooling = model / "1_Pooling"
    script = (
        f"mount -t tmpfs none {pooling} && echo '{{}}' > {pooling}/config.json && "
        f"{sys.executable} -m qtool quantize {model} -o {out}"
    )
    result = subprocess.run([*unshare, script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "1_Pooling/: not copied: on another filesystem" in result.stderr
    assert "1_Pooling/" not in tree(out) and "2_Dense/config.json" in tree(out)


@pytest.mark.slow
def test_force_never_takes_a_mount_over_a_listed_subdirectory_for_qtools(
    invoke: Invoke, model: Path, tmp_path: Path
) -> None:
    """A tmpfs mounted on the export's 1_Pooling/ holding the very file qtool wrote there is
    not qtool's to replace: --force refuses, naming it (private mount namespace)."""
    import subprocess
    import sys

    unshare = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
    if subprocess.run([*unshare, "true"], capture_output=True).returncode != 0:
        pytest.skip("no private mount namespaces here (unshare failed)")
    out = tmp_path / "out"
    assert invoke("quantize", str(model), "-o", str(out))[0] == 0
    pooling = out / "1_Pooling"
    script = (
        f"cp {pooling}/config.json {tmp_path}/saved && mount -t tmpfs none {pooling} && "
        f"cp {tmp_path}/saved {pooling}/config.json && "
        f"{sys.executable} -m qtool quantize {model} -o {out} --force"
    )
    result = subprocess.run([*unshare, script], capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "holds files qtool did not write" in result.stderr and "1_Pooling" in result.stderr
    assert (pooling / "config.json").read_text() == '{"word_embedding_dimension": 64}'


def test_a_huge_sparse_file_is_left_behind_at_the_real_bound(model: Path) -> None:
    with open(model / "1_Pooling" / "big.txt", "wb") as f:
        f.truncate(comp.MAX_BYTES + 1)  # sparse: takes no disk
    names, notes = notes_of(model)
    assert "1_Pooling/big.txt" not in names and "1_Pooling/config.json" in names
    assert any("big.txt: not copied: over the 4 GiB" in n for n in notes)


# ---------------------------------------------------------------- dequantize at load time


def test_dequantize_at_load_only_for_sentence_transformers_with_one_scheme() -> None:
    from qtool.formats.compressed_tensors.selection import Selection
    from qtool.io.stformat import TensorEntry
    from qtool.spec import PerChannel, PerGroup, QSpec, Scheme, StorageDtype

    def sel(name: str, spec: QSpec) -> Selection:
        return Selection(TensorEntry(f"{name}.weight", "F32", (128, 128), 0, 0), name, spec)

    int8 = QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(0))
    int4 = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32))
    one = [sel("a", int8), sel("b", int8)]
    mixed = [sel("a", int8), sel("b", int4)]
    assert loaders.dequantize_at_load(one, sentence_transformers=False) == (False, None)
    assert loaders.dequantize_at_load(one, sentence_transformers=True) == (True, None)
    dense, warning = loaders.dequantize_at_load(mixed, sentence_transformers=True)
    assert not dense and warning is not None and "mixes schemes" in warning
    q = ct_config.quantization_config(one, "0", dequantize=True)
    assert q["dequantize"] is True
    assert "dequantize" not in ct_config.quantization_config(one, "0")
    assert ct_config.parse_config(q).ignore == ()  # qtool reads its own export back


def test_a_sentence_transformers_export_says_dequantize_and_others_do_not(
    invoke: Invoke, model: Path, tmp_path: Path
) -> None:
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(tmp_path / "st"))
    assert code == 0, err
    q = json.loads((tmp_path / "st" / "config.json").read_text())["quantization_config"]
    assert q["dequantize"] is True and q["ignore"] == ["lm_head"]
    (model / "modules.json").unlink()
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(tmp_path / "plain"))
    assert code == 0, err
    q = json.loads((tmp_path / "plain" / "config.json").read_text())["quantization_config"]
    assert "dequantize" not in q
