"""Interop with transformers and compressed-tensors (the `.[interop]` extra), offline.

Tiny BERT (fp32) and tiny Llama (bf16) are built from configs with a fixed seed, exported with
qtool's compressed-tensors encoder and config writer, and loaded with `from_pretrained`: the
loaded Linear weights equal qtool's own dequantization bit for bit, the output equals the float
model's with those weights swapped in (exactly), and is close to the float model's (bounds below,
measured maxima in docs/formats.md); compressed-tensors' own decompressor gives the same weights.
Checkpoints written by compressed-tensors itself are read back by qtool bit for bit.

Known upstream bug (transformers 5.23 + compressed-tensors 0.20): the packed load path fails on
every asymmetric checkpoint; `CompressedTensorsConfig(dequantize=True)` loads them, so qtool's
asymmetric exports carry `"dequantize": true` and load on the default path. The test that asserts
the failure (on a copy without the key) starts failing when upstream fixes it: then update
docs/formats.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REASON = "needs the interop extra: pip install -c constraints.txt -e '.[interop]'"
transformers = pytest.importorskip("transformers", reason=REASON)
pytest.importorskip("compressed_tensors", reason=REASON)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from qtool import api  # noqa: E402
from qtool.api import QuantizeOptions  # noqa: E402
from qtool.cli import app  # noqa: E402
from qtool.formats.detect import detect  # noqa: E402
from qtool.formats.registry import open_reader  # noqa: E402
from qtool.io.stformat import read_header  # noqa: E402
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, Scheme, StorageDtype  # noqa: E402

# Third-party loaders warn freely (deprecations, "quantization_config from the model will be
# used"); none of that is qtool's contract.
pytestmark = pytest.mark.filterwarnings("ignore")

SYM, ASYM = Scheme.SYM, Scheme.ASYM
I8, I4 = StorageDtype.INT8, StorageDtype.INT4
# relative output error bounds against the float model (measured maxima in docs/formats.md)
BOUNDS = {("bert", 8): 0.005, ("bert", 4): 0.05, ("llama", 8): 0.05, ("llama", 4): 0.35}


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    cls: Any
    example: dict[str, torch.Tensor]

    def output(self, model: Any) -> torch.Tensor:
        with torch.no_grad():
            out = model(**self.example)
        return out.logits if self.name == "llama" else out.last_hidden_state


def build(root: Path, name: str) -> Model:
    """Save a tiny random model (seed 0, no download); quantized Linears have N >= 128 (T7)."""
    if name == "bert":
        cfg: Any = transformers.BertConfig(
            vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=256, max_position_embeddings=64,
        )  # fmt: skip
        cls, dtype = transformers.BertModel, torch.float32
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False,
        )  # fmt: skip
        cls, dtype = transformers.LlamaForCausalLM, torch.bfloat16
    torch.manual_seed(0)
    cls(cfg).to(dtype).eval().save_pretrained(root / name)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    return Model(name, root / name, cls, {"input_ids": ids})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("float")
    return {name: build(root, name) for name in ("bert", "llama")}


# ---------------------------------------------------------------- qtool's side


def export(src: Path, dst: Path, spec: QSpec, fallback: str = "error") -> None:
    """Write `src` as a compressed-tensors model directory the way `qtool quantize --format
    compressed-tensors` does (the same engine call)."""
    options = QuantizeOptions(spec, format="compressed-tensors", group_fallback=fallback)
    summary = api.quantize(src, dst, options, device="cpu")
    assert summary.outputs == [str(dst)]
    names = {p.name for p in src.iterdir()}
    assert names <= {p.name for p in dst.iterdir()}  # config, weights and companions


def qtool_read(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a compressed-tensors directory as qtool restores it (open_reader, as
    inspect/dequantize/compare do): `P.weight` for each quantized module, others as they are."""
    reader = open_reader(path)
    try:
        return {name: reader.values(name).clone() for name in reader.names}
    finally:
        reader.close()


# ---------------------------------------------------------------- compressed-tensors' side


