"""`qtool eval` and the compressed-tensors export given hostile model directories (issue 28):

- class 2, nothing outside the model directory is read: transformers and tokenizers are never
  handed the user's directories (only a private copy of the checked tokenizer files, and the
  weights as tensors qtool read), so a file qtool never checked (generation_config.json,
  additional_chat_templates/*.jinja) is never opened, whatever it is or points to;
- class 3, work bounded by what was asked: tokenizer files are read bounded, only as much text
  is tokenized as the tokens asked for need (with the whole text's ids), and config.json counts
  the weights do not back (layers, depth, experts, sizes) are refused before anything is built;
- class 4, no traceback: a Rust panic in tokenizers, a config transformers' validation refuses
  and tokenizer files nested too deeply are one line naming the file (JSON with --json);
- class 5, no unhelpful message: a config/weights size mismatch names the tensor, both files
  and both shapes, never "look at the above report!".

Each failed on the code before the fix (hung, read gigabytes, printed a Rust backtrace, said
"internal error", or named nothing)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from qtool import api  # noqa: E402
from qtool.errors import InputError  # noqa: E402
from qtool.io.stformat import TensorEntry  # noqa: E402
from qtool.spec import FormatName, PerGroup, QSpec, StorageDtype  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.eval_models import build  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")  # third-party loaders warn freely
EVAL = ("--tokens", "20", "--threads", "1")
HANG = 240  # seconds: only a run that hangs or builds without end gets near it


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(FLOAT, its compressed-tensors int4 export), built once; tests copy them."""
    root = tmp_path_factory.mktemp("hostile-eval")
    model = build(root / "llama", "llama")
    spec = QSpec(dtype=StorageDtype.INT4, granularity=PerGroup(32))
    options = api.QuantizeOptions(spec, format=FormatName.COMPRESSED_TENSORS)
    api.quantize(model, root / "ct", options)
    return model, root / "ct"


def _copy(source: Path, tmp_path: Path, name: str) -> Path:
    dest = tmp_path / name
    shutil.copytree(source, dest)
    return dest


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | changes))


def _qtool(*args: str, address_space: int | None = None) -> subprocess.CompletedProcess[str]:
    """qtool in a process of its own: what the Rust side prints on descriptor 2 is seen, a run
    that hangs is stopped, and `address_space` caps its memory (RLIMIT_AS, bytes)."""
    env = {**os.environ, "RUST_BACKTRACE": "1", "HF_HUB_OFFLINE": "1"}

    def cap() -> None:
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    return subprocess.run(
        [sys.executable, "-m", "qtool", *args],
        capture_output=True, text=True, timeout=HANG, env=env, check=False, preexec_fn=cap,
    )  # fmt: skip


def _one_line(code: int, out: str, err: str, message: str) -> None:
    assert code == 1 and out == "", (code, out, err)
    assert message in err and len(err.strip().splitlines()) == 1, err


# ---- class 2: libraries read only what qtool checked ----------------------------------------


AUDIT = """
import sys
from pathlib import Path
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
from qtool import api
api.evaluate(Path(sys.argv[1]), Path(sys.argv[2]), api.EvalOptions(tokens=20, threads=1))
for path in opened:
    print(path)
"""


