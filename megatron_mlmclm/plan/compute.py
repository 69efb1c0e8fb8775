"""Compute estimates: tokens, training FLOPs and GPU-hours of a run, each objective at its own cost.

The FLOPs are config/budget.py's arithmetic (step_flops: the sparse MLM head over the masked
tokens, causal attention at half as Transformer Engine spends it on a GPU), at the vocabulary of
the Llama-3 tokenizer. GPU-hours follow from a FLOP rate per GPU at which every step's own FLOPs
are spent (an MLM step costs less than a CLM step: its head computes logits at the masked
positions only). A size's FLOP rate comes, first to last, from `--probe-metrics SIZE=RUN` (the
tokens/s a run logged) or `--throughput SIZE=N` (CLM tokens per second per GPU), from a measured
step in measured_step_times.yaml (its tokens per second per GPU of the step it measured, at that
step's FLOPs per token), or from an assumed CLM throughput (DEFAULT_THROUGHPUT). A run on G GPUs
trains at G times one GPU's rate: a one-GPU measurement holds no data-parallel communication. A
branch trains only the steps after its branch point; its cost from scratch is reported beside it.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from megatron_mlmclm.config import (
    PhaseConfig,
    RunConfig,
    finalize_run_config,
    from_dict,
    load_config,
    parse_yaml,
    phase_seq_length,
    run_flops,
    step_flops,
    step_tokens,
)
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.plan.grid import Run
from megatron_mlmclm.plan.layout import GLOBAL_BATCH, LAYOUTS, check_size, per_size

VOCAB = 128256  # Llama-3 tokenizer

# Tokens per second per GPU of a CLM step assumed for the sizes never measured: about 35% MFU on an
# H100 (bf16, 989 TFLOP/s dense) by flops.py's count at seq 2048, vocab 128,256.
DEFAULT_THROUGHPUT = {"tiny": 2_000_000.0, "210m": 250_000.0, "610m": 85_000.0, "1b": 45_000.0}
MEASURED = Path(__file__).with_name("measured_step_times.yaml")  # package data
CLM = PhaseConfig(objective="clm")


@dataclass(frozen=True)
class Pricing:
    """What a size is priced from: `tokens_per_s` per GPU of a step of `phase`, and where that
    figure comes from (`source`: measured | given | assumed, `note`: how the summary says it)."""

    tokens_per_s: float
    phase: PhaseConfig
    source: str
    note: str

    def flop_rate(self, cfg: RunConfig) -> float:
        """FLOP/s per GPU: the tokens per second of `phase` at its FLOPs per token in `cfg`."""
        return self.tokens_per_s * step_flops(cfg, self.phase) / step_tokens(cfg, self.phase)


MEASUREMENT_FIELDS = {
    "device": str,
    "date": datetime.date,
    "software": dict,
    "config": dict,
    "tokens_per_gpu_step": int,
    "seconds_per_step": float,
    "tokens_per_s_per_gpu": (int, float),
    "source": str,
}
CONFIG_FIELDS = ("seq_length", "objective", "precision", "attention", "layout")


def read_entries(path: Path, what: str, key: str) -> dict:
    """A package-data table of `path` (`what` it holds, a mapping of `key` -> entry), or a
    UsageError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the {what} {path}: {e}") from None
    entries = parse_yaml(text, f"the {what} {path}") or {}
    if not isinstance(entries, dict):
        raise UsageError(f"{path}: expected a mapping of {key}")
    return entries


