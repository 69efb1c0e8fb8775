"""Branches: a run that starts from another run's checkpoint (its trunk) where their histories part.

Runs that train the same steps up to some step N share everything before it: the same samples in
the same order (the order does not depend on the run's length, data/sample_index.py), the same
phase at every step, the same learning rate. Under a warmup-stable-decay schedule that holds for
runs of one config that differ only in their budget (a decay branch: the trunk's stable checkpoint
at N = budget - decay), and for a run whose phases are CLM then MLM against the CLM run of its
config (a biphasic branch: the CLM run's checkpoint at the switch step, where the MLM phase starts
on the samples a run from scratch would read there). A run with
`train.branch_from: RUN/checkpoints/iter_N` therefore starts at step N from that checkpoint
(weights, optimizer, schedule position, RNG: what a resume restores) and trains on to its own
budget, and the result is bitwise the run trained from scratch with that config.
`check_branch` refuses, in one line, a source for which that would not hold:

- the config may differ only in the budget (train.steps / tokens / flops, and the decay that
  follows from it), the output folder (name, output_dir, checkpoint.dir), the phases after N, and
  what a resume may change anyway because it changes how the run executes, not what it computes
  (the parallel layout and micro-batch, the loader, recompute, logging, checkpoint cadence, fault
  timeouts);
- every step before N must train the same objective (and mask ratio) on the same samples (a phase
  given as a share of the budget moves with the budget: give the phases before the branch point
  in steps, tokens or FLOPs, and let the last phase take the rest);
- N must lie before both runs' decays (the learning rate of every step before N agrees), unless
  both have one schedule, and the source must have read its stream as a fresh run does (no
  checkpoint.allow_data_change history).

The source's checkpoint holds its history (training/start/history.py): the settings and data of each
segment of its steps, from its start, each resume and each branch it came from. Each segment
before N is held to those rules, not only the config the checkpoint was saved with: a trunk
resumed with another learning rate, or onto other data, before N is no source of this branch.

Once the branch has saved its own checkpoint, a restart resumes from that, like any run; its
folder's history is checked against its config the same way first (`check_branch_folder`), so a
folder left by another branch (another source, budget or setting) is not resumed as this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_mlmclm import checkpoint as ckpt_io
from megatron_mlmclm.config import (
    PhasePlan,
    RunConfig,
    from_dict,
    resolved,
    resolved_phases,
    stream_key,
    to_dict,
)
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.training.start import history
from megatron_mlmclm.training.start.fingerprint import (
    ORDER_KEY,
    phase_description,
    same_value,
    show_value,
)
from megatron_mlmclm.training.start.history import flat

# Keys a branch may change: the budget and the output folder, and how the run executes.
# Compared as prefixes of dotted keys. data.train / valid / tokenizer are compared by content (the
# data fingerprint), not by path; phases step by step (below).
BUDGET = (
    "train.steps",
    "train.tokens",
    "train.flops",
    "train.decay_steps",
    "train.flops_attention",
    "train.branch_from",
)
OUTPUT = ("name", "output_dir", "checkpoint.dir")
EXECUTION = (
    "parallel.",
    "runtime.",
    "train.micro_batch_size",
    "train.recompute",
    "train.hang_timeout_s",
    "train.hang_timeout_long_s",
    "data.loader",
    "data.num_workers",
    "data.cache_dir",
    "checkpoint.",
    "logging.",
)
BY_CONTENT = ("data.train", "data.valid", "data.tokenizer", "phases")
MAY_DIFFER = BUDGET + OUTPUT + EXECUTION + BY_CONTENT


def branch_source(
    cfg: RunConfig, fingerprint: dict[str, Any]
) -> tuple[Path, dict[str, Any], list[str]]:
    """The verified checkpoint of train.branch_from, checked against this run (check_branch);
    -> (checkpoint, its trainer state, notes to log)."""
    source, cost = ckpt_io.verified_checkpoint(resolved(cfg.train.branch_from))  # collective
    state = ckpt_io.read_trainer_state(source)["trainer"]
    return source, state, ([cost] if cost else []) + check_branch(source, state, cfg, fingerprint)


def check_branch(
    source: Path, state: dict[str, Any], cfg: RunConfig, fingerprint: dict[str, Any]
) -> list[str]:
    """UsageError (one line) unless this run, started from `source` (a checkpoint's trainer
    state), is the run trained from scratch with this config. Returns notes to log."""
    step = int(state["iteration"])
    where = f"train.branch_from={source}"
    if state.get("data_fingerprint") is None or state.get("config") is None:
        raise UsageError(
            f"{where} holds no data fingerprint or config (saved by an older "
            "version): a branch of it cannot be checked; train from scratch"
        )
    notes = check_trajectory(where, history.of_checkpoint(state), cfg, fingerprint, step)
    consumed = int(state.get("consumed_samples", -1))
    expected = PhasePlan.of(from_dict(RunConfig, state["config"], prefix="")).position(step)
    if consumed != expected:
        raise UsageError(
            f"{where} had read its stream from sample {consumed} at step {step}, not "
            f"{expected} as a run from scratch does (it was resumed with "
            "checkpoint.allow_data_change); a branch of it is no run of this config: "
            "train from scratch"
        )
    steps, decay = resolved(cfg.train.steps), resolved(cfg.train.decay_steps)
    if step >= steps:
        raise UsageError(
            f"{where} is at step {step}, but this run's budget is {steps} "
            "steps: branch from an earlier checkpoint"
        )
    return notes + [
        f"branching from {source} at step {step} of {state['config']['train']['steps']}: this "
        f"run decays over steps {steps - decay}-{steps}"
    ]


def check_branch_folder(
    ckpt: Path, state: dict[str, Any], cfg: RunConfig, fingerprint: dict[str, Any]
) -> list[str]:
    """UsageError (one line) unless the checkpoint `ckpt` of this branch's own folder is this
    branch's run up to its step: a folder left by another branch (another source, budget or
    setting) would be resumed as if it were this one. Returns notes to log."""
    step = int(state["iteration"])
    where = f"{ckpt} (this run's folder; train.branch_from={cfg.train.branch_from})"
    try:
        return check_trajectory(where, history.of_checkpoint(state), cfg, fingerprint, step)
    except UsageError as e:
        raise UsageError(
            f"{e}; the folder holds another run than this branch: use a new output_dir, or "
            "remove train.branch_from to resume it as it is"
        ) from None


def check_trajectory(
    where: str,
    events: list[dict[str, Any]],
    cfg: RunConfig,
    fingerprint: dict[str, Any],
    end: int,
) -> list[str]:
    """UsageError unless steps [0, end) of the run whose history is `events`
    (training/start/history.py) are those of `cfg`'s run from scratch, segment by segment: the data,
    the settings, every step's phase and samples, the learning rate, and the sample position at
    each event. Returns a warning to log for the steps of an `unrecorded` history (saved before
    histories were kept), which are held to the config and data of its checkpoint only."""
    segments = history.segments(events, end)
    for seg in segments:
        w = where
        if len(segments) > 1:
            w += f", in its steps {seg.start + 1}-{seg.end} (from its {seg.event} at {seg.start}),"
        _compare_data(w, seg.data, fingerprint)
        check_history(w, from_dict(RunConfig, seg.config(), prefix=""), cfg, seg.end, seg.start)
    plan = PhasePlan.of(cfg)
    for step, kind, position in history.positions(events, end):
        if position != plan.position(step):
            raise UsageError(
                f"{where} read its stream from sample {position} at its {kind} at step {step}, "
                f"not {plan.position(step)} as a run from scratch does (it was resumed with "
                "checkpoint.allow_data_change); a branch of it is no run of this config: "
                "train from scratch"
            )
    unknown = history.unrecorded_steps(events, end)
    if unknown is None:
        return []
    first, last = unknown
    return [
        f"warning: {where}: its steps {first + 1}-{last} were trained before checkpoints kept "
        f"their run's history, so they are held to the config and data of its checkpoint at "
        f"step {last} only; a resume among them with other settings (learning rate, schedule, "
        "phases) or onto other data (checkpoint.allow_data_change) could not be checked"
    ]


def _compare_data(where: str, saved: dict[str, Any], now: dict[str, Any]) -> None:
    for key, value in now.items():
        if key == "phases" or same_value(saved.get(key), value):
            continue  # the phases: step by step (_compare_steps)
        if key == ORDER_KEY:
            raise UsageError(
                f"{where} was trained under the older sample order, which "
                "depended on the run's length; a branch of it would read other "
                "samples than a run from scratch: train from scratch"
            )
        raise UsageError(
            f"{where} was trained with {key} = {show_value(saved.get(key))} but "
            f"this run has {show_value(value)}; a branch reads the data its source read"
        )


def check_history(where: str, saved: RunConfig, cfg: RunConfig, step: int, start: int = 0) -> None:
    """UsageError unless steps [start, step) of a run of config `saved` are those of the run
    trained from scratch with `cfg`, by the configs alone: the settings, every step's phase and
    samples, and the learning rate of those steps."""
    _compare_settings(where, flat(to_dict(saved)), flat(to_dict(cfg)))
    _compare_steps(where, saved, cfg, step, start)
    _check_schedule(where, saved, cfg, step)


def _compare_settings(where: str, saved: dict[str, Any], now: dict[str, Any]) -> None:
    for key in sorted(set(saved) | set(now)):
        if key.startswith(MAY_DIFFER) or saved.get(key) == now.get(key):
            continue
        raise UsageError(
            f"{where} was trained with {key} = {saved.get(key)!r} but this run has "
            f"{now.get(key)!r}; a branch may change only the budget (train.steps, "
            "tokens or flops, and its decay), the output folder and how the run "
            f"executes (layout, loader, logging, checkpoints): restore {key} or "
            "train from scratch"
        )


def _trained_as(cfg: RunConfig, plan: PhasePlan, step: int) -> tuple:
    """What decides step `step`'s update, phase by phase: the phase as it trains that step (mask
    ratio of a schedule included), its sample stream and where in it the batch starts. A CLM step
    masks nothing: its phase's mask settings do not count."""
    ph = plan.phase(step)
    mlm = ph.objective == "mlm"
    return (
        ph.objective,
        ph.mask_ratio if mlm else None,
        ph.mask_replace if mlm else None,
        ph.seq_length,
        ph.rotary_base,
        stream_key(ph),
        plan.position(step),
    )


