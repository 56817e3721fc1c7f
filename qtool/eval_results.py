"""What `qtool eval` measured, as values (torch-free): both models' figures on the same tokens,
one row per quantized Linear, and the bounds a CI gate puts on them (definitions in
docs/eval.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qtool.calibration import TextUse

CAUSAL_LM = "causal-lm"
ENCODER = "encoder"


@dataclass(frozen=True)
class Distribution:
    """A per-position figure over every scored position: mean, median, 90th, 99th and 99.9th
    percentiles (linear interpolation between the closest ranks, numpy's default and
    llama-perplexity's) and max."""

    mean: float
    median: float
    p90: float
    p99: float
    max: float
    p999: float = math.nan


@dataclass(frozen=True)
class CausalFigures:
    """A causal LM pair: perplexity of each, KL(float || quant) per scored position, and how
    often both models' most likely next token is the same."""

    ppl_float: float
    ppl_quant: float
    kl: Distribution
    agree: int  # scored positions where both argmax tokens are equal
    predicted: int  # scored positions (tokens predicted), sum over windows of (L - 1)
    # mean over positions of ln p_f(y) - ln p_q(y) = ln(ppl_quant / ppl_float), its standard
    # error, and the mean of p_q(y) - p_f(y) (y: the token that came), as llama-perplexity
    ln_ratio: float = math.nan
    ln_ratio_se: float = math.nan
    dp_mean: float = math.nan

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_quant / self.ppl_float

    @property
    def top1(self) -> float:
        """The share of scored positions where the two models agree on the next token."""
        return self.agree / self.predicted if self.predicted else math.nan


@dataclass(frozen=True)
class EncoderFigures:
    """An encoder pair: cosine of the mean-pooled last hidden states of each sentence, and the
    relative error of the last hidden state over every token."""

    sentences: int
    cosine_mean: float
    cosine_min: float
    hidden_rel_error: float  # sqrt(sum |H_q - H_f|^2 / sum |H_f|^2)


@dataclass(frozen=True)
class LayerRow:
    """One Linear whose weight differs between the models: the SQNR of its weight, and of its
    output on the float model's own inputs X: 10 log10(|X W^T|^2 / |X (W - W_q)^T|^2)."""

    name: str  # the module's name in the model
    shape: tuple[int, ...]
    weight_sqnr_db: float
    output_sqnr_db: float
    tokens: int  # rows of X seen (0: the layer never ran on the text)


@dataclass(frozen=True)
class TextInfo:
    """Where the text came from, so a figure can be reproduced: its source, length, digest."""

    source: str
    chars: int
    sha256: str


@dataclass(frozen=True)
class FloatPass:
    """FLOAT's side alone (eval FLOAT --save-logits FILE, no QUANT): what it was measured on,
    its perplexity, and the pass's seconds (0 when read from a logits file)."""

    float_dir: str
    text: TextInfo
    tokens: int
    ctx: int
    windows: int
    positions: int
    dtype: str
    device: str
    ppl_float: float
    seconds: float


@dataclass(frozen=True)
class EvalSummary:
    inputs: tuple[str, str]  # FLOAT, QUANT
    loaded_as: str  # how QUANT was loaded, e.g. "compressed-tensors, by transformers"
    architecture: str
    kind: str  # CAUSAL_LM or ENCODER
    text: TextInfo
    tokenizer: str  # whose tokenizer made the tokens
    tokens: int  # tokens run through both models
    ctx: int  # window length (causal) or sentence cut-off (encoder)
    windows: int  # windows (causal) or sentences (encoder)
    dtype: str
    device: str
    changed: int  # parameter tensors of QUANT whose values differ from FLOAT's
    parameters: int
    causal: CausalFigures | None
    encoder: EncoderFigures | None
    layers: tuple[LayerRow, ...] | None  # None: not asked for
    load_seconds: float
    eval_seconds: float
    notes: tuple[str, ...] = ()
    in_sample: tuple[TextUse, ...] = ()  # QUANT's calibration or check texts that are the text

    @property
    def tokens_per_second(self) -> float:
        """Tokens through both models per second of evaluation (loading excluded)."""
        return self.tokens / self.eval_seconds if self.eval_seconds > 0 else math.inf


# ---- gates ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalBounds:
    """Bounds on the model-level figures (None: not bounded): mean KL per token, the
    perplexity ratio quant / float, the top-1 agreement (a share, 0..1) and the mean cosine."""

    max_kl: float | None = None
    max_ppl_ratio: float | None = None
    min_top1: float | None = None
    min_cosine: float | None = None

    def __post_init__(self) -> None:
        ranges = {
            "max_kl": (0.0, math.inf),
            "max_ppl_ratio": (0.0, math.inf),
            "min_top1": (0.0, 1.0),
            "min_cosine": (-1.0, 1.0),
        }
        for name, (lo, hi) in ranges.items():
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and lo <= value <= hi):
                raise ValueError(f"{name}: expected a number in [{lo}, {hi}], got {value}")

    @property
    def active(self) -> bool:
        return any(v is not None for v in self.as_dict().values())

    def as_dict(self) -> dict[str, float | None]:
        return {
            "max_kl": self.max_kl,
            "max_ppl_ratio": self.max_ppl_ratio,
            "min_top1": self.min_top1,
            "min_cosine": self.min_cosine,
        }

    def misplaced(self, kind: str) -> list[str]:
        """The bounds set that `kind` has no figure for (KL, perplexity and top-1 are causal
        figures; cosine is an encoder's)."""
        causal_only = ("max_kl", "max_ppl_ratio", "min_top1")
        wrong = causal_only if kind == ENCODER else ("min_cosine",)
        return [name for name in wrong if getattr(self, name) is not None]


