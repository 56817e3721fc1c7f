"""`calibrate`'s block-by-block pass against the reference (ImatrixProbe's hooks on the whole
float model loaded by transformers): the same sums to float tolerance and the same row counts,
for Llama (tied and not), Qwen2 (biases, its per-layer mask mapping), Qwen3 (norms inside
attention) and Mistral; merges of runs equal one run over all their texts; at most one block is
materialized at a time; the file is read back by qtool and by gguf-py with llama.cpp's names and
qtool's provenance keys."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import transformers  # noqa: E402

from qtool.engine.calibrate import run as calibrate_run  # noqa: E402
from qtool.engine.calibrate import sequential as block_pass  # noqa: E402
from qtool.engine.calibrate.data import take_windows  # noqa: E402
from qtool.engine.calibrate.run import (  # noqa: E402
    CalibrateOptions,
    calibrate,
    merge_files,
)
from qtool.engine.imatrix_hooks import ImatrixProbe  # noqa: E402
from qtool.engine.model import hf  # noqa: E402
from qtool.engine.model.text import read_text  # noqa: E402
from qtool.formats.imatrix import read_imatrix, read_imatrix_file  # noqa: E402
from qtool.formats.imatrix.provenance import dataset_infos  # noqa: E402
from tests.eval_models import VOCAB, build, save_tokenizer  # noqa: E402

CTX = 32
TEXT_A = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(60))
TEXT_B = " ".join(f"Delta{i}: epsilon zeta eta {i % 5}!" for i in range(60))


def _other(directory: Path, kind: str) -> Path:
    torch.manual_seed(0)
    common: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    if kind == "qwen2":
        cfg: Any = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model: Any = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":  # q_norm / k_norm inside attention
        cfg = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.MistralConfig(**common, tie_word_embeddings=False)
        model = transformers.MistralForCausalLM(cfg)
    model.to(torch.bfloat16).eval().save_pretrained(directory)
    save_tokenizer(directory, encoder=False)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("calibrate")
    out = {name: build(root / name, name) for name in ("llama", "llama-tied")}
    out |= {name: _other(root / name, name) for name in ("qwen2", "qwen3", "mistral")}
    (root / "a.txt").write_text(TEXT_A)
    (root / "b.txt").write_text(TEXT_B)
    return out


def _texts(models: dict[str, Path]) -> tuple[Path, Path]:
    root = models["llama"].parent
    return root / "a.txt", root / "b.txt"


def _reference(model_dir: Path, texts: list[Path], tokens: int) -> dict[str, Any]:
    """Sums and counts from hooks on every Linear of the whole float32 model, over the same
    windows, keyed by the checkpoint's names."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = hf.tokenizer(model_dir, "the model", config)
    sources = take_windows([read_text(p) for p in texts], tokenizer, tokens, CTX)
    with torch.no_grad(), ImatrixProbe(model, include=lambda n: ".layers." in n) as probe:
        for source in sources:
            for window in source.windows:
                model(input_ids=torch.tensor([window]))
    return probe.stats()


@pytest.mark.parametrize("name", ["llama", "llama-tied", "qwen2", "qwen3", "mistral"])
def test_block_by_block_equals_hooks_on_the_whole_model(
    models: dict[str, Path], tmp_path: Path, name: str
) -> None:
    a, b = _texts(models)
    out = tmp_path / "x.imatrix.gguf"
    summary = calibrate(models[name], out, CalibrateOptions((a, b), tokens=8 * CTX, ctx=CTX))
    got = read_imatrix(out)
    want = _reference(models[name], [a, b], 8 * CTX)
    blocks = summary.blocks
    assert len(got.entries) == len(want) == 7 * blocks
    pairs = (
        ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
        ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),
    )  # fmt: skip
    hf_of = {
        f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight"
        for i in range(blocks)
        for g, h in pairs
    }
    for gguf_name, stats in got.entries.items():
        ref = want[hf_of[gguf_name]]
        assert stats.counts.tolist() == ref.counts.tolist() == [8 * CTX]
        np.testing.assert_allclose(stats.sums, ref.sums, rtol=2e-5, atol=1e-6)
    assert got.chunk_size == CTX and got.chunk_count == 8
    assert summary.windows == 8 and summary.tokens == 8 * CTX


