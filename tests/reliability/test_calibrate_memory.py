"""`qtool calibrate` holds one decoder block at a time: a generated Llama whose float32 weights
(about 230 MB) are more than twice the resident-memory budget calibrates within it. The budget
is measured in a subprocess, once everything is imported and warmed up on a tiny model: the
peak resident set (VmHWM, reset through /proc/self/clear_refs) minus the resident set before
the run. (An RLIMIT_AS cap measures glibc's heap policy instead: its address space grows with
reuse even while resident memory stays flat.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.eval_models import VOCAB, build, save_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 100 << 20  # resident memory allowed beyond what the warmed-up process holds
LAYERS, HIDDEN, INTERMEDIATE = 24, 384, 1536


def _big_llama(directory: Path) -> int:
    """A Llama of LAYERS blocks with random bf16 weights, saved without building it for real;
    its parameter count."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=6, num_key_value_heads=6,
        max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in transformers.LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    tensors = {
        n: (torch.randn(s, generator=generator) * 0.05).to(torch.bfloat16)
        for n, s in shapes.items()
    }  # fmt: skip
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(directory)
    save_tokenizer(directory, encoder=False)
    return sum(t.numel() for t in tensors.values())


SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from qtool import api

    def status(key):
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                    if line.startswith(key + ":"))

    small, big, text, out = sys.argv[1:5]
    kwargs = dict(texts=[Path(text)], tokens=4 * 64, ctx=64, threads=1, force=True)
    api.calibrate(Path(small), Path(out), **kwargs)  # imports, thread pools, caches: warm
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = status("VmRSS")
    summary = api.calibrate(Path(big), Path(out), **kwargs)
    print(json.dumps({"grew": status("VmHWM") - before, "entries": summary.entries,
                      "blocks": summary.blocks}))
    """
)


@pytest.mark.slow
def test_a_model_twice_the_memory_budget_calibrates_within_it(tmp_path: Path) -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    params = _big_llama(tmp_path / "big")
    assert params * 4 > 2 * BUDGET
    small = build(tmp_path / "small", "llama")
    text = tmp_path / "text.txt"
    text.write_text("Calibration needs only one block at a time. " * 40)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    args = [str(small), str(tmp_path / "big"), str(text), str(tmp_path / "x.gguf")]
    done = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["entries"] == 7 * LAYERS and result["blocks"] == LAYERS
    assert result["grew"] < BUDGET, f"peak resident set grew by {result['grew'] >> 20} MiB"