@dataclass(frozen=True)
class EvalViolation:
    bound: str  # "max_kl", "max_ppl_ratio", "min_top1", "min_cosine"
    value: float | None  # None: the run has no such figure
    limit: float
    detail: str


def check(bounds: EvalBounds, summary: EvalSummary) -> list[EvalViolation]:
    """Every bound the figures break; a figure that is not finite (NaN, -inf: a perplexity
    ratio of 0 from an infinite float perplexity), or one the run lacks, breaks its bound."""
    c, e = summary.causal, summary.encoder
    figures = {
        "max_kl": (c.kl.mean if c else None, "mean KL", "nats per token"),
        "max_ppl_ratio": (c.ppl_ratio if c else None, "perplexity ratio", "quant / float"),
        "min_top1": (c.top1 if c else None, "top-1 agreement", "share of positions"),
        "min_cosine": (e.cosine_mean if e else None, "mean cosine", "of sentence embeddings"),
    }
    # a ratio of two perplexities passes only where both are finite (5 / inf is 0)
    parts_finite = c is None or (math.isfinite(c.ppl_float) and math.isfinite(c.ppl_quant))
    out = []
    for name, limit in bounds.as_dict().items():
        value, what, unit = figures[name]
        if limit is None:
            continue
        upper = name.startswith("max_")
        finite = value is not None and math.isfinite(value)
        if name == "max_ppl_ratio":
            finite = finite and parts_finite
        if finite and value is not None and (value <= limit if upper else value >= limit):
            continue
        if value is None:
            detail = f"{what}: this {summary.kind} has no such figure"
        else:
            side = "above" if upper else "below"
            detail = f"{what} {value:.6g} is {side} {limit:.6g} ({unit})"
        out.append(EvalViolation(name, value, limit, detail))
    return out


LAYER_ORDERS = ("output", "weight", "model")


def arrange_layers(rows: tuple[LayerRow, ...], order: str, top: int | None) -> list[LayerRow]:
    """Worst output SQNR first ("output", the default), worst weight SQNR first ("weight"), or
    the model's own order ("model"); NaN (a layer the text never reached) last; `top` first."""
    if order not in LAYER_ORDERS:
        raise ValueError(f"order must be one of {', '.join(LAYER_ORDERS)}, got {order!r}")

    def key(r: LayerRow) -> float:
        value = r.output_sqnr_db if order == "output" else r.weight_sqnr_db
        return math.inf if math.isnan(value) else value

    out = list(rows) if order == "model" else sorted(rows, key=key)
    return out[:top] if top is not None else out