def test_the_importance_matrix_is_a_method_of_the_block_pass(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """calibrate runs the calibrated methods' block-by-block pass (run_sequential) with a policy
    that keeps the weights: one pass per block, each window once (a second pass would run every
    block twice for the same statistics)."""
    passes: list[bool] = []
    real = block_pass.run_sequential

    def spy(*args: Any, **kwargs: Any) -> None:
        passes.append(kwargs["keeps_weights"])
        real(*args, **kwargs)

    class Counting:
        def __init__(self) -> None:
            self.total, self.done = 0, dict[str, int]()

        def start(self, total_bytes: int) -> None:
            self.total = total_bytes

        def advance(self, name: str, nbytes: int) -> None:
            self.done[name] = self.done.get(name, 0) + nbytes

    monkeypatch.setattr(block_pass, "run_sequential", spy)
    progress = Counting()
    opts = CalibrateOptions((_texts(models)[0],), tokens=4 * CTX, ctx=CTX)
    summary = calibrate(models["llama"], tmp_path / "x.gguf", opts, progress)
    assert passes == [True]
    assert progress.done.keys() == {f"block {i}" for i in range(summary.blocks)}
    assert sum(progress.done.values()) == progress.total == 4 * CTX  # tokens through the model


def test_windows_are_taken_from_each_text_in_turn(models: dict[str, Path], tmp_path: Path) -> None:
    a, b = _texts(models)
    out = tmp_path / "x.imatrix.gguf"
    summary = calibrate(models["llama"], out, CalibrateOptions((a, b), tokens=5 * CTX, ctx=CTX))
    assert [d.tokens for d in summary.datasets] == [3 * CTX, 2 * CTX]
    assert [d.name for d in summary.datasets] == [str(a), str(b)]


def test_a_merge_of_runs_equals_one_run_over_their_texts(
    models: dict[str, Path], tmp_path: Path
) -> None:
    a, b = _texts(models)
    one, two, both = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "ab.gguf"
    calibrate(models["llama"], one, CalibrateOptions((a,), tokens=4 * CTX, ctx=CTX))
    calibrate(models["llama"], two, CalibrateOptions((b,), tokens=4 * CTX, ctx=CTX))
    calibrate(models["llama"], both, CalibrateOptions((a, b), tokens=8 * CTX, ctx=CTX))
    merged = tmp_path / "merged.gguf"
    summary = merge_files([one, two], merged, force=False)
    got, want = read_imatrix(merged), read_imatrix(both)
    assert sorted(got.entries) == sorted(want.entries)
    for name, stats in got.entries.items():
        assert stats.counts.tolist() == want.entries[name].counts.tolist() == [8 * CTX]
        np.testing.assert_allclose(stats.sums, want.entries[name].sums, rtol=1e-5)
    assert got.datasets == want.datasets == (str(a), str(b))
    assert got.chunk_count == want.chunk_count == 8
    infos = [dataset_infos(p, f.metadata, f.imatrix.datasets) for p in (merged, both)
             for f in [read_imatrix_file(p)]]  # fmt: skip
    assert infos[0] == infos[1] == summary.datasets
    assert all(d.sha256 and d.tokens == 4 * CTX for d in summary.datasets)


def test_at_most_one_block_is_materialized_at_a_time(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spy on the probe the pass opens on each block once it is loaded: what of the whole
    model is real (not meta) at that moment."""
    seen: list[tuple[int, set[str]]] = []
    whole: list[Any] = []

    def run_blocks(model: Any, *args: Any) -> Any:
        whole.append(model)
        return block_pass.run_blocks(model, *args)

    class Spy(ImatrixProbe):
        def __init__(self, block: Any) -> None:
            super().__init__(block)
            real = {n for n, p in whole[0].named_parameters() if not p.is_meta}
            seen.append((len(seen), real))

    monkeypatch.setattr(calibrate_run, "run_blocks", run_blocks)
    monkeypatch.setattr(block_pass, "ImatrixProbe", Spy)
    opts = CalibrateOptions((_texts(models)[0],), tokens=2 * CTX, ctx=CTX)
    calibrate(models["mistral"], tmp_path / "x.gguf", opts)
    assert [i for i, _ in seen] == [0, 1, 2]
    for index, real in seen:
        blocks = {n.split(".")[2] for n in real if n.startswith("model.layers.")}
        assert blocks == {str(index)}, real
        assert not {n for n in real if not n.startswith("model.layers.")} - {"model.norm.weight"}


def test_the_file_is_llama_cpps_format_with_qtools_provenance(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import gguf

    out = tmp_path / "x.imatrix.gguf"
    a = _texts(models)[0]
    summary = calibrate(models["llama"], out, CalibrateOptions((a,), tokens=2 * CTX, ctx=CTX))
    reader = gguf.GGUFReader(out)
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.type"] == "imatrix"
    assert fields["imatrix.datasets"] == [str(a)]
    assert fields["imatrix.chunk_size"] == CTX and fields["imatrix.chunk_count"] == 2
    assert fields["qtool.datasets.sha256"] == [summary.datasets[0].sha256]
    assert fields["qtool.datasets.tokens"] == [2 * CTX]
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.ffn_down.weight.in_sum2"].shape.tolist() == [128]
    assert tensors["blk.1.attn_q.weight.counts"].data.tolist() == [2 * CTX]
    assert len(tensors) == 2 * 7 * 2


def test_every_window_starts_with_bos_as_llama_imatrix_chunks_do(models: dict[str, Path]) -> None:
    config = transformers.AutoConfig.from_pretrained(models["llama"])
    tokenizer = hf.tokenizer(models["llama"], "the model", config)
    text = read_text(_texts(models)[0])
    ids = tokenizer.ids(text.content)
    (source,) = take_windows([text], tokenizer, 3 * CTX + 5, CTX)
    assert ids[0] == 1 and len(source.windows) == 3
    for i, window in enumerate(source.windows):
        assert window == [1, *ids[i * CTX + 1 : (i + 1) * CTX]]


def test_jsonl_text_lines_and_chat_messages_become_text(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import json

    from qtool.engine.calibrate.data import load_text

    config = transformers.AutoConfig.from_pretrained(models["llama"])
    tokenizer = hf.tokenizer(models["llama"], "the model", config)
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "first piece"}) + "\n\n" + json.dumps({"text": "two"}))
    assert load_text(plain, tokenizer).content == "first piece\n\ntwo"
    chat = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"text": "plain"}))
    tokenizer.backend.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    )
    text = load_text(chat, tokenizer)
    assert text.content == "<user>hi\n<assistant>hello\n\n\nplain"
    assert text.source == str(chat)


def test_chat_messages_use_the_template_the_model_directory_holds(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """transformers saves a model's chat template as chat_template.jinja: it reaches the
    tokenizer through qtool's checked copy (it was left out, and chat JSONL was refused)."""
    import json

    from qtool.engine.calibrate.data import load_text

    model = tmp_path / "model"
    shutil.copytree(models["llama"], model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    config = transformers.AutoConfig.from_pretrained(model)
    tokenizer = hf.tokenizer(model, "the model", config)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert load_text(chat, tokenizer).content == "[hi]"
