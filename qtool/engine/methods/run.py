"""A calibrated quantize run's data pass (engine/budget.data_passes calls it before the plan's
other data passes): the model directory checked and built empty, the calibration windows
split into fit and held out, the check text's windows, the block-by-block pass with the
method's policy, its chosen codes left in the run's Spill for the writing loop, and each Linear's
decision saying which method produced it."""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from qtool.calibration import HELD_OUT_SHARE, Calibration, Method, Role, TextUse
from qtool.engine.calibrate.blocks import return_freed_memory
from qtool.engine.calibrate.data import check_text, default_text, load_text, take_windows
from qtool.engine.calibrate.run import MODEL, check_activations, check_tokens, interleaved
from qtool.engine.calibrate.sequential import ACTIVATIONS_IN_MEMORY, run_sequential, spilled
from qtool.engine.decision import Calibrated, Keep, Quantize, TensorPlan
from qtool.engine.job import Job
from qtool.engine.loop import quantize_one
from qtool.engine.methods.awq import METHOD as AWQ
from qtool.engine.methods.awq import AwqPolicy, output_buffers
from qtool.engine.methods.gptq import GptqPolicy, Target
from qtool.engine.methods.verdict import ModelStreams
from qtool.engine.model.config import float_source, kind_of, window_length
from qtool.engine.model.hf import Tokenizer
from qtool.engine.model.models import empty_model, float_parts
from qtool.engine.model.text import Text
from qtool.engine.model.tokens import check_vocabulary
from qtool.engine.nonfinite import kept_nonfinite
from qtool.engine.plan import ModelPlan
from qtool.engine.spill import Spill
from qtool.engine.threads import using_threads
from qtool.errors import InputError, UsageError
from qtool.eval_results import CAUSAL_LM
from qtool.formats.imatrix.naming import GGUF_ARCHS
from qtool.formats.registry import open_reader
from qtool.io.checkpoint import ST_TO_TORCH, Checkpoint
from qtool.numerics import kernels
from qtool.spec import QSpec


