"""`qtool calibrate` refuses what it cannot calibrate in one line naming the path and what to do,
stdout empty, no output written: a directory without config.json, a quantized model, a model
outside the Llama family, text too short for one window, a window of 0 or longer than the model
allows, broken JSONL, chat messages without a chat template, one file given to --merge, two
models without it, and an importance matrix of another model in a merge."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import Invoke

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import numpy as np  # noqa: E402

from qtool.formats.imatrix import read_imatrix, write_imatrix  # noqa: E402
from qtool.formats.imatrix.provenance import SHA_KEY, TOKENS_KEY  # noqa: E402
from qtool.gguf_types import ValueType  # noqa: E402
from qtool.io.gguf_file import GGUFFile  # noqa: E402
from qtool.io.gguf_layout import GGUFValue  # noqa: E402
from tests.eval_models import build  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("calibrate-inputs")
    build(r / "llama", "llama")
    build(r / "bert", "bert")
    (r / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return r


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Invoke:
    """The real entry point in process (Typer's usage errors are worded there)."""
    from qtool.cli import main

    def invoke(*args: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exited:
            main(list(args))
        out, err = capsys.readouterr()
        return int(exited.value.code or 0), out, err

    return invoke


def _refused(run: Invoke, args: list[str], *words: str, code: int = 1) -> str:
    rc, out, err = run("calibrate", *args)
    assert rc == code, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_a_directory_without_config_json(root: Path, tmp_path: Path, run: Invoke) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(root / "llama" / "model.safetensors", bare)
    _refused(run, [str(bare), "-o", str(tmp_path / "x.gguf")], "MODEL must be", "config.json")
    assert not (tmp_path / "x.gguf").exists()


def test_a_quantized_model(root: Path, tmp_path: Path, run: Invoke) -> None:
    ct = tmp_path / "llama-ct"
    rc, _, err = run("quantize", str(root / "llama"), "--format", "compressed-tensors",
                        "--dtype", "int8", "-o", str(ct))  # fmt: skip
    assert rc == 0, err
    line = _refused(run, [str(ct), "-o", str(tmp_path / "x.gguf")], "already quantized")
    assert "calibrate runs the float model" in line and "FLOAT" not in line


def test_a_model_outside_the_llama_family(root: Path, tmp_path: Path, run: Invoke) -> None:
    _refused(run, [str(root / "bert"), "-o", str(tmp_path / "x.gguf")], "Llama family")


def test_text_too_short_for_one_window(root: Path, tmp_path: Path, run: Invoke) -> None:
    short = tmp_path / "short.txt"
    short.write_text("too short")
    args = [str(root / "llama"), "--text", str(short), "--ctx", "64", "-o", str(tmp_path / "x")]
    _refused(run, args, "short.txt", "fewer than one window of 64")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("ctx", "words"),
    [("0", "--ctx: must be at least 1"), ("-3", "--ctx: must be at least 1"),
     ("1000", "longer than the model's max_position_embeddings (128)")],
)  # fmt: skip
def test_a_window_of_no_tokens_or_too_many(
    root: Path, tmp_path: Path, run: Invoke, ctx: str, words: str
) -> None:
    args = [str(root / "llama"), "--text", str(root / "text.txt"), "--ctx", ctx,
            "--tokens", "100000", "-o", str(tmp_path / "x.gguf")]  # fmt: skip
    _refused(run, args, words, code=2)


def test_fewer_tokens_than_one_window(root: Path, tmp_path: Path, run: Invoke) -> None:
    args = [str(root / "llama"), "--tokens", "10", "--ctx", "32", "-o", str(tmp_path / "x.gguf")]
    _refused(run, args, "one window of 32", code=2)


def test_more_activations_than_qtool_holds(root: Path, tmp_path: Path, run: Invoke) -> None:
    args = [str(root / "llama"), "--tokens", str(40 << 20), "--ctx", "128",
            "-o", str(tmp_path / "x.gguf")]  # fmt: skip
    _refused(run, args, "10.0 GiB of activations", "at most 33,554,432 tokens", code=2)


def test_broken_jsonl(root: Path, tmp_path: Path, run: Invoke) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    args = [str(root / "llama"), "--text", str(bad), "-o", str(tmp_path / "x.gguf")]
    _refused(run, args, "bad.jsonl", "line 2 is not JSON")
    bad.write_text(json.dumps({"title": "no text"}) + "\n")
    _refused(run, args, "bad.jsonl", "line 1 has neither")


def test_chat_messages_without_a_chat_template(root: Path, tmp_path: Path, run: Invoke) -> None:
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    args = [str(root / "llama"), "--text", str(chat), "-o", str(tmp_path / "x.gguf")]
    _refused(run, args, "chat.jsonl", "no chat template")


@pytest.mark.filterwarnings("always")  # one file merged twice warns (below)
def test_merge_and_model_counts(root: Path, tmp_path: Path, run: Invoke) -> None:
    one = tmp_path / "one.gguf"
    rc, _, err = run("calibrate", str(root / "llama"), "--text", str(root / "text.txt"),
                        "--tokens", "256", "--ctx", "32", "-o", str(one))  # fmt: skip
    assert rc == 0, err
    _refused(run, ["--merge", str(one), "-o", str(tmp_path / "m.gguf")], "two or more", code=2)
    _refused(run, [str(root / "llama"), str(root / "llama"), "-o", str(tmp_path / "m.gguf")],
             "--merge", code=2)  # fmt: skip
    rc, out, _ = run("calibrate", "--merge", str(one), str(one), "-o", str(tmp_path / "m.gguf"))
    assert rc == 0 and "merged 2 importance matrices" in out


def test_a_merge_of_different_models(root: Path, tmp_path: Path, run: Invoke) -> None:
    import numpy as np

    from qtool.formats.imatrix import write_imatrix
    from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats

    one = tmp_path / "one.gguf"
    rc, _, err = run("calibrate", str(root / "llama"), "--text", str(root / "text.txt"),
                        "--tokens", "256", "--ctx", "32", "-o", str(one))  # fmt: skip
    assert rc == 0, err
    other = tmp_path / "other.gguf"
    stats = MatrixStats(np.ones((1, 7), np.float32), np.array([32], np.int64))
    write_imatrix(other, ImportanceMatrix({"blk.0.attn_q.weight": stats}, 32, 1))
    line = _refused(run, ["--merge", str(one), str(other), "-o", str(tmp_path / "m.gguf")])
    assert "blk.0.attn_q.weight" in line and "cannot be merged" in line
    assert not (tmp_path / "m.gguf").exists()


def test_json_errors_are_json(root: Path, tmp_path: Path, run: Invoke) -> None:
    rc, out, err = run("calibrate", str(root / "bert"), "-o", str(tmp_path / "x"), "--json")
    assert rc == 1 and out == ""
    assert "Llama family" in json.loads(err)["error"]["message"]


def test_cuda_without_a_gpu(root: Path, tmp_path: Path, run: Invoke) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    args = [str(root / "llama"), "--device", "cuda", "-o", str(tmp_path / "x.gguf")]
    _refused(run, args, "no CUDA device")
    assert not (tmp_path / "x.gguf").exists()


def test_a_quantization_config_is_refused_unless_it_is_transformers_gguf_marker(
    root: Path, tmp_path: Path, run: Invoke
) -> None:
    """A directory saved from a model transformers loaded from a GGUF file keeps its marker
    over float weights: that is a float model (as eval and the export take it)."""
    model = tmp_path / "llama"
    shutil.copytree(root / "llama", model)
    config = json.loads((model / "config.json").read_text())
    args = [str(model), "--text", str(root / "text.txt"), "--tokens", "64", "--ctx", "32"]
    for method, refused in (("gguf", False), ("awq", True)):
        config["quantization_config"] = {"quant_method": method}
        (model / "config.json").write_text(json.dumps(config))
        out = tmp_path / f"{method}.gguf"
        if refused:
            _refused(run, [*args, "-o", str(out)], "already quantized", '"awq"')
        else:
            rc, _, err = run("calibrate", *args, "-o", str(out))
            assert rc == 0 and out.is_file(), err


def test_a_jsonl_line_nested_too_deep(root: Path, tmp_path: Path, run: Invoke) -> None:
    """A line of 100,000 `[` was `internal error: RecursionError` (json.loads unbounded); it
    is parsed as config files are (nesting bounded), naming the file and the line."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text(json.dumps({"text": "fine"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    args = [str(root / "llama"), "--text", str(deep), "-o", str(tmp_path / "x.gguf")]
    _refused(run, args, "deep.jsonl", "line 2 is not JSON", "nest")


def test_a_token_id_beyond_the_vocabulary(root: Path, tmp_path: Path, run: Invoke) -> None:
    """An added token of tokenizer.json whose id the embedding has no row for, in the text:
    was `internal error: IndexError: index out of range in self`."""
    model = tmp_path / "model"
    shutil.copytree(root / "llama", model)
    _add_token(model, 5000, "<far>")
    text = tmp_path / "far.txt"
    text.write_text("The quick brown fox <far> jumps over the lazy dog. " * 20)
    args = [str(model), "--text", str(text), "--tokens", "64", "--ctx", "32",
            "-o", str(tmp_path / "x.gguf")]  # fmt: skip
    _refused(run, args, "tokenizer.json", "gives token id 26", "vocabulary has 262 entries")
    assert not (tmp_path / "x.gguf").exists()


def _add_token(model: Path, token_id: int, content: str) -> None:
    path = model / "tokenizer.json"
    doc = json.loads(path.read_text())
    doc["added_tokens"].append({"id": token_id, "content": content, "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": False})  # fmt: skip
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"num_hidden_layers": 1}, ["config.json", "model.layers.1.", "9 of the checkpoint's"]),
        ({"num_hidden_layers": -1}, ["config.json", "num_hidden_layers is -1"]),
        ({"num_hidden_layers": 0}, ["config.json", "num_hidden_layers is 0"]),
        ({"num_attention_heads": 0}, ["config.json", "num_attention_heads is 0"]),
        ({"head_dim": 0}, ["config.json", "head_dim is 0"]),
    ],
    ids=["fewer-layers", "negative-layers", "no-layers", "no-heads", "no-head-dim"],
)
def test_config_counts_below_the_checkpoint(
    root: Path, tmp_path: Path, run: Invoke, change: dict[str, int], words: list[str]
) -> None:
    """Calibrate builds the model as eval does: a layer count below the checkpoint's was a
    calibration of fewer blocks (tensors silently unused), a head count or head_dim of 0 a
    ZeroDivisionError from transformers naming nothing."""
    model = tmp_path / "model"
    shutil.copytree(root / "llama", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | change))
    args = [str(model), "--text", str(root / "text.txt"), "--tokens", "64", "--ctx", "32",
            "-o", str(tmp_path / "x.gguf")]  # fmt: skip
    _refused(run, args, *words)


@pytest.mark.filterwarnings("always")  # shown as the CLI shows it, not raised by pytest
def test_a_merge_of_one_file_twice_warns(root: Path, tmp_path: Path, run: Invoke) -> None:
    """The same file twice (by inode: another spelling of its path too) doubles its counts; it
    was merged silently."""
    one = tmp_path / "one.gguf"
    rc, _, err = run("calibrate", str(root / "llama"), "--text", str(root / "text.txt"),
                     "--tokens", "64", "--ctx", "32", "-o", str(one))  # fmt: skip
    assert rc == 0, err
    rc, out, err = run("calibrate", "--merge", str(one), f"{tmp_path}/./one.gguf",
                       "-o", str(tmp_path / "m.gguf"))  # fmt: skip
    assert rc == 0 and "merged 2 importance matrices" in out
    assert "one.gguf and " in err and "are the same file, merged twice" in err, err
    assert "MergedTwice" not in err  # qtool's own warning: no class name
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "value",
    [
        GGUFValue(ValueType.UINT64, 5),  # a scalar, not one count per dataset
        GGUFValue(ValueType.ARRAY, ("x",), ValueType.STRING),
        GGUFValue(ValueType.ARRAY, np.array([1, 2], dtype=np.uint64), ValueType.UINT64),
    ],
    ids=["scalar", "strings", "two-for-one"],
)
def test_qtools_own_keys_malformed_in_a_merged_file(
    root: Path, tmp_path: Path, run: Invoke, value: GGUFValue
) -> None:
    """qtool.datasets.tokens that is not one token count per dataset was an internal error
    (TypeError: 'int' object is not iterable) in a merge: one line naming the file."""
    one = tmp_path / "one.gguf"
    rc, _, err = run("calibrate", str(root / "llama"), "--text", str(root / "text.txt"),
                     "--tokens", "64", "--ctx", "32", "-o", str(one))  # fmt: skip
    assert rc == 0, err
    bad = tmp_path / "bad.gguf"
    write_imatrix(bad, read_imatrix(one), {SHA_KEY: _sha_of(one), TOKENS_KEY: value})
    rc, out, err = run("calibrate", "--merge", str(one), str(bad), "-o", str(tmp_path / "m.gguf"))
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert str(bad) in err and "qtool.datasets.tokens" in err and "internal" not in err


def _sha_of(path: Path) -> GGUFValue:
    with GGUFFile(path) as f:
        value = f.header.metadata[SHA_KEY]
    return value
