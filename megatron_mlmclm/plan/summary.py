"""The tables of a plan: SUMMARY.md (markdown), SUMMARY.csv (one row per run) and manifest.tsv."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from megatron_mlmclm.plan.evaluation import (
    HBM_BYTES_PER_S,
    OPS_PER_LAYER,
    SECONDS_PER_OP,
    STARTUP_S,
    TOKENIZE_PER_S,
    UPDATE_BYTES_PER_PARAM,
)
from megatron_mlmclm.plan.grid import Run
from megatron_mlmclm.plan.jobs import EVAL_MARGIN, EVAL_STARTUP_S, EVAL_TARGET_HOURS, ArrayShape
from megatron_mlmclm.plan.layout import GLOBAL_BATCH
from megatron_mlmclm.plan.options import PlanOptions


def summary_md(
    rows: list[dict],
    totals: dict,
    prices: dict,
    eval_prices: dict,
    opts: PlanOptions,
    runs_per_task: int,
    other_protocols: dict,
) -> str:
    out = io.StringIO()
    w = out.write
    w("# Plan summary\n\n")
    w(
        f"{len(rows)} runs. Global batch {GLOBAL_BATCH} x seq 2048 = {GLOBAL_BATCH * 2048:,} "
        "tokens per step (the study's ~2.36M). Training FLOPs as the model spends them "
        "(config/budget.py's arithmetic: the sparse MLM head over the masked tokens, causal "
        "attention at half as Transformer Engine computes it; vocabulary 128,256). GPU-hours = "
        "the FLOPs a job trains / the FLOP rate per GPU of its size / 3600, so an MLM step costs "
        "what its FLOPs cost; wall hours = GPU-hours / GPUs of the run (no queueing, no "
        "restarts).\n\n"
    )
    w("Each size's FLOP rate per GPU comes from:\n\n")
    for price in prices.values():
        w(f"- {price.note}\n")
    if any(p.source == "measured" for p in prices.values()):
        w(
            "\nA measured step is one GPU's: a run on G GPUs is priced at G times its tokens/s "
            "per GPU, converted to each objective's step by the FLOP count. Data-parallel "
            "communication (the gradient reduce across the run's GPUs) is not included, nor the "
            "optimizer step that a study step (many micro-batches) spreads over more tokens.\n"
        )
    if any(p.source == "assumed" for p in prices.values()):
        w(
            "\nAn assumed throughput is no measurement: replace it with your own "
            "(`--probe-metrics SIZE=RUN`: a run's logged tokens/s, or `--throughput SIZE=N`), "
            "or add the size's measured step to megatron_mlmclm/plan/measured_step_times.yaml.\n"
        )
    w("\n")
    w(runs_md(rows, totals, opts.branches))
    w(eval_md(rows, totals, eval_prices, opts, runs_per_task, other_protocols))
    w(
        "\nFiles: `configs/NAME.yaml`, `jobs/NAME.sh`, `jobs.json` (the job table) and "
        "`submit_slurm.sh` (`mlmclm submit` on it), `manifest.tsv`, "
        "`SUMMARY.csv`, `SUMMARY_EVAL.csv` (the evaluation's price per task and size). See "
        "docs/plan.md.\n"
    )
    return out.getvalue()


def runs_md(rows: list[dict], totals: dict, branches: bool) -> str:
    """SUMMARY.md's table of the runs, with the pretraining totals and the hours of each kind."""
    out = io.StringIO()
    w = out.write
    if any(r["branch_at"] != "" for r in rows):
        w(
            "Branches: a run with a `branch at` step starts from the checkpoint of the run it "
            "depends on at that step (kept there) and trains only the steps after it; it is "
            "bitwise the run trained from scratch (docs/pretrain.md#decay-branches). Kind "
            "`branch`: a decay branch of its size's stable run; `biphasic`: a branch of the CLM "
            "stable run at its switch step (it trains its MLM phase); `cpt`: a decay branch of "
            "the longest CPT run of its source. `GPU-h` is what the plan spends, `from scratch` "
            "what the run would cost alone.\n\n"
        )
    w(
        "| run | kind | phases (steps) | tokens (B) | nodes x GPUs | TP/PP/DP | micro | GPU-h | "
        "from scratch | wall h | depends on | branch at |\n"
        "|---|---|---|---:|---|---|---:|---:|---:|---:|---|---:|\n"
    )
    for r in rows:
        w(
            f"| {r['name']} | {r['kind']} | {r['phases']} | {r['tokens'] / 1e9:.1f} | "
            f"{r['nodes']} x {r['gpus'] // r['nodes']} | {r['tp']}/{r['pp']}/{r['dp']} | "
            f"{r['micro_batch']} | {r['gpu_hours']:,.1f} | {r['gpu_hours_from_scratch']:,.1f} | "
            f"{r['wall_hours']:,.1f} | {r['depends_on'] or '-'} | {r['branch_at'] or '-'} |\n"
        )
    saved = totals["gpu_hours_from_scratch"] - totals["gpu_hours"]
    if branches:
        hours = (
            f"{totals['gpu_hours']:,.1f} GPU-hours with branches, "
            f"{totals['gpu_hours_from_scratch']:,.1f} GPU-hours with every run from scratch "
            f"({saved:,.1f} saved, "
            f"{100 * saved / max(totals['gpu_hours_from_scratch'], 1e-9):.0f}%)"
        )
    else:
        hours = f"{totals['gpu_hours']:,.1f} GPU-hours, every run from scratch (--no-branches)"
    w(
        f"\n**Total**: {totals['tokens'] / 1e12:.2f}T tokens, {hours}, "
        f"{totals['model_pflop']:,.0f} PFLOP of models.\n\n"
    )
    by_kind: dict[str, list] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)
    for kind, rs in by_kind.items():
        w(f"- {kind}: {len(rs)} runs, {sum(x['gpu_hours'] for x in rs):,.1f} GPU-hours\n")
    return out.getvalue()


