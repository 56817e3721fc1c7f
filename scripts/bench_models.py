"""Inputs and contenders of scripts/bench.py's end-to-end sections (imported by it).

- A SmolLM2-135M-shaped bf16 model directory built offline from a config (30 layers, hidden 576,
  272 tensors, tied embeddings): random N(0, 0.02) weights, norms at 1.
- Sharded fp32 checkpoints (an index and shards of at most --shard-gib) for the growth sweep.
- llm-compressor's `model_free_ptq` in its own virtual environment under build/ (it is not a
  dependency of qtool): created on first use, offline-installable as
  docs/performance.md says (--no-deps plus a list; torch, transformers and compressed-tensors
  come from qtool's environment through a .pth file).
- The qtool command lines of a source tree (the one measured, or an older one for before/after
  in the same run), with numba hidden when asked (as on a machine without qtool[fast]).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

GiB = 1 << 30
SMOL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
}
LLMC_PACKAGES = [
    "llmcompressor==0.14.0.1",
    "datasets",
    "nvidia-ml-py",
    "pillow",
    "requests",
    "loguru",
    "auto-round<=0.15.1",
    "multiprocess",
    "pandas",
    "pyarrow",
    "dill",
    "xxhash",
]


def smol_config(source: Path | None) -> dict[str, object]:
    """The real SmolLM2 config when given (its shapes are all that is used), else the same
    numbers written out here."""
    if source is not None and source.is_file():
        doc = json.loads(source.read_text())
        assert isinstance(doc, dict)
        return doc
    return dict(SMOL_CONFIG)


def _int(config: dict[str, object], key: str, default: int | None = None) -> int:
    value = config.get(key) or default
    if not isinstance(value, int):
        raise SystemExit(f"config: {key} is not an integer ({value!r})")
    return value


def smol_tensors(config: dict[str, object]) -> dict[str, tuple[int, ...]]:
    """A Llama model's tensor names and shapes from its config (tied: no lm_head)."""
    h, inter = _int(config, "hidden_size"), _int(config, "intermediate_size")
    heads, kv = _int(config, "num_attention_heads"), _int(config, "num_key_value_heads")
    head_dim = _int(config, "head_dim", h // heads)
    layers, vocab = _int(config, "num_hidden_layers"), _int(config, "vocab_size")
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, h),
            f"{p}.self_attn.k_proj.weight": (kv * head_dim, h),
            f"{p}.self_attn.v_proj.weight": (kv * head_dim, h),
            f"{p}.self_attn.o_proj.weight": (h, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def write_smol(directory: Path, config_source: Path | None) -> int:
    """The SmolLM2-shaped bf16 model directory; returns its bytes of weights."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = smol_config(config_source)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in smol_tensors(config).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return (directory / "model.safetensors").stat().st_size


# ---- llm-compressor ----------------------------------------------------------------------------


def llmc_python(build: Path) -> Path | None:
    """The python of llm-compressor's own environment under `build`, created on first use
    (None, with the reason printed, when it cannot be)."""
    venv = build / "llmc-venv"
    python = venv / "bin" / "python"
    if not _llmc_works(python):
        try:
            _make_llmc_venv(venv)
        except (OSError, subprocess.CalledProcessError) as err:
            print(f"llm-compressor environment not made ({err}); model_free_ptq not measured")
            return None
    return python if _llmc_works(python) else None


def _llmc_works(python: Path) -> bool:
    if not python.exists():
        return False
    check = [str(python), "-c", "from llmcompressor import model_free_ptq"]
    return subprocess.run(check, capture_output=True, check=False).returncode == 0


def _make_llmc_venv(venv: Path) -> None:
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "qtool-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*pip, *LLMC_PACKAGES], check=True)


LLMC_RUN = """
import sys
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import model_free_ptq
src, out, observer = sys.argv[1], sys.argv[2], sys.argv[3]
weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                           group_size=64, observer=observer)
scheme = QuantizationScheme(targets=["Linear"], weights=weights)
model_free_ptq(src, out, scheme=scheme, ignore=["lm_head", "re:.*embed_tokens"], device="cpu")
"""


def llmc_command(python: Path, src: Path, out: Path, observer: str) -> list[str]:
    """model_free_ptq of `src`: int4 groups of 64, symmetric, the given observer."""
    return [str(python), "-c", LLMC_RUN, str(src), str(out), observer]


# ---- qtool command lines -----------------------------------------------------------------------

NO_NUMBA = (
    "import sys, runpy; sys.modules['numba'] = None; sys.argv = ['qtool', *sys.argv[1:]]; "
    "runpy.run_module('qtool', run_name='__main__')"
)


def qtool_command(args: list[str], numba: bool = True) -> list[str]:
    """`qtool ARGS` in a fresh interpreter (numba hidden when `numba` is False)."""
    if numba:
        return [sys.executable, "-m", "qtool", *args]
    return [sys.executable, "-c", NO_NUMBA, *args]


def tree_env(tree: Path | None) -> dict[str, str]:
    """The environment that makes `tree`'s qtool the one imported (None: this checkout)."""
    root = tree or Path(__file__).resolve().parent.parent
    return {"PYTHONPATH": str(root)}


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def sweep_sizes(max_gib: float) -> list[float]:
    """64 MiB, 256 MiB, 1, 4, ... GiB up to max_gib (and max_gib itself)."""
    sizes = [4**k / 16 for k in range(int(math.log(max(max_gib, 1 / 16) * 16, 4)) + 1)]
    return sorted({*sizes, max_gib})