def _compare_steps(where: str, saved: RunConfig, cfg: RunConfig, step: int, start: int) -> None:
    """Every step in [start, step) trains the same way in both runs."""
    gbs = cfg.train.global_batch_size
    a, b = PhasePlan(resolved_phases(saved), gbs), PhasePlan(resolved_phases(cfg), gbs)
    for k in range(start, step):
        if _trained_as(saved, a, k) != _trained_as(cfg, b, k):
            i, j = a.index(k), b.index(k)
            # the source's objective next to step k in this run: a phase boundary moved
            near = {b.phase(n).objective for n in (k - 1, k + 1) if 0 <= n < b.total}
            moved = a.phase(k).objective in near
            raise UsageError(
                f"{where}: step {k + 1} trains differently, the source in phases.{i} "
                f"({_describe(saved, a, i)}), this run in phases.{j} ({_describe(cfg, b, j)}); "
                + (
                    "a phase given as a share of the budget moves with it: give the phases "
                    "before the branch point in steps, tokens or flops and let the last take "
                    "the rest"
                    if moved
                    else f"branch from a run that trained steps 1-{step} as this run does"
                )
            )


def _describe(cfg: RunConfig, plan: PhasePlan, i: int) -> str:
    start = plan.starts[i]
    return phase_description(cfg, cfg.phases[i], start, start + resolved(plan.phases[i].steps))


def _check_schedule(where: str, saved: RunConfig, cfg: RunConfig, step: int) -> None:
    """WSD: the LR of step k is the schedule's value at k + 1, the peak from the warmup's end to
    steps - decay_steps. Every step before `step` must be in both runs' stable part, unless both
    runs have one schedule (the other settings of the schedule are compared with the rest)."""
    t, u = saved.train, cfg.train
    if (resolved(t.steps), resolved(t.decay_steps)) == (resolved(u.steps), resolved(u.decay_steps)):
        return
    ends = {
        what: resolved(run.train.steps) - resolved(run.train.decay_steps)
        for run, what in ((saved, "the source"), (cfg, "this run"))
    }
    for what, end in ends.items():
        if step > end:
            raise UsageError(
                f"{where} is at step {step}, past the end of {what}'s stable phase (its decay "
                f"starts after step {end}): branch from a checkpoint at or before step "
                f"{min(ends.values())} (checkpoint.keep_steps keeps one)"
            )