# What each protocol is for (eval/protocols.py; docs/evaluate.md)
PROTOCOL_USE = {
    "default": "the field's metrics, retrieval ranked over the whole corpus as BEIR and MTEB do",
    "encodeval": "the paper's own evaluation code, which reproduces its tables: retrieval ranked "
    "over the judged documents only",
}


def eval_md(
    rows: list[dict],
    totals: dict,
    prices: dict,
    opts: PlanOptions,
    per_task: int,
    other_protocols: dict,
) -> str:
    """The evaluation's price: per task and size, a run's seconds and where they come from, the
    runs and GPU-hours; the totals; the other protocols' price; the assumptions."""
    models = {}  # size -> models of that size
    for r in rows:
        models[r["size"]] = models.get(r["size"], 0) + 1
    out = io.StringIO()
    w = out.write
    tasks = opts.eval_tasks
    w(
        f"\n## Evaluation\n\nEvery model fine-tunes {len(tasks)} task(s) x {per_task} runs "
        f"(learning rates x seeds) under `mlmclm evaluate --protocol {opts.eval_protocol}` "
        f"({PROTOCOL_USE.get(opts.eval_protocol, 'a protocol of eval/protocols.py')}), one "
        "GPU a run (plan/evaluation.py). A run's seconds: its start-up (process, model, the "
        "task's data read and tokenized), its training steps and its evaluations (every "
        "validation of the curve, the test). Where `figures` says measured, the evaluation "
        "probe ran that task at that size (`--eval-probe`); calibrated, the cost model scaled by "
        "the probe of another task of the family; assumed, the cost model alone (below).\n\n"
    )
    w(
        "| task | family | size | steps | validations | s a run (start + train + eval) | "
        "runs | GPU-h | figures |\n|---|---|---|---:|---:|---|---:|---:|---|\n"
    )
    for t in tasks:
        for size, n_models in models.items():
            p = prices[(t, size)]
            b = p.seconds
            runs = per_task * n_models
            w(
                f"| {t} | {opts.eval_runs[opts.eval_protocol][t].family} | {size} | {p.steps} | "
                f"{p.validations} | "
                f"{b.total:,.0f} ({b.startup:,.0f} + {b.train:,.0f} + {b.evaluation:,.0f}) | "
                f"{runs:,} | {b.total * runs / 3600:,.1f} | {p.source} |\n"
            )
    w(
        f"\n**GPU-hours**: pretraining {totals['gpu_hours']:,.1f}, job starts "
        f"{totals['startup_gpu_hours']:,.1f} (below), evaluation {totals['eval_gpu_hours']:,.1f} "
        f"({len(rows)} models x {len(tasks) * per_task} runs), total "
        f"{totals['total_gpu_hours']:,.1f}.\n"
    )
    for name, other in other_protocols.items():
        hours = sum(
            other[(t, r["size"])].seconds.total * per_task / 3600 for r in rows for t in tasks
        )
        w(
            f"\nUnder `--eval-protocol {name}` ({PROTOCOL_USE.get(name, name)}) the same "
            f"evaluation would cost {hours:,.1f} GPU-hours by the cost model.\n"
        )
    if any(p.source != "measured" for p in prices.values()):
        w(
            "\nThe cost model, where no probe measured a task (assumed figures are named so; "
            "`mlmclm evaluate --probe SIZE` measures them, docs/cluster.md): a training step is "
            "the larger of the GPU's work (3 forward passes of FLOPs per input, at the batch's "
            "padded length, at the size's pretraining FLOP rate above; IR's CachedMNRL embeds "
            "queries and documents twice; plus the optimizer update's memory traffic, "
            f"{UPDATE_BYTES_PER_PARAM['bf16']:g} bytes a parameter in bf16 autocast and "
            f"{UPDATE_BYTES_PER_PARAM['bf16-pure']:g} in bf16-pure, at an assumed "
            f"{HBM_BYTES_PER_S / 1e12:g} TB/s) and the host's launches (eager PyTorch: "
            f"{OPS_PER_LAYER['train']} operations a layer a step and {OPS_PER_LAYER['forward']} "
            "a forward pass, measured by tools/count_finetune_ops.py, at an assumed "
            f"{SECONDS_PER_OP * 1e6:g} us each); an evaluation batch likewise; start-up "
            + ", ".join(f"{s} {v:g} s" for s, v in STARTUP_S.items() if s in models)
            + f" (assumed) plus the run's texts tokenized at an assumed {TOKENIZE_PER_S:,.0f} "
            "tokens/s (IR documents at every encoding). Task sizes, mean and padded lengths: "
            "megatron_mlmclm/plan/eval_tasks.yaml, each entry with its source:\n\n"
        )
        size = next(iter(models))
        for t in tasks:
            w(f"- {t}: {prices[(t, size)].figures}\n")
    return out.getvalue()


