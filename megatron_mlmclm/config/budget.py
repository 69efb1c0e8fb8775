"""The run's budget: steps, tokens or FLOPs, resolved into each phase's steps; the FLOPs and tokens
a run spends (as the model spends them: flops.py's "as spent" convention); the checkpoints kept
for good; the budget as `mlmclm pretrain --dry-run` prints it. The planner and the study count
with these functions too.
"""

from __future__ import annotations

import bisect
import math

from megatron_mlmclm.config.attention import SKIPS_MASKED_BLOCKS, attention_path, torch_has_varlen
from megatron_mlmclm.config.phases import (
    phase_rotary_base,
    phase_seq_length,
    resolve_phase_steps,
    rest_phase,
    steps_per_phase,
)
from megatron_mlmclm.config.schema import PhaseConfig, RunConfig, resolved
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.flops import train_step_flops


def causal_attention_halved(cfg: RunConfig) -> bool:
    """Whether this run's attention kernel skips the masked half of causal attention (the path of
    config/attention.py, which the kernel plan takes too), without importing torch unless the
    device is `auto`. train.flops_attention pins it."""
    if cfg.train.flops_attention != "auto":
        return cfg.train.flops_attention == "causal-half"
    import importlib.util

    device = cfg.runtime.device
    if device == "auto":
        device = "cpu"
        if importlib.util.find_spec("torch") is not None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
    te = device == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    varlen = device == "cuda" and torch_has_varlen()
    path, _ = attention_path(
        cfg.model.attention,
        cfg.train.precision,
        device,
        te,
        varlen_installed=varlen,
        kernels=cfg.model.kernels,
    )
    return SKIPS_MASKED_BLOCKS[path]


def step_tokens(cfg: RunConfig, ph: PhaseConfig) -> int:
    return cfg.train.global_batch_size * phase_seq_length(cfg, ph)


def step_flops(cfg: RunConfig, ph: PhaseConfig) -> float:
    """Training FLOPs of one step of `ph` as the model spends them (flops.py, "as spent"): the
    sparse MLM head over the expected masked tokens, causal attention halved where the kernel
    halves it."""
    if cfg.model.vocab_size is None:
        raise UsageError(
            "a budget in FLOPs needs model.vocab_size (the output head's size); set "
            "it to the tokenizer's vocabulary, e.g. model.vocab_size=128256"
        )
    seq, gbs = phase_seq_length(cfg, ph), cfg.train.global_batch_size
    tokens = gbs * seq
    labelled = tokens if ph.objective == "clm" else ph.mean_mask_ratio() * tokens
    half = ph.objective == "clm" and causal_attention_halved(cfg)
    return train_step_flops(cfg.model.shape(), cfg.model.vocab_size, seq, gbs, labelled, half)