def read_measurements(path: str | Path = MEASURED) -> dict[str, dict]:
    """The measured steps of `path`, one entry per size, each checked whole: UsageError naming
    the file, the size and the field."""
    path = Path(path)
    entries = read_entries(path, "measured step times", "size -> measurement")
    for size, m in entries.items():
        where = f"{path}: {size}"
        if size not in LAYOUTS:
            raise UsageError(f"{where}: unknown size; choose from {', '.join(LAYOUTS)}")
        if not isinstance(m, dict) or set(m) != set(MEASUREMENT_FIELDS):
            raise UsageError(f"{where}: give exactly {', '.join(MEASUREMENT_FIELDS)}")
        for key, kind in MEASUREMENT_FIELDS.items():
            if not isinstance(m[key], kind) or isinstance(m[key], bool):
                raise UsageError(f"{where}: {key} {m[key]!r} is not a {key} (see the file's head)")
        c = m["config"]
        missing = [k for k in CONFIG_FIELDS if k not in c]
        if (
            missing
            or c["objective"] not in ("clm", "mlm")
            or set(m["software"])
            != {
                "torch",
                "megatron-core",
            }
        ):
            raise UsageError(
                f"{where}: config needs {', '.join(CONFIG_FIELDS)} (objective clm or mlm, "
                "mlm with mask_ratio) and software torch and megatron-core versions"
            )
        if c["objective"] == "mlm" and not 0 < c.get("mask_ratio", 0) < 1:
            raise UsageError(f"{where}: an mlm step needs config.mask_ratio in (0, 1)")
        rate = m["tokens_per_gpu_step"] / m["seconds_per_step"]
        if m["seconds_per_step"] <= 0 or abs(m["tokens_per_s_per_gpu"] / rate - 1) > 1e-4:
            raise UsageError(
                f"{where}: tokens_per_s_per_gpu {m['tokens_per_s_per_gpu']} is not "
                f"tokens_per_gpu_step / seconds_per_step = {rate:.0f}"
            )
    return entries


def measured_pricing(size: str, m: dict) -> Pricing:
    c = m["config"]
    phase = PhaseConfig(
        objective=c["objective"], mask_ratio=c.get("mask_ratio", 0.4), seq_length=c["seq_length"]
    )
    step = "CLM" if c["objective"] == "clm" else f"MLM {c['mask_ratio']:g}"
    note = (
        f"{size}: measured, {m['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
        f"({m['seconds_per_step']} s per step of {m['tokens_per_gpu_step']:,} tokens, {step}, "
        f"seq {c['seq_length']}, {c['precision']}, {c['attention']} attention, {c['layout']}) "
        f"on one {m['device']}, {m['date']} (torch {m['software']['torch']}, megatron-core "
        f"{m['software']['megatron-core']}; {m['source']})"
    )
    return Pricing(float(m["tokens_per_s_per_gpu"]), phase, "measured", note)


