"""GPTQ's numerics on real Linears (docs/numerics.md, "GPTQ"): per Linear of SmolLM2-135M on the
float model's inputs, the output error tr(dW H dW^T) of GPTQ relative to round to nearest, on
held-out calibration windows and on the check text, for the choices the solve leaves open.

Usage: python scripts/gptq_layers.py MODEL_DIR [--layers 2 12 24] [--fit 12] [--spec int4g64]
Calibration text: qtool calibrate's default (stdlib docstrings); check text: CPython's LICENSE.txt
(engine/calibrate/data.py). Windows of 256 tokens; the fit windows, then 4 held-out windows
from further in the calibration text, then 4 of the check text. Prints, per Linear, the ratio
for each variant (1.000 = rounding's error), then each variant's geometric mean; and, per
Linear, the float32 Hessian against one summed in float64 (the fit windows added 8 times over).
By hand only (needs transformers and the model; minutes on one thread).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from qtool.engine.calibrate.data import check_text, default_text
from qtool.numerics import kernels
from qtool.numerics.gptq import Hessian, gptq_quantize, output_error
from qtool.spec import PerGroup, QSpec, Scheme, StorageDtype

LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
CTX = 256
# (label, dynamic_groups, act_order, damp)
VARIANTS = [
    ("static", False, True, 0.01),
    ("dynamic", True, True, 0.01),
    ("no-act-order", False, False, 0.01),
    ("damp-0.1", False, True, 0.1),
    ("damp-1", False, True, 1.0),
]
SPECS = {
    "int4g64": QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(64)),
    "asym-int4g64": QSpec(Scheme.ASYM, StorageDtype.INT4, PerGroup(64)),
    "int4g128": QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(128)),
}


class _Stop(Exception):
    """Raised by the deepest hook: the rest of the model is not needed."""


def _windows(tok: Any, text: str, n: int, skip: int = 0) -> torch.Tensor:
    ids: torch.Tensor = tok(text[: 40 * CTX * (n + skip)], return_tensors="pt").input_ids[0]
    if ids.numel() < (skip + n) * CTX:
        raise SystemExit(f"the text gives {ids.numel()} tokens, fewer than {(skip + n) * CTX}")
    return ids[skip * CTX : (skip + n) * CTX].view(n, CTX)


def _hessians(
    model: Any, layers: list[int], sets: dict[str, torch.Tensor]
) -> dict[tuple[int, str, str], Hessian]:
    """Every (layer, Linear, set)'s Hessian of its float inputs; 'fit64' in float64."""
    found: dict[tuple[int, str, str], Hessian] = {}
    current: list[str] = []
    deepest = (layers[-1], LINEARS[-1])

    def hook(layer: int, name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor]], None]:
        def pre(_: torch.nn.Module, args: tuple[torch.Tensor]) -> None:
            for s in current:
                found[layer, name, s].add(args[0].detach())
            if (layer, name) == deepest:
                raise _Stop

        return pre

    for layer in layers:
        for name in LINEARS:
            linear = model.model.layers[layer].get_submodule(name)
            for s in [*sets, "fit64"]:
                dtype = torch.float64 if s == "fit64" else torch.float32
                found[layer, name, s] = Hessian(linear.in_features, dtype=dtype)
            linear.register_forward_pre_hook(hook(layer, name))
    with torch.no_grad():
        for s, windows in sets.items():
            current[:] = [s, "fit64"] if s == "fit" else [s]
            for x in windows:
                with contextlib.suppress(_Stop):
                    model(x[None])
    return found


def _restored(q: kernels.QuantizedTensor, spec: QSpec, shape: tuple[int, ...]) -> torch.Tensor:
    return kernels.dequantize(q.q, q.scale, q.zero_point, spec, shape=shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12, 24])
    parser.add_argument("--fit", type=int, default=12, help="calibration windows of 256")
    parser.add_argument("--spec", choices=sorted(SPECS), default="int4g64")
    args = parser.parse_args()
    import transformers

    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    calibration = default_text().content
    sets = {
        "fit": _windows(tok, calibration, args.fit),
        "held": _windows(tok, calibration, 4, skip=args.fit + 8),
        "check": _windows(tok, check_text().content, 4),
    }
    hessians = _hessians(model, sorted(args.layers), sets)
    spec = SPECS[args.spec]
    ratios: dict[str, list[float]] = {}
    for layer in sorted(args.layers):
        for name in LINEARS:
            w = model.model.layers[layer].get_submodule(name).weight.detach()
            shape = tuple(w.shape)
            rtn = _restored(kernels.quantize_tensor(w, spec, with_errors=False), spec, shape)
            fit = hessians[layer, name, "fit"].matrix
            exact = hessians[layer, name, "fit64"]
            h64 = exact.sum * (2.0 / exact.rows)
            drift = float((fit.double() - h64).norm() / h64.norm())
            cells = [f"H32 vs H64 {drift:.1e}"]
            for label, dynamic, act_order, damp in VARIANTS:
                solved = gptq_quantize(
                    w, fit, spec, dynamic_groups=dynamic, act_order=act_order, damp=damp
                )
                g = _restored(solved.quantized(spec), spec, shape)
                for s in ("held", "check"):
                    h = hessians[layer, name, s].matrix
                    r = output_error(g - w, h) / output_error(rtn - w, h)
                    ratios.setdefault(f"{label:13s} {s:5s}", []).append(r)
                    cells.append(f"{label}/{s} {r:.3f}")
            print(f"layer {layer} {name}: " + "  ".join(cells), flush=True)
    print(f"{args.spec}, {args.fit} fit windows of {CTX}: error relative to rounding (geomean)")
    for key, values in ratios.items():
        mean = math.exp(sum(map(math.log, values)) / len(values))
        print(f"  {key} {mean:.3f} over {len(values)} Linears")


if __name__ == "__main__":
    main()