@pytest.mark.slow
def test_libraries_never_open_a_file_of_the_model_directories_by_path(
    models: tuple[Path, Path],
) -> None:
    """Every file of FLOAT and QUANT is opened by qtool through the directory's descriptor
    (a bare name); no open names a path inside either directory (Python's audit hook sees
    transformers' opens: tokenizer_config.json, generation_config.json, chat templates)."""
    model, ct = models
    run = subprocess.run(
        [sys.executable, "-c", AUDIT, str(model), str(ct)],
        capture_output=True, text=True, timeout=HANG, check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    inside = [p for p in run.stdout.splitlines() if p.startswith((f"{model}/", f"{ct}/"))]
    assert inside == []


@pytest.mark.slow
def test_files_qtool_never_checked_are_never_opened(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """generation_config.json and a chat template of QUANT's directory, which qtool never
    checked and transformers opened by path, link to a 4 GiB sparse file outside it: the run
    (under a 3 GB address-space cap) never reads it (before: read whole, 2.4 GB RSS for 1 GiB,
    exit 0; MemoryError under the cap)."""
    model, ct = models
    quant = _copy(ct, tmp_path, "ct")
    outside = tmp_path / "outside"
    with open(outside, "wb") as f:
        f.truncate(4 << 30)
    (quant / "generation_config.json").unlink()
    (quant / "generation_config.json").symlink_to(outside)
    (quant / "additional_chat_templates").mkdir()
    (quant / "additional_chat_templates" / "x.jinja").symlink_to(outside)
    run = _qtool("eval", str(model), str(quant), *EVAL, address_space=3_000_000_000)
    assert run.returncode == 0, run.stderr


# ---- class 3: bounded by what was asked -----------------------------------------------------


def test_a_huge_tokenizer_file_is_refused_unread(
    invoke: Invoke, models: tuple[Path, Path], tmp_path: Path
) -> None:
    """A sparse 1 GiB tokenizer.json (before: read whole and parsed, 2.5 GB RSS)."""
    model = _copy(models[0], tmp_path, "model")
    with open(model / "tokenizer.json", "r+b") as f:
        f.truncate(1 << 30)
    code, out, err = invoke("eval", str(model), str(models[0]), *EVAL)
    _one_line(code, out, err, "tokenizer.json: a tokenizer file is over 64,000,000 bytes")


def test_only_the_text_the_tokens_need_is_tokenized(
    models: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4 MB --text with --tokens 20 (before: all 4 MB tokenized, by both tokenizers: 16 s,
    1.25 GB here; 16 MB took 149 s and 7.9 GB on the reporter's machine)."""
    import transformers

    seen: list[int] = []
    call = transformers.PreTrainedTokenizerBase.__call__

    def counting(self: Any, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        seen.append(len(text) if isinstance(text, str) else 0)
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", counting)
    text = tmp_path / "big.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 90_000)  # 4 MB
    model, ct = models
    summary = api.evaluate(model, ct, api.EvalOptions(text=text, tokens=20, threads=1))
    assert summary.tokens == 20
    assert sum(seen) <= 200_000, seen  # a few prefixes of a few kB, never the 4 MB


@pytest.mark.slow
def test_a_layer_count_the_weights_do_not_back_is_refused_before_building(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """A 400-byte config.json with num_hidden_layers 200,000 (before: still building after
    50 s, 1.6 GB at 33 s)."""
    model = _copy(models[0], tmp_path, "model")
    _edit_config(model, num_hidden_layers=200_000)
    run = _qtool("eval", str(model), str(models[0]), *EVAL)
    _one_line(run.returncode, run.stdout, run.stderr, "config.json: num_hidden_layers is 200,000")


def test_the_export_counts_depth_and_every_sub_config() -> None:
    """The compressed-tensors export's check missed `vision_config.depth` (a Qwen2-VL config
    with depth 20,000 built 20,000 vision blocks: 40 s, 1 GB, then 80,009 `ignore` entries);
    the size model is the one eval uses, and refuses naming the key."""
    from qtool.formats.compressed_tensors.modules import model_linears

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "vision_config": {"depth": 20_000}}  # fmt: skip
    entries = [TensorEntry(f"model.layers.{i}.mlp.down_proj.weight", "BF16", (64, 64), 0, 0)
               for i in range(2)]  # fmt: skip
    with pytest.raises(InputError, match=r"vision_config\.depth is 20,000, but the checkpoint"):
        model_linears(config, Path("/m/config.json"), entries)


@pytest.mark.parametrize(
    ("config", "shapes", "refused"),
    [
        ({"num_hidden_layers": 64}, {"a.weight": (4, 4)}, None),  # a few blocks: always
        ({"num_hidden_layers": 65}, {"a.weight": (4, 4)}, "num_hidden_layers is 65"),
        ({"text_config": {"n_layer": 10**9}}, {"a": (1,)}, "text_config.n_layer is"),
        ({"num_experts": 128}, {f"l.{i}.experts.w": (128, 4, 4) for i in range(2)}, None),
        ({"num_local_experts": 129}, {"experts.w": (128, 4, 4)}, "num_local_experts is 129"),
        ({"num_hidden_layers": 60, "num_experts": 60, "vision_config": {"depth": 60}},
         {"a": (1,)}, None),  # 60 x 60 + 60 = 3,660 modules
        ({"num_hidden_layers": 64, "num_experts": 64, "n_routed_experts": 2}, {"a": (1,)},
         "make 8,192 modules"),
        ({"max_window_layers": 10**6, "num_experts_per_tok": 10**6}, {"a": (1,)}, None),
    ],
    ids=["floor", "over-floor", "nested", "fused-experts", "over-fused", "siblings-add",
         "nested-multiply", "not-build-counts"],
)  # fmt: skip
def test_the_size_model_of_config_counts(
    config: dict[str, object], shapes: dict[str, tuple[int, ...]], refused: str | None
) -> None:
    """Each count at most the checkpoint's units (tensors, or a fused 3-D tensor's leading
    dimension; any count up to 64); the modules of one (sub-)config multiply, sub-configs
    add, at most 8 per tensor (or 4,096)."""
    from qtool.formats.model_config import check_counts

    if refused is None:
        check_counts(config, Path("config.json"), shapes)
    else:
        with pytest.raises(InputError, match=refused):
            check_counts(config, Path("config.json"), shapes)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": 100_000_000}, "config.json makes it [100000000, 64], but "
         "model.safetensors holds [262, 64]"),
        ({"hidden_size": 128}, "config.json makes it [262, 128], but model.safetensors holds "
         "[262, 64]"),
        ({"intermediate_size": 4096}, "config.json makes it [4096, 64], but "
         "model.safetensors holds [128, 64]"),
    ],
    ids=["vocabulary", "hidden", "intermediate"],
)  # fmt: skip
def test_sizes_config_json_gives_that_the_weights_lack_name_the_tensor(
    invoke: Invoke, models: tuple[Path, Path], tmp_path: Path, change: dict[str, int], message: str
) -> None:
    """Class 5 and 3: before, transformers said "...look at the above report!" (the report
    suppressed, nothing named); the model is checked on the meta device first, so nothing
    of config.json's size is allocated either."""
    model = _copy(models[0], tmp_path, "model")
    _edit_config(model, **change)
    code, out, err = invoke("eval", str(model), str(models[0]), *EVAL)
    _one_line(code, out, err, message)
    assert "config.json: tensor '" in err and "above report" not in err


def test_a_quant_tensor_of_another_shape_names_it_and_both_files(
    invoke: Invoke, models: tuple[Path, Path], tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    model, ct = models
    quant = _copy(ct, tmp_path, "ct")
    tensors = load_file(quant / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(32, dtype=tensors["model.norm.weight"].dtype)
    save_file(tensors, quant / "model.safetensors", metadata={"format": "pt"})
    code, out, err = invoke("eval", str(model), str(quant), *EVAL)
    _one_line(code, out, err, "ct/model.safetensors: tensor 'model.norm.weight'")
    assert "is [32] here but [64] in FLOAT's" in err and "model.safetensors" in err


# ---- class 4: no traceback ------------------------------------------------------------------


@pytest.mark.slow
def test_a_tokenizer_that_panics_is_one_line_naming_its_file(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """A pre-tokenizer regex that backtracks catastrophically makes the tokenizers library
    panic (pyo3's PanicException is a BaseException): before, a Rust backtrace on stderr and
    an internal error (or a traceback) instead of JSON."""
    model = _copy(models[0], tmp_path, "model")
    path = model / "tokenizer.json"
    doc = json.loads(path.read_text())
    split = {"type": "Split", "pattern": {"Regex": "^([a-z ]+)+$"}, "behavior": "Isolated",
             "invert": False}  # fmt: skip
    doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, doc["pre_tokenizer"]]}
    path.write_text(json.dumps(doc))
    text = tmp_path / "a.txt"
    text.write_text("a" * 5000 + "!")
    run = _qtool("eval", str(model), str(models[0]), "--text", str(text), *EVAL, "--json")
    assert run.returncode == 1 and run.stdout == "", run.stdout
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr  # no Rust backtrace
    error = json.loads(run.stderr)["error"]
    assert error["code"] == "bad_input" and error["path"] == str(path), error
    assert "panicked" in error["message"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("config.json", None, "config.json: transformers cannot read FLOAT's config: "),
        ("tokenizer_config.json", "[" * 100_000 + "]" * 100_000,
         "tokenizer_config.json: not a valid tokenizer_config.json: JSON nested more than"),
        ("tokenizer.json", '{"a": ' * 100_000 + "1" + "}" * 100_000,
         "tokenizer.json: not a valid tokenizer.json: JSON nested more than"),
    ],
    ids=["heads-not-dividing-hidden", "nested-tokenizer-config", "nested-tokenizer"],
)  # fmt: skip
def test_what_transformers_refuses_in_a_model_file_names_the_file(
    invoke: Invoke,
    models: tuple[Path, Path],
    tmp_path: Path,
    name: str,
    content: str | None,
    message: str,
) -> None:
    """Before: "internal error: StrictDataclassClassValidationError" and "internal error:
    RecursionError", naming no file."""
    model = _copy(models[0], tmp_path, "model")
    if content is None:
        _edit_config(model, num_attention_heads=5)  # 64 is no multiple of 5
    else:
        (model / name).write_text(content)
    code, out, err = invoke("eval", str(model), str(models[0]), *EVAL)
    _one_line(code, out, err, message)
    assert "internal error" not in err


# ---- issue 28, second attack: what config.json and tokenizer.json size without weights -------


def _xglm(directory: Path, max_positions: int) -> Path:
    """A tiny XGLM (d_model 32, 1 layer) whose sinusoidal position table is a buffer of
    max_positions x 32, computed from config.json, in no weight file."""
    import torch
    from transformers import XGLMConfig, XGLMForCausalLM

    from tests.eval_models import save_tokenizer

    torch.manual_seed(0)
    config = XGLMConfig(vocab_size=262, d_model=32, num_layers=1, attention_heads=2,
                        ffn_dim=64, max_position_embeddings=64)  # fmt: skip
    XGLMForCausalLM(config).save_pretrained(directory)
    save_tokenizer(directory, encoder=False)
    _edit_config(directory, max_position_embeddings=max_positions)
    return directory


def test_a_buffer_config_json_sizes_is_bounded_before_building(tmp_path: Path) -> None:
    """max_position_embeddings 40,000,000 made XGLM compute a 40,000,002 x 32 position table
    (50 s, 7.9 GB, then a failed 5 GB allocation; at 4e8, 51 GB): buffers are now counted on
    the meta build, at most 4 bytes per weight value or 64 MiB, and refused naming
    config.json and the largest one. The run is capped at 3 GB of address space."""
    model = _xglm(tmp_path / "xg", 40_000_000)
    run = _qtool("eval", str(model), str(model), *EVAL, address_space=3 << 30)
    _one_line(run.returncode, run.stdout, run.stderr, "config.json: describes a model whose "
              "computed buffers take 5,120,000,256 bytes (the largest: "
              "model.embed_positions.weights [40000002, 32])")  # fmt: skip


def test_a_buffer_within_the_floor_is_built(tmp_path: Path, invoke: Invoke) -> None:
    """The bound refuses only what config.json sizes beyond the floor: 2,048 positions run."""
    model = _xglm(tmp_path / "xg", 2048)
    code, _, err = invoke("eval", str(model), str(model), *EVAL)
    assert code == 0, err


def test_a_token_id_beyond_the_vocabulary_names_tokenizer_json(
    invoke: Invoke, models: tuple[Path, Path], tmp_path: Path
) -> None:
    """tokenizer.json's added tokens with ids the embedding has no row for, in the text: was
    `internal error: IndexError: index out of range in self`."""
    model = _copy(models[0], tmp_path, "model")
    path = model / "tokenizer.json"
    doc = json.loads(path.read_text())
    doc["added_tokens"] += [{"id": 5000 + i, "content": f"<far{i}>", "single_word": False,
                             "lstrip": False, "rstrip": False, "normalized": False,
                             "special": False} for i in range(5)]  # fmt: skip
    path.write_text(json.dumps(doc))
    text = tmp_path / "far.txt"
    text.write_text("A few words <far3> and more words after it. " * 10)
    code, out, err = invoke("eval", str(model), str(model), "--text", str(text), *EVAL)
    _one_line(code, out, err, "tokenizer.json: gives token id 26")
    assert "vocabulary has 262 entries" in err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 1}, "config.json: tensor 'model.layers.1.input_layernorm.weight': "
         "describes a model with no place for this tensor of model.safetensors (9 of the "
         "checkpoint's tensors in all)"),
        ({"num_hidden_layers": -1}, "config.json: num_hidden_layers is -1; a model needs 1"),
        ({"num_hidden_layers": 0}, "config.json: num_hidden_layers is 0; a model needs 1"),
        ({"num_attention_heads": 0}, "config.json: num_attention_heads is 0; a model needs 1"),
        ({"head_dim": 0}, "config.json: head_dim is 0; a model needs 1"),
        ({"num_key_value_heads": -2}, "config.json: num_key_value_heads is -2"),
    ],
    ids=["fewer-layers", "negative-layers", "no-layers", "no-heads", "no-head-dim",
         "negative-kv-heads"],
)  # fmt: skip
def test_counts_below_the_checkpoint_are_refused(
    invoke: Invoke, models: tuple[Path, Path], tmp_path: Path, change: dict[str, int], message: str
) -> None:
    """Eval never drops weights: num_hidden_layers 1 of 2 ran on one layer (exit 0, 9
    tensors unused), -1 on none (KL 0, a --max-kl gate passed); a head count or head_dim of 0
    was transformers' ZeroDivisionError or "0.0 cannot be raised to a negative power"."""
    model = _copy(models[0], tmp_path, "model")
    _edit_config(model, **change)
    code, out, err = invoke("eval", str(model), str(model), *EVAL, "--max-kl", "1")
    _one_line(code, out, err, message)