def arrays_md(arrays: dict[tuple[str, str], ArrayShape], opts: PlanOptions) -> str:
    """SUMMARY.md's section on the evaluation arrays: the protocol they run, and per task and
    size the runs of an element, the elements and the time limit."""
    auto = opts.eval_runs_per_job is None
    out = (
        f"\n## Evaluation arrays\n\nOne array per model and task, under `mlmclm evaluate "
        f"--protocol {opts.eval_protocol}` (`--eval-protocol`). An element runs "
        + (
            f"as many fine-tuning runs as fit in {EVAL_TARGET_HOURS:g} hours (or "
            "`--max-job-hours`, if less) at their price above x the margin, at least one "
            "(`--eval-runs-per-job auto`)"
            if auto
            else f"{opts.eval_runs_per_job} fine-tuning runs (`--eval-runs-per-job`)"
        )
        + f"; its time limit is their price x {EVAL_MARGIN:g} plus {EVAL_STARTUP_S / 60:.0f} "
        f"minutes of start-up (assumed), at most `--max-job-hours` ({opts.max_job_hours:g}). "
        "An element whose runs need more stops at that limit: its runs resume when `mlmclm "
        "submit` runs again.\n\n| task | size | runs an element | elements | time limit |\n"
        "|---|---|---:|---:|---|\n"
    )
    for task in opts.eval_tasks:
        for size, a in ((size, a) for (size, t), a in arrays.items() if t == task):
            cap = " (the cap: resumes)" if a.capped else ""
            out += f"| {task} | {size} | {a.runs_per_element} | {a.elements} | {a.time}{cap} |\n"
    return out