def resolve_budget(cfg: RunConfig) -> None:
    """The run's budget (train.steps, tokens or flops) and each phase's length (share, steps,
    tokens or flops) -> integer steps per phase, written back to phase.steps and train.steps, and
    the decay phases -> train.decay_steps. A resolved config keeps what was given beside the
    steps; given steps must agree with what the budget resolves to (the config round trip)."""
    t, phases = cfg.train, cfg.phases
    units = [u for u in ("flops", "tokens") if getattr(t, u) is not None]
    if len(units) > 1:
        raise UsageError(
            "train gives flops and tokens; the budget is exactly one of train.steps, "
            "train.tokens or train.flops"
        )
    if t.flops_attention == "auto" and (
        units == ["flops"] or any(ph.flops is not None for ph in phases)
    ):
        # Pinned in the resolved config, so the run reloads with the same steps on any machine.
        t.flops_attention = "causal-half" if causal_attention_halved(cfg) else "full"
    given_steps, units = t.steps, units or ["steps"]
    unit = units[0]
    if unit == "steps":
        for i, ph in enumerate(phases):  # absolute tokens / flops -> steps
            if ph.tokens is not None or ph.flops is not None:
                _set_steps(ph, i, _absolute_steps(cfg, ph))
        if t.steps is None:  # the phases' own lengths, else the default
            absolute = [ph.steps for ph in phases if ph.share is None]
            t.steps = (
                sum(resolved(n) for n in absolute)
                if None not in absolute and len(absolute) == len(phases)
                else 100
            )
        if t.steps < 1:
            raise UsageError(f"train.steps must be >= 1, got {t.steps}")
        resolve_phase_steps(phases, t.steps)
    else:
        budget = float(getattr(t, unit))
        if not 0 < budget < math.inf:
            raise UsageError(f"train.{unit} must be a positive number, got {budget:g}")
        per = step_flops if unit == "flops" else step_tokens
        rest = rest_phase(phases)  # it takes what the others leave, as a share
        used, share_sum = 0.0, 0.0
        for ph in phases:
            if ph.share is not None:
                share_sum += ph.share
            elif ph.tokens is not None or ph.flops is not None:
                used += _exact_steps(cfg, ph) * per(cfg, ph)
            elif ph.steps is not None:
                used += ph.steps * per(cfg, ph)
        if rest is not None:
            phases[rest].share = max(1.0 - share_sum - used / budget, 0.0)
            share_sum += resolved(phases[rest].share)
        if not math.isclose(share_sum * budget + used, budget, rel_tol=1e-6):
            raise UsageError(
                f"phases must fill train.{unit}={budget:g}: shares {share_sum:g} x "
                f"{budget:g} + {used:g} given in absolute lengths = "
                f"{share_sum * budget + used:g}"
            )
        for i, ph in enumerate(phases):
            if ph.share is not None:
                _set_steps(ph, i, int(round(ph.share * budget / per(cfg, ph))))
            elif ph.tokens is not None or ph.flops is not None:
                _set_steps(ph, i, _absolute_steps(cfg, ph))
        total = sum(resolved(ph.steps) for ph in phases)
        if total < 1:
            raise UsageError(
                f"train.{unit}={budget:g} is less than one step of this model "
                f"({per(cfg, phases[0]):.3g} {unit} a step)"
            )
        if given_steps is not None and given_steps != total:
            raise UsageError(
                f"train.steps={given_steps} disagrees with train.{unit}={budget:g} "
                f"({total} steps); the budget is exactly one of train.steps, "
                "train.tokens or train.flops (train.steps=null clears a preset's)"
            )
        t.steps = total
    resolve_decay(cfg)


def _exact_steps(cfg: RunConfig, ph: PhaseConfig) -> float:
    """The (fractional) steps a phase's own tokens or flops buy."""
    if ph.flops is not None:
        return ph.flops / step_flops(cfg, ph)
    return resolved(ph.tokens) / step_tokens(cfg, ph)


def _absolute_steps(cfg: RunConfig, ph: PhaseConfig) -> int:
    return int(round(_exact_steps(cfg, ph)))


def _set_steps(ph: PhaseConfig, i: int, n: int) -> None:
    if ph.steps is not None and ph.steps != n:
        given = next(
            f"{k} {getattr(ph, k):g}"
            for k in ("share", "tokens", "flops")
            if getattr(ph, k) is not None
        )
        raise UsageError(
            f"phases.{i} gives {given} (= {n} steps) and steps {ph.steps}, which disagree; keep one"
        )
    ph.steps = n


def resolve_decay(cfg: RunConfig) -> None:
    """Phases marked `decay: true` are the WSD schedule's decay: the run's last phases."""
    t, phases = cfg.train, cfg.phases
    marked = [i for i, ph in enumerate(phases) if ph.decay]
    if not marked:
        if t.decay_steps is None:
            t.decay_steps = 10
        return
    if marked != list(range(marked[0], len(phases))):
        raise UsageError(
            f"phases.{marked[0]} is marked decay but phases.{len(phases) - 1} after it "
            "is not: the decay phases are the run's last"
        )
    steps = sum(resolved(phases[i].steps) for i in marked)
    if t.decay_steps is not None and t.decay_steps != steps:
        raise UsageError(
            f"train.decay_steps={t.decay_steps} disagrees with the decay phases "
            f"(phases.{marked[0]}-{len(phases) - 1}: {steps} steps); keep one"
        )
    t.decay_steps = steps


