"""What `qtool calibrate` reports: the texts it read, the statistics it wrote, how long the pass
took; and what a merge joined."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DatasetInfo:
    """One calibration text: its name (imatrix.datasets), SHA-256 and the tokens taken."""

    name: str
    sha256: str | None  # None: a file from llama-imatrix, which records names only
    tokens: int | None


@dataclass(frozen=True)
class LinearSensitivity:
    name: str  # llama.cpp's weight name
    r: float  # the reference perturbation's relative output error (imatrix-weighted)
    kl: float  # mean KL(float || this Linear alone perturbed), nats per scored token
    alpha: float  # kl / r


@dataclass(frozen=True)
class JointSummary:
    """The joint pass: every measured tensor perturbed at once, at the reference and at half."""

    kl: float  # mean KL at the reference, nats per scored token
    kl_half: float  # at half the reference (a quarter of every r)
    tokens: int  # the joint pass's tokens (all the calibration windows that fit)
    kl_few: float  # at the reference, on the sensitivity windows alone
    fit: tuple[float, float, float] | None  # gain, saturation, additivity (None: no curve fits)


@dataclass(frozen=True)
class SensitivitySummary:
    reference: str  # the perturbation
    tokens: int
    windows: int
    passes: int  # passes over the blocks (the perturbed streams' memory bound)
    block_loads: int
    seconds: float
    linears: tuple[LinearSensitivity, ...]  # in the model's order
    joint: JointSummary | None = None


@dataclass(frozen=True)
class CalibrateSummary:
    model: str
    output: str
    architecture: str
    datasets: tuple[DatasetInfo, ...]
    ctx: int
    windows: int
    tokens: int
    entries: int  # weights with statistics (one per Linear of every block)
    blocks: int
    device: str
    load_seconds: float
    run_seconds: float
    peak_block_bytes: int  # the largest block's weights, float32, as held during the pass
    activation_bytes: int  # the activations at one block boundary
    sensitivity: SensitivitySummary | None = None  # calibrate --sensitivity's measurement

    @property
    def tokens_per_second(self) -> float:
        """Tokens through the whole model per second (each token passes every block)."""
        return self.tokens / self.run_seconds if self.run_seconds > 0 else 0.0


@dataclass(frozen=True)
class MergeSummary:
    inputs: tuple[str, ...]
    output: str
    datasets: tuple[DatasetInfo, ...]
    entries: int
    chunk_size: int
    chunk_count: int