def totals_of(rows: list[dict]) -> dict:
    return {
        "tokens": sum(r["tokens"] for r in rows),
        "gpu_hours": round(sum(r["gpu_hours"] for r in rows), 2),
        "eval_gpu_hours": round(sum(r["eval_gpu_hours"] for r in rows), 2),
        "total_gpu_hours": round(sum(r["total_gpu_hours"] for r in rows), 2),
        "gpu_hours_from_scratch": round(sum(r["gpu_hours_from_scratch"] for r in rows), 2),
        "model_pflop": round(sum(r["model_pflop"] for r in rows), 1),
        "startup_gpu_hours": round(sum(r["startup_gpu_hours"] for r in rows), 2),
    }


def startup_md(rows: list[dict], notes: list[str]) -> str:
    """SUMMARY.md's section on what the jobs' starts cost (compute.startup_cost)."""
    starts = sum(r["starts"] for r in rows)
    hours = sum(r["startup_gpu_hours"] for r in rows)
    out = (
        f"\n## Job starts\n\n{starts} pretraining job starts ({len(rows)} runs: one per "
        "segment, and one more each 48 hours a job runs), each holding the run's GPUs from the "
        f"job's start to its first step: **{hours:,.1f} GPU-hours**, in the total above. "
        "Seconds per start:\n\n"
    )
    out += "".join(f"- {note}\n" for note in notes)
    return out + (
        "\nThe trainer logs a start's figure after its first step (`start-up: ...`); give yours "
        "with `--startup SIZE=S`. A restart loads its compiled graphs from the compile cache "
        "(docs/cluster.md).\n"
    )


def write_eval_csv(path: Path, prices: dict, rows: list[dict], per_task: int) -> None:
    """SUMMARY_EVAL.csv: per task and size, one run's seconds (start-up, training, evaluation),
    the runs of all models of that size, their GPU-hours and where the figures come from."""
    models: dict[str, int] = {}
    for r in rows:
        models[r["size"]] = models.get(r["size"], 0) + 1
    with open(path, "w", newline="", encoding="utf-8") as f:
        wr = csv.writer(f)
        wr.writerow(
            ["task", "size", "steps", "validations", "startup_s", "train_s", "evaluation_s",
             "seconds_per_run", "runs", "gpu_hours", "priced_from", "note"]
        )  # fmt: skip
        for (task, size), p in prices.items():
            b, runs = p.seconds, per_task * models[size]
            wr.writerow(
                [task, size, p.steps, p.validations, round(b.startup, 1), round(b.train, 1),
                 round(b.evaluation, 1), round(b.total, 1), runs,
                 round(b.total * runs / 3600, 2), p.source, p.note]
            )  # fmt: skip


def write_summary_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def write_manifest(
    path: Path,
    runs: list[Run],
    layouts: dict,
    gpus_per_node: int,
    cfg_paths: dict,
    runs_dir: Path,
    hf_dir: Path,
    n_eval: int,
) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            "index\tname\tkind\tnodes\tgpus_per_node\tconfig\tcheckpoints\thf_dir\t"
            "depends_on\teval_runs\tbranch_at\n"
        )
        for i, r in enumerate(runs):
            f.write(
                f"{i}\t{r.name}\t{r.kind}\t{layouts[r.name]['nodes']}\t"
                f"{gpus_per_node}\t{cfg_paths[r.name]}\t"
                f"{runs_dir / r.name / 'checkpoints'}\t{hf_dir / r.name}\t"
                f"{r.depends_on or '-'}\t{n_eval}\t"
                f"{r.branch_at if r.branch_at is not None else '-'}\n"
            )