def split(windows: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """(fit, held out): every HELD_OUT_SHARE-th window held out, at least one; UsageError for
    fewer than two windows."""
    if len(windows) < 2:
        raise UsageError(None, f"{len(windows)} calibration window cannot be split into windows "
                         "to fit and windows held out; ask for at least two windows of tokens",
                         hint="tokens")  # fmt: skip
    step = min(HELD_OUT_SHARE, len(windows))
    held = [w for i, w in enumerate(windows) if i % step == step - 1]
    fit = [w for i, w in enumerate(windows) if i % step != step - 1]
    return fit, held


def calibrated(job: Job, plan: ModelPlan, spill: Spill) -> ModelPlan:
    """The plan with each Linear of the decoder blocks the method quantized decided by it
    (its codes in `spill`); the other tensors as planned."""
    calibration = job.options.calibration
    assert calibration is not None and job.kernels is not None
    path = job.source.directory
    if path is None:
        raise UsageError(job.source.path, "a calibrated method runs the model: give its "
                         "model directory (config.json, safetensors weights, tokenizer), "
                         "not a file")  # fmt: skip
    found, config = float_source(path, MODEL)
    kind, architecture = kind_of(config)
    if kind != CAUSAL_LM or str(config.get("model_type")) not in GGUF_ARCHS:
        raise InputError(
            path, f"a calibrated method runs the Llama family ({', '.join(GGUF_ARCHS)}), not "
            f"{architecture} (model_type {config.get('model_type')!r})",
        )  # fmt: skip
    plan = finite_targets(job, plan)
    checkpoint, hf_config, tokenizer = float_parts(found, config, path, MODEL)
    device = job.kernels.device
    streams, texts = _streams(calibration, tokenizer, hf_config, path, device)
    model = empty_model(kind, config, hf_config, checkpoint, path).eval()
    every = [w for ws in streams.values() for w in ws]
    check_vocabulary(every, model.get_input_embeddings().num_embeddings, tokenizer)
    del tokenizer, every
    _let_go()  # the windows are tokens now: the tokenizer is not held through the pass
    targets = {
        p.entry.name: Target(p.spec, ST_TO_TORCH[p.entry.dtype])
        for p in plan.plans if isinstance(p.spec, QSpec)
    }  # fmt: skip
    policy = _policy(plan, targets, calibration, spill, job, streams, hf_config, device)
    given = policy.rounded if isinstance(policy, GptqPolicy) else None  # AWQ changes norms too
    verdict = ModelStreams(targets, job.kernels.scales_in_weight_dtype, spill.directory, given)
    reader = open_reader(found)
    try:
        with using_threads(job.run.threads):  # None: the idle cores (engine/threads.py)
            run_sequential(model, reader, streams, policy, device, path,
                           directory=spill.directory, tracker=verdict,
                           finite=not job.options.keep_nonfinite)  # fmt: skip
            model_kl = verdict.figures(model, reader, device, path, streams)
        reader.check_unchanged()
    finally:
        reader.close()
    decided = plan.with_plans([_decided(p, policy) for p in plan.plans])
    notes = (*plan.notes, *_short(calibration, streams))
    return replace(decided, notes=notes, texts=texts, model_kl=model_kl)


def _let_go() -> None:
    """Free what the caller just dropped: transformers' tokenizer holds reference cycles (the
    CLI pauses the cyclic collector) and its pages sit in glibc's heap (SmolLM2's: 49 MiB of
    the resident set, held through every block otherwise)."""
    gc.collect()
    return_freed_memory()


def finite_targets(job: Job, plan: ModelPlan) -> ModelPlan:
    """The plan with the method's targets checked for NaN/Inf before the model runs (neither
    GPTQ nor AWQ can round them): with keep_nonfinite such a tensor is kept as it is and left
    out of the method; without, the run's NumericError naming the file and the tensor."""
    out: list[TensorPlan] = []
    for shard, plans in plan.per_shard():
        ckpt = job.shards.checkpoint(shard)
        out += [_finite(ckpt, p, job) if isinstance(p.spec, QSpec) else p for p in plans]
    return plan.with_plans(out)


def _finite(ckpt: Checkpoint, plan: TensorPlan, job: Job) -> TensorPlan:
    assert job.kernels is not None
    x = ckpt.tensor(plan.entry)
    try:
        lo, hi = torch.aminmax(x)
        if bool(torch.isfinite(lo) & torch.isfinite(hi)):
            return plan
        if job.options.keep_nonfinite:
            return kept_nonfinite(plan, x) or plan
        quantize_one(ckpt, plan, kernels.Workspace(job.kernels.device))  # its NumericError
        return plan
    finally:
        ckpt.release(plan.entry)


def _policy(
    plan: ModelPlan,
    targets: dict[str, Target],
    calibration: Calibration,
    spill: Spill,
    job: Job,
    streams: dict[str, list[list[int]]],
    hf_config: Any,
    device: torch.device,
) -> GptqPolicy | AwqPolicy:
    assert job.kernels is not None
    in_weight_dtype = job.kernels.scales_in_weight_dtype
    if calibration.method is Method.GPTQ:
        return GptqPolicy(targets, calibration, spill, in_weight_dtype)
    kept = {p.entry.name: ST_TO_TORCH[p.entry.dtype] for p in plan.plans if p.spec is None}
    windows = sum(len(ws) for ws in streams.values())
    ctx, width = len(streams["fit"][0]), int(hf_config.hidden_size)
    # the float block's outputs, as many bytes as the activations: mapped past the same bound
    mapped = spilled(windows, ctx, width, device, ACTIVATIONS_IN_MEMORY, spill.directory)
    outputs = output_buffers(windows, ctx, width, device, mapped)
    then_gptq = calibration.method is Method.AWQ_GPTQ
    return AwqPolicy(targets, kept, calibration, spill, in_weight_dtype, outputs, then_gptq)


def _streams(
    calibration: Calibration, tokenizer: Tokenizer, hf_config: Any, path: Path, device: torch.device
) -> tuple[dict[str, list[list[int]]], tuple[TextUse, ...]]:
    """The windows of each stream: fit, held out, and as many of the check text as held out;
    and each text with the tokens taken from it (what the outputs record)."""
    ctx = window_length(calibration.ctx, hf_config, path, MODEL, shortest=1)
    check_tokens(calibration.tokens, ctx)
    texts = [load_text(p, tokenizer) for p in calibration.texts] or [default_text()]
    sources = take_windows(texts, tokenizer, calibration.tokens, ctx)
    fit, held = split(interleaved(sources))
    checks = [load_text(p, tokenizer, "check the method on") for p in calibration.check_texts]
    checks = checks or [check_text()]
    _distinct(texts, checks)
    check_sources = take_windows(checks, tokenizer, len(held) * ctx, ctx)
    check = interleaved(check_sources)
    if device.type != "cpu":  # on the CPU they are spilled past a bound (sequential.py)
        check_activations((len(fit) + len(held) + len(check)) * ctx, int(hf_config.hidden_size))
    used = [(s, Role.CALIBRATION) for s in sources] + [(s, Role.CHECK) for s in check_sources]
    records = tuple(TextUse.of(s.name, s.sha256, s.tokens, role) for s, role in used if s.windows)
    return {"fit": fit, "held": held, "check": check}, records


def _short(calibration: Calibration, streams: dict[str, list[list[int]]]) -> list[str]:
    """A note where the texts gave fewer tokens than asked for (the run goes on with them)."""
    fit, held, check = (len(streams[s]) for s in ("fit", "held", "check"))
    ctx = len(streams["fit"][0])
    if (fit + held) * ctx >= calibration.tokens // ctx * ctx and check >= held:
        return []
    return [f"the calibration text gave {(fit + held) * ctx:,} tokens of the "
            f"{calibration.tokens:,} asked for: {fit} windows of {ctx} to fit, {held} held out, "
            f"{check} of the check text"]  # fmt: skip


def _distinct(texts: list[Text], checks: list[Text]) -> None:
    """UsageError where a check text is a calibration text (by content): the guard would check
    the method on what it was fitted to, and keep it wherever it fits the text."""
    fitted = {t.info.sha256: t.source for t in texts}
    same = next((c for c in checks if c.info.sha256 in fitted), None)
    if same is not None:
        raise UsageError(same.source, f"the check text is the calibration text "
                         f"{fitted[same.info.sha256]} (the same content), which makes the guard "
                         "meaningless; give a check text of another domain",
                         hint="check-text")  # fmt: skip


def _decided(plan: TensorPlan, policy: GptqPolicy | AwqPolicy) -> TensorPlan:
    chosen = policy.chosen.get(plan.entry.name)
    changed = policy.changed.get(plan.entry.name) if isinstance(policy, AwqPolicy) else None
    action = plan.decision.action
    if changed is not None and isinstance(action, Keep):  # float, with the method's values
        keep = Keep(f"{action.reason}; {changed}")
        return TensorPlan(plan.entry, plan.decision.then(keep, Calibrated(AWQ)))
    if chosen is None or plan.spec is None:
        return plan
    decision = plan.decision
    note = f"{decision.note}; {chosen.note}" if decision.note else chosen.note
    action = Quantize(plan.spec, note, decision.asked, decision.stored)
    return TensorPlan(plan.entry, decision.then(action, Calibrated(chosen.method)))