def run_flops(cfg: RunConfig, first_step: int = 0, end_step: int | None = None) -> float:
    """Training FLOPs of the run as its phases spend them (step_flops), over its steps
    [first_step, end_step) (a branch trains only the steps after its branch point; None: to the
    run's end)."""
    return sum(n * step_flops(cfg, ph) for ph, n in steps_per_phase(cfg, first_step, end_step))


def tokens_at_step(cfg: RunConfig, step: int) -> int:
    """Tokens the run has read by the end of its first `step` steps."""
    return sum(n * step_tokens(cfg, ph) for ph, n in steps_per_phase(cfg, 0, step))


def kept_steps(cfg: RunConfig) -> list[int]:
    """The steps whose checkpoints are kept for good (checkpoint.keep_every, keep_steps,
    keep_tokens), sorted; UsageError for a setting the run never reaches."""
    c, total = cfg.checkpoint, resolved(cfg.train.steps)
    kept = set(range(c.keep_every, total + 1, c.keep_every)) if c.keep_every else set()
    for step in c.keep_steps:
        if not 1 <= step <= total:
            raise UsageError(
                f"checkpoint.keep_steps: step {step} is outside this run's steps 1-{total}"
            )
        kept.add(step)
    run_tokens = tokens_at_step(cfg, total)
    for tokens in c.keep_tokens:
        if not 0 < tokens <= run_tokens:
            raise UsageError(
                f"checkpoint.keep_tokens: {tokens:g} tokens is outside this run's "
                f"{run_tokens:g} tokens"
            )
        steps = range(1, total + 1)  # tokens_at_step grows with the step: bisect
        kept.add(steps[bisect.bisect_left(steps, tokens, key=lambda k: tokens_at_step(cfg, k))])
    return sorted(kept)


def budget_report(cfg: RunConfig) -> list[str]:
    """Each phase's steps, tokens and FLOPs (as the model spends them), and the run's totals:
    what `mlmclm pretrain --dry-run` prints."""
    lines, start, total_tokens, total_flops = [], 0, 0.0, 0.0
    count_flops = cfg.model.vocab_size is not None
    for i, ph in enumerate(cfg.phases):
        tokens = resolved(ph.steps) * step_tokens(cfg, ph)
        flops = resolved(ph.steps) * step_flops(cfg, ph) if count_flops else None
        total_tokens += tokens
        total_flops += flops or 0.0
        rotary = phase_rotary_base(cfg, ph)
        extra = f", rotary_base {rotary:g}" if rotary != cfg.model.rotary_base else ""
        extra += ", decay" if ph.decay else ""
        extra += (
            f", data temperature {ph.data.temperature:g}"
            if ph.data and ph.data.temperature
            else ", own data"
            if ph.data
            else ""
        )
        lines.append(
            f"phases.{i}: {ph.label()}, steps {start}-{start + resolved(ph.steps)} ({ph.steps}), "
            f"seq_length {phase_seq_length(cfg, ph)}, {tokens:.4g} tokens"
            + (f", {flops:.4g} FLOPs" if flops is not None else "")
            + extra
        )
        start += resolved(ph.steps)
    attention = (
        "causal attention counted at half (the kernel skips the masked blocks)"
        if causal_attention_halved(cfg)
        else "causal attention counted in full (dense-mask kernel)"
    )
    lines.append(
        f"total: {cfg.train.steps} steps, {total_tokens:.4g} tokens"
        + (
            f", {total_flops:.4g} FLOPs; {attention}"
            if count_flops
            else "; FLOPs need model.vocab_size"
        )
    )
    return lines