def probed_pricing(size: str, path: str) -> Pricing:
    """`--probe-metrics SIZE=RUN`: the tokens/s per GPU a run logged (its metrics.jsonl, or the
    run's folder), the median over the later half of its logged steps (past compilation and
    warmup) of its last phase, at that phase's FLOPs per token (read from the run's config.yaml
    beside it): any objective, converted by the FLOP count."""
    where = f"--probe-metrics {size}={path}"
    metrics = Path(path) / "metrics.jsonl" if Path(path).is_dir() else Path(path)
    config = metrics.with_name("config.yaml")
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
        records = [
            r
            for r in map(json.loads, filter(str.strip, lines))
            if isinstance(r, dict) and "tokens_per_s" in r
        ]
    except (OSError, ValueError) as e:
        raise UsageError(f"{where}: cannot read {metrics}: {e}") from None
    if not records:
        raise UsageError(f"{where}: {metrics} holds no logged training step")
    for r in records:
        if type(r.get("phase")) is not int or type(r.get("tokens_per_s_per_device")) not in (
            int,
            float,
        ):
            raise UsageError(
                f"{where}: the record of step {r.get('step', '?')} in {metrics} has no phase "
                "or tokens_per_s_per_device: give the metrics.jsonl of an `mlmclm pretrain` run"
            )
    if not config.is_file():
        raise UsageError(f"{where}: the run's config.yaml is not beside {metrics}")
    run = load_config(config)
    phase = records[-1]["phase"]
    if not 0 <= phase < len(run.phases):
        raise UsageError(
            f"{where}: {metrics} logs phase {phase}, but the config.yaml beside it has "
            f"{len(run.phases)} phase(s): the two are not of one run"
        )
    steps = [r for r in records if r["phase"] == phase]
    kept = steps[len(steps) // 2 :]
    tokens_per_s = statistics.median(r["tokens_per_s_per_device"] for r in kept)
    ph = dataclasses.replace(run.phases[phase], seq_length=phase_seq_length(run, run.phases[phase]))
    note = (
        f"{size}: probed, {tokens_per_s:,.0f} tokens/s per GPU of {ph.label()} steps at seq "
        f"{ph.seq_length} (the median of steps {kept[0]['step']}-{kept[-1]['step']} of run "
        f"{run.name}, {metrics})"
    )
    return Pricing(float(tokens_per_s), ph, "probed", note)


def probe_runs(items: list[str]) -> dict[str, str]:
    """`--probe-metrics SIZE=RUN ...` -> size -> the run's folder or metrics.jsonl."""
    out: dict[str, str] = {}
    for item in items:
        size, sep, path = item.partition("=")
        if not sep or not path:
            raise UsageError(
                f"--probe-metrics: {item!r} must be SIZE=RUN (a run's folder or its metrics.jsonl)"
            )
        check_size(size)
        if size in out:
            raise UsageError(f"--probe-metrics names {size} twice; give one run a size")
        out[size] = path
    return out


def pricing(
    sizes, given: list[str], measured: dict[str, dict], probe_metrics: list[str] = ()
) -> dict[str, Pricing]:
    """Per size: `--probe-metrics SIZE=RUN` or `--throughput SIZE=N` where given (one of the two
    a size), else its measured step, else the assumption."""
    for item in given:
        value = item.partition("=")[2] if "=" in item else item
        try:
            float(value)
        except ValueError:
            raise UsageError(
                f"--throughput: {item!r} must be N or SIZE=N tokens/s per GPU (a run's logged "
                "throughput: --probe-metrics SIZE=RUN)"
            ) from None
    probes = probe_runs(list(probe_metrics))
    flags = per_size(given, dict.fromkeys(LAYOUTS), "--throughput", float)
    named = {item.partition("=")[0] for item in given if "=" in item}
    for size in probes:
        if size in named:
            raise UsageError(
                f"--throughput and --probe-metrics both price {size}; give one of the two"
            )
    out = {}
    for size in sizes:
        if size in probes:
            out[size] = probed_pricing(size, probes[size])
        elif flags[size] is not None:
            note = f"{size}: given, {flags[size]:,.0f} CLM tokens/s per GPU (--throughput)"
            out[size] = Pricing(flags[size], CLM, "given", note)
        elif size in measured:
            out[size] = measured_pricing(size, measured[size])
        else:
            t = DEFAULT_THROUGHPUT[size]
            note = f"{size}: assumed, {t:,.0f} CLM tokens/s per GPU (about 35% MFU on an H100)"
            out[size] = Pricing(t, CLM, "assumed", note)
    return out


def flops_config(config: dict) -> RunConfig:
    """A plan's run config as the budget arithmetic counts it on the GPU it is planned for."""
    raw = copy.deepcopy(config)
    raw["model"]["vocab_size"] = VOCAB
    raw["train"]["flops_attention"] = "causal-half"  # TE's fused attention skips masked blocks
    return finalize_run_config(from_dict(RunConfig, raw, prefix=""))


def compute_row(run: Run, lay: dict, price: Pricing) -> dict:
    cfg = flops_config(run.config)
    rate = price.flop_rate(cfg)
    first = run.branch_at or 0
    tokens = sum(ph.steps * step_tokens(cfg, ph) for ph in cfg.phases)
    flops, trained = run_flops(cfg), run_flops(cfg, first_step=first)
    gpu_hours, scratch_hours = trained / rate / 3600.0, flops / rate / 3600.0
    return {
        "name": run.name,
        "size": run.size,
        "kind": run.kind,
        "phases": " + ".join(f"{ph.label()}: {ph.steps}" for ph in cfg.phases),
        "steps": run.steps,
        "tokens": tokens,
        "trained_steps": run.steps - first,
        "warmup_steps": run.warmup,
        "decay_steps": run.decay,
        "nodes": lay["nodes"],
        "gpus": lay["gpus"],
        "tp": lay["tp"],
        "pp": lay["pp"],
        "dp": lay["dp"],
        "micro_batch": lay["mbs"],
        "global_batch": GLOBAL_BATCH,
        "distributed_optimizer": lay["dist_opt"],
        "recompute": lay["recompute"] or "none",
        # the CLM tokens/s per GPU of the FLOP rate; what --throughput SIZE=N gives
        "tokens_per_gpu_s": round(rate * step_tokens(cfg, CLM) / step_flops(cfg, CLM), 1),
        "priced_from": price.source,
        "tflop_per_gpu_s": round(rate / 1e12, 1),
        "gpu_hours": round(gpu_hours, 2),
        "gpu_hours_from_scratch": round(scratch_hours, 2),
        "wall_hours": round(gpu_hours / lay["gpus"], 2),
        "model_pflop": round(flops / 1e15, 1),
        "depends_on": run.depends_on or "",
        "branch_at": run.branch_at if run.branch_at is not None else "",
        "keep_steps": " ".join(map(str, run.keep_steps)),
    }


# Seconds from a pretraining job's start to the end of its first step (processes, model build and
# initialisation, checkpoint load and verification, compile, the step), assumed per size: never
# measured on a GPU. The 610m and 1B benchmarks on an H100 had not finished building,
# initialising and compiling within 150 and 175 s (BENCHMARKS.md); a restart that loads its
# graphs from the compile cache starts faster. The trainer logs the figure ("start-up: ...").
DEFAULT_STARTUP_S = {"tiny": 30.0, "210m": 120.0, "610m": 240.0, "1b": 300.0}
JOB_HOURS = 48.0  # pretrain.sbatch's --time: a job that runs longer restarts once per limit


def startup_pricing(sizes, given: list[str]) -> dict[str, tuple[float, str]]:
    """Per size: (seconds a job start costs, how the summary says where that comes from)."""
    flags = per_size(given, dict.fromkeys(LAYOUTS), "--startup", float)
    out = {}
    for size in sizes:
        if flags[size] is not None:
            out[size] = (flags[size], f"{size}: given, {flags[size]:,.0f} s (--startup)")
        else:
            t = DEFAULT_STARTUP_S[size]
            out[size] = (t, f"{size}: assumed, {t:,.0f} s (never measured on a GPU)")
    return out


def segment_wall_hours(run: Run, lay: dict, price: Pricing) -> list[float]:
    """The hours each of a run's pretraining jobs trains: the submit script runs it in segments
    that end at its kept steps (its branches' points) and at its last step."""
    cfg = flops_config(run.config)
    rate = price.flop_rate(cfg) * lay["gpus"]
    ends = [run.branch_at or 0, *run.keep_steps, run.steps]
    return [run_flops(cfg, a, b) / rate / 3600.0 for a, b in zip(ends, ends[1:])]


def startup_cost(run: Run, lay: dict, price: Pricing, seconds: float) -> dict:
    """A run's job starts (one per segment; one more each time a segment's job reaches the time
    limit, each job having its own) and the GPU-hours they cost, every GPU of the run waiting."""
    starts = sum(1 + int(hours // JOB_HOURS) for hours in segment_wall_hours(run, lay, price))
    return {
        "starts": starts,
        "startup_s": seconds,
        "startup_gpu_hours": round(starts * seconds * lay["gpus"] / 3600.0, 2),
    }
