"""AWQ's numerics on one real MLP (docs/numerics.md, "AWQ"): for a layer of SmolLM2-135M, the
scales of post_attention_layernorm -> gate_proj, up_proj and then up_proj -> down_proj are
searched on the MLP's output error (numerics/awq.py: AbsMean, weight_means, search,
quantized_scaled), folded, and the quantized MLP's output error compared with rounding's on the
fit windows, held-out calibration windows and the check text; the folded float MLP's outputs
are compared with the original's.

Usage: python scripts/awq_mlp.py MODEL_DIR [--layer 12] [--fit 8]
Calibration text: qtool calibrate's default (stdlib docstrings); check text: CPython's
LICENSE.txt. Windows of 256 tokens. By hand only (needs transformers and the model).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from typing import Any

import torch

from qtool.engine.calibrate.data import check_text, default_text
from qtool.numerics import awq
from qtool.spec import PerGroup, QSpec, Scheme, StorageDtype

CTX = 256
SPEC = QSpec(Scheme.ASYM, StorageDtype.INT4, PerGroup(64))


class _Stop(Exception):
    """Raised once the norm's input is caught: the rest of the model is not needed."""


def _windows(tok: Any, text: str, n: int, skip: int = 0) -> torch.Tensor:
    ids: torch.Tensor = tok(text[: 40 * CTX * (n + skip)], return_tensors="pt").input_ids[0]
    return ids[skip * CTX : (skip + n) * CTX].view(n, CTX)


def _norm_inputs(model: Any, layer: int, sets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The residual stream entering the layer's post_attention_layernorm, per set of windows."""
    caught: list[torch.Tensor] = []

    def pre(_: torch.nn.Module, args: tuple[torch.Tensor]) -> None:
        caught.append(args[0].detach())
        raise _Stop

    norm = model.model.layers[layer].post_attention_layernorm
    handle = norm.register_forward_pre_hook(pre)
    found = {}
    with torch.no_grad():
        for name, windows in sets.items():
            caught.clear()
            for x in windows:
                with contextlib.suppress(_Stop):
                    model(x[None])
            found[name] = torch.cat(caught)
    handle.remove()
    return found


def _quantized(mlp: Any, scales: dict[str, torch.Tensor]) -> Any:
    """A copy of the MLP whose Linears act with Q(W s) / s (s = 1 where not given)."""
    q = copy.deepcopy(mlp)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear = q.get_submodule(name)
            s = scales.get(name, torch.ones(linear.in_features))
            linear.weight.copy_(awq.quantized_scaled(linear.weight, s, SPEC))
    return q


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--layer", type=int, default=12)
    parser.add_argument("--fit", type=int, default=8, help="calibration windows of 256")
    args = parser.parse_args()
    import transformers

    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    calibration = default_text().content
    xs = _norm_inputs(
        model,
        args.layer,
        {
            "fit": _windows(tok, calibration, args.fit),
            "held": _windows(tok, calibration, 4, skip=args.fit + 8),
            "check": _windows(tok, check_text().content, 4),
        },
    )
    layer = model.model.layers[args.layer]
    norm, mlp = layer.post_attention_layernorm, layer.mlp

    def out(n: Any, m: Any, s: str) -> torch.Tensor:
        with torch.no_grad():
            result: torch.Tensor = m(n(xs[s]))
            return result

    ref = {s: out(norm, mlp, s) for s in xs}

    def err(n: Any, m: Any, s: str) -> float:
        return float(((out(n, m, s) - ref[s]) ** 2).mean())

    # norm -> gate, up
    means = awq.AbsMean(mlp.gate_proj.in_features)
    with torch.no_grad():
        means.add(norm(xs["fit"]))
    w_mean = awq.weight_means([mlp.gate_proj.weight, mlp.up_proj.weight], SPEC)
    first = awq.search(
        lambda s: err(norm, _quantized(mlp, {"gate_proj": s, "up_proj": s}), "fit"),
        means.mean,
        w_mean,
    )
    norm2, mlp2 = copy.deepcopy(norm), copy.deepcopy(mlp)
    awq.scale_inputs([mlp2.gate_proj, mlp2.up_proj], first.scales)
    awq.fold_into_norm(norm2, first.scales)
    # up -> down
    means = awq.AbsMean(mlp.down_proj.in_features)
    with torch.no_grad():
        h = norm2(xs["fit"])
        means.add(mlp2.act_fn(mlp2.gate_proj(h)) * mlp2.up_proj(h))
    second = awq.search(
        lambda s: err(norm2, _quantized(mlp2, {"down_proj": s}), "fit"),
        means.mean,
        awq.weight_means([mlp2.down_proj.weight], SPEC),
    )
    awq.scale_inputs([mlp2.down_proj], second.scales)
    awq.fold_into_linear(mlp2.up_proj, second.scales)
    for label, c in (("gate/up", first), ("down", second)):
        print(f"{label}: alpha {c.alpha:.3f} duo {c.duo}, fit loss {c.loss:.4g} "
              f"(identity {c.identity_loss:.4g})")  # fmt: skip
    rtn, smoothed = _quantized(mlp, {}), _quantized(mlp2, {})
    for s in xs:
        drift = float((out(norm2, mlp2, s) - ref[s]).abs().amax() / ref[s].abs().amax())
        a, r = err(norm2, smoothed, s), err(norm, rtn, s)
        print(f"{s}: AWQ {a:.4g} vs rounding {r:.4g} ({a / r:.3f}); folded float drift {drift:.1e}")


if __name__ == "__main__":
    main()