def test_the_export_refuses_layers_beyond_the_count() -> None:
    """The compressed-tensors export of a 2-layer checkpoint with num_hidden_layers 1 listed
    layer 1's projections as "kept: not an nn.Linear in transformers"; a tensor of a layer the
    count leaves out is refused naming the key and the tensor."""
    from qtool.formats.compressed_tensors.modules import model_linears

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 1}  # fmt: skip
    entries = [TensorEntry(f"model.layers.{i}.mlp.down_proj.weight", "BF16", (64, 64), 0, 0)
               for i in range(2)]  # fmt: skip
    with pytest.raises(InputError, match=r"num_hidden_layers is 1, but the checkpoint holds "
                       r"model\.layers\.1\.mlp\.down_proj\.weight"):  # fmt: skip
        model_linears(config, Path("/m/config.json"), entries)
    mtp = config | {"num_nextn_predict_layers": 1}  # layer 1 is a next-token predictor's
    assert model_linears(mtp, Path("/m/config.json"), entries) is not None


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("bert", "embeddings.position_ids"),
        ("llama", "model.layers.0.self_attn.rotary_emb.inv_freq"),
    ],
)
def test_buffers_older_checkpoints_store_are_not_unused_weights(
    invoke: Invoke, tmp_path: Path, name: str, extra: str
) -> None:
    """Older BERT and Llama checkpoints store buffers transformers computes and ignores on load
    (`position_ids`, `rotary_emb.inv_freq`): the model has a place for them, eval runs."""
    from safetensors.torch import load_file, save_file

    model = build(tmp_path / name, name)
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    tensors[extra] = torch.arange(16, dtype=torch.int64 if "position" in extra else torch.float32)
    save_file(tensors, weights, metadata={"format": "pt"})
    code, _, err = invoke("eval", str(model), str(model), *EVAL)
    assert code == 0, err