def ct_decompress(path: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' model-free decompression of every quantized module ("P.weight")."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_quantizable_tensors

    doc = json.loads((path / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(doc)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors |= load_file(f)
    out: dict[str, torch.Tensor] = {}
    for scheme in qc.config_groups.values():  # first group wins (specific groups come first)
        comp = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
        names = comp.compression_param_names(scheme)
        matched = list(match_quantizable_tensors(tensors, qc.ignore, scheme.targets, [names[0]]))
        for module, _ in matched:
            if f"{module}.weight_scale" not in tensors:
                continue  # naive formats: `weight` also names the float tensors
            local = {p: tensors.pop(f"{module}.{p}") for p in names if f"{module}.{p}" in tensors}
            out[f"{module}.weight"] = comp.decompress(local, scheme)["weight"]
    return out


def ct_export(src: Model, dst: Path, weights: dict[str, Any], fmt: str | None = None) -> None:
    """Quantize every Linear (min-max) with compressed-tensors' own API and save to `dst`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(type="int", dynamic=False, **weights)
    model = src.cls.from_pretrained(src.path).eval()
    ignore = ["lm_head"] if src.name == "llama" else []
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore)
    )
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        w = m.weight.detach()
        if args.strategy == "group":
            g = w.unflatten(-1, (-1, args.group_size))
            lo, hi = g.amin(-1), g.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zp = calculate_qparams(lo, hi, args)
        m.weight_scale.data.copy_(scale.to(m.weight_scale.dtype))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zp.to(m.weight_zero_point.dtype))
        m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)


# ---------------------------------------------------------------- loading


def load(model: Model, path: Path, dequantize: bool) -> Any:
    """from_pretrained with the checkpoint's own dtype (trap T3: never override it here)."""
    if dequantize:
        qc = transformers.CompressedTensorsConfig(dequantize=True)
        return model.cls.from_pretrained(path, quantization_config=qc).eval()
    return model.cls.from_pretrained(path).eval()


def linear_weights(model: Any) -> dict[str, torch.Tensor]:
    return {
        f"{n}.weight": m.weight.detach()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def float_with(model: Model, weights: dict[str, torch.Tensor]) -> Any:
    """The float model with `weights` swapped in (names as in the checkpoint)."""
    m = model.cls.from_pretrained(model.path).eval()
    state = m.state_dict()
    m.load_state_dict({**state, **{k: v for k, v in weights.items() if k in state}})
    return m


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


# ---------------------------------------------------------------- qtool exports load


@dataclass(frozen=True)
class Case:
    model: str
    spec: QSpec
    mixed: bool = False  # fall back to channel for every tensor but down_proj/intermediate

    @property
    def id(self) -> str:
        label = self.spec.describe().replace(" ", "-").replace("axis-0", "channel")
        return f"{self.model}-{label}{'-mixed' if self.mixed else ''}"


CASES = [
    Case("bert", QSpec(SYM, I8, PerChannel(0))),
    Case("bert", QSpec(SYM, I4, PerGroup(32))),
    Case("bert", QSpec(SYM, I8, PerTensor())),
    Case("bert", QSpec(ASYM, I8, PerChannel(0))),
    Case("bert", QSpec(ASYM, I4, PerGroup(128))),
    Case("llama", QSpec(SYM, I8, PerChannel(0))),
    Case("llama", QSpec(SYM, I4, PerGroup(128))),
    Case("llama", QSpec(SYM, I4, PerGroup(32))),
    Case("llama", QSpec(ASYM, I8, PerChannel(0))),
    Case("llama", QSpec(ASYM, I4, PerGroup(32))),
    Case("llama", QSpec(SYM, I4, PerGroup(512)), mixed=True),
]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Model]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qtool-ct")
    for case in CASES:
        fallback = "channel" if case.mixed else "error"  # group 512 divides down_proj's K only
        export(models[case.model].path, root / case.id, case.spec, fallback)
    return {case.id: root / case.id for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_compressed_tensors_decompresses_qtool_exports_identically(
    case: Case, exports: dict[str, Path]
) -> None:
    ours = qtool_read(exports[case.id])
    theirs = ct_decompress(exports[case.id])
    assert theirs and set(theirs) <= set(ours)
    for name, w in theirs.items():
        assert torch.equal(w, ours[name]), name


def paths(case: Case) -> list[bool]:
    """dequantize flags of the load paths that work for this case (trap T1, T4): every
    single-scheme export, asymmetric ones too, as its config carries `"dequantize": true`."""
    if case.mixed:
        return [False]  # dequantize=True applies the first group to every module
    return [False, True]


@pytest.mark.parametrize(
    ("case", "dequantize"),
    [(c, d) for c in CASES for d in paths(c)],
    ids=lambda v: v.id if isinstance(v, Case) else ("dequantize" if v else "default"),
)
def test_transformers_loads_qtool_exports_bit_exact(
    case: Case, dequantize: bool, exports: dict[str, Path], models: dict[str, Model]
) -> None:
    model = models[case.model]
    loaded = load(model, exports[case.id], dequantize)
    y = model.output(loaded)  # the default path decompresses on the first forward
    ours = qtool_read(exports[case.id])
    weights = linear_weights(loaded)
    stored = read_header(exports[case.id] / "model.safetensors").by_name()
    packed = {n.removesuffix("_packed") for n in stored if n.endswith(".weight_packed")}
    assert packed <= set(weights)
    for name, w in weights.items():  # quantized and float Linears alike
        assert torch.equal(w, ours[name]), name
    assert torch.equal(y, model.output(float_with(model, ours)))
    y_float = model.output(model.cls.from_pretrained(model.path).eval())
    err = rel_error(y, y_float)
    print(f"{case.id} {'dequantize' if dequantize else 'default'}: output rel error {err:.4f}")
    assert err < BOUNDS[case.model, case.spec.dtype.bits]


@pytest.mark.parametrize("case", [c for c in CASES if c.spec.scheme is ASYM], ids=lambda c: c.id)
def test_default_path_still_fails_on_asymmetric(
    case: Case, exports: dict[str, Path], models: dict[str, Model], tmp_path: Path
) -> None:
    """Why qtool writes `"dequantize": true` into an asymmetric export: without the key,
    transformers' packed path still raises on it (upstream)."""
    src = exports[case.id]
    doc = json.loads((src / "config.json").read_text())
    assert doc["quantization_config"].pop("dequantize") is True
    for f in src.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        load(models[case.model], tmp_path, dequantize=False)


# ---------------------------------------------------------------- compressed-tensors' exports read


CT_CASES = {
    "llama-int4-asym-group32": (
        "llama",
        {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 32},
        None,
    ),
    "llama-int8-sym-channel": (
        "llama",
        {"num_bits": 8, "symmetric": True, "strategy": "channel"},
        None,
    ),
    "bert-int8-asym-tensor": (
        "bert",
        {"num_bits": 8, "symmetric": False, "strategy": "tensor"},
        None,
    ),
    "bert-int4-sym-group32": (
        "bert",
        {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32},
        None,
    ),
    "bert-int8-asym-channel-naive": (
        "bert",
        {"num_bits": 8, "symmetric": False, "strategy": "channel"},
        "naive-quantized",
    ),
}


@pytest.mark.parametrize("name", list(CT_CASES))
def test_qtool_reads_compressed_tensors_exports_bit_exact(
    name: str, models: dict[str, Model], tmp_path: Path
) -> None:
    model_name, weights, fmt = CT_CASES[name]
    ct_export(models[model_name], tmp_path / name, weights, fmt)
    assert detect(tmp_path / name).format == "compressed-tensors"
    ours = qtool_read(tmp_path / name)
    theirs = ct_decompress(tmp_path / name)
    assert len(theirs) == (14 if model_name == "llama" else 13)
    for module_weight, w in theirs.items():
        assert torch.equal(w, ours[module_weight]), module_weight
    float_names = set(load_file(models[model_name].path / "model.safetensors"))
    assert set(ours) == float_names


def test_cli_gates_and_dequantizes_a_compressed_tensors_export(
    models: dict[str, Model], tmp_path: Path
) -> None:
    """`qtool compare float/ ct/ --min-sqnr` and `qtool dequantize ct/` on compressed-tensors'
    own export, from the command line: the gate passes, the restored file has the float names
    and compressed-tensors' own values."""
    model = models["llama"]
    ct_dir = tmp_path / "ct"
    ct_export(model, ct_dir, {"num_bits": 8, "symmetric": True, "strategy": "channel"})
    runner = CliRunner()
    result = runner.invoke(app, ["compare", str(model.path), str(ct_dir), "--min-sqnr", "30"])
    assert result.exit_code == 0, result.stderr
    result = runner.invoke(app, ["inspect", str(ct_dir)])
    assert result.exit_code == 0 and "sym int8 axis 0" in result.stdout
    out = tmp_path / "restored.safetensors"
    result = runner.invoke(app, ["dequantize", str(ct_dir), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    restored = load_file(out)
    assert set(restored) == set(load_file(model.path / "model.safetensors"))
    for name, w in ct_decompress(ct_dir).items():
        assert torch.equal(restored[name], w), name


def test_readme_loads_the_sample_export_in_three_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The transformers snippet of docs/formats.md runs on its export of the sample model."""
    import re

    root = Path(__file__).parents[2]
    doc = (root / "docs" / "formats.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    snippet = next(b for b in blocks if "build/tiny-llama-w4a16" in b)
    assert len([line for line in snippet.splitlines() if line.strip()]) == 3
    monkeypatch.chdir(tmp_path)
    (tmp_path / "build").mkdir()  # the docs' `mkdir -p build`
    result = CliRunner().invoke(app, [
        "quantize", str(root / "sample_weights" / "tiny-llama"), "--format", "compressed-tensors",
        "--dtype", "int4", "--group-size", "32", "-o", "build/tiny-llama-w4a16",
    ])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    capsys.readouterr()
    exec(compile(snippet, "docs/formats.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "torch.Size([1, 3, 128])"


@pytest.mark.parametrize("how", ["llm-recipe", "recipe-and-budget"])
def test_transformers_loads_mixed_spec_exports(
    how: str, models: dict[str, Model], tmp_path: Path
) -> None:
    """examples/llm.toml (int4: down_proj g32, the other Linears g64), and a recipe (int8 MLP)
    with an error budget for the rest (int4 g32 mse at 20 dB) give exports with one config
    group per spec:
    transformers loads them (default path) to exactly qtool's values, and compressed-tensors
    decompresses each module as qtool reads it."""
    model, out = models["llama"], tmp_path / how
    root = Path(__file__).parents[2]
    if how == "llm-recipe":
        recipe = api.load_recipe(root / "examples" / "llm.toml")
        options = QuantizeOptions(QSpec(), format="compressed-tensors", recipe=recipe)
    else:
        path = tmp_path / "mlp-int8.toml"
        path.write_text('[[rule]]\nmatch = "*.mlp.*"\ndtype = "int8"\ngranularity = "channel"\n')
        recipe = api.load_recipe(path)
        options = QuantizeOptions(
            QSpec(), format="compressed-tensors", recipe=recipe, target_sqnr=20.0
        )
    api.quantize(model.path, out, options, device="cpu")
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    specs = {(g["weights"]["num_bits"], g["weights"]["group_size"]) for g in groups.values()}
    assert len(specs) == len(groups)  # one group per distinct spec
    assert specs == ({(4, 32), (4, 64)} if how == "llm-recipe" else {(8, None), (4, 32)})
    ours = qtool_read(out)
    for name, w in ct_decompress(out).items():
        assert torch.equal(w, ours[name]), name
    loaded = load(model, out, dequantize=False)
    y = model.output(loaded)
    for name, w in linear_weights(loaded).items():
        assert torch.equal(w, ours[name]), name
    assert torch.equal(y, model.output(float_with(model, ours)))
