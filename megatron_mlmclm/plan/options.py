"""What a plan plans: PlanOptions, the flags of `mlmclm plan` (commands/plan.py) with the study's
defaults."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PlanOptions:
    """What `mlmclm plan` plans (its flags, commands/plan.py); the defaults are the study's grid."""

    # the grid
    sizes: list[str] = field(default_factory=lambda: ["210m", "610m", "1b"])
    budgets: list[int] = field(default_factory=lambda: [12000, 22000, 42000])
    objectives: list[str] = field(default_factory=lambda: ["clm", "mlm"])
    mask_ratios: list[float] = field(default_factory=lambda: [0.2, 0.3, 0.4, 0.5])
    clm_shares: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    split_size: str = "610m"
    split_mask_ratio: float = 0.4
    cpt_steps: list[int] = field(default_factory=lambda: [2000, 12000, 22000])
    cpt_size: str | None = None  # default: split_size
    cpt_budget: int | None = None  # default: the largest budget
    cpt_from: list[str] = field(default_factory=lambda: ["clm", "mlm"])
    cpt_mask_ratio: float = 0.4
    cpt_warmup_steps: int = 200
    # smaller budgets of a single-objective run as decay branches of the largest (plan/grid.py)
    branches: bool = True
    # data and outputs
    data: list[str] = field(default_factory=lambda: ["data/shards/fineweb_edu_text_document"])
    valid: list[str] = field(default_factory=list)
    tokenizer: str = "data/tokenizer"
    runs_dir: str | None = None  # default: OUT/runs
    hf_dir: str | None = None  # default: OUT/hf
    results_dir: str | None = None  # default: OUT/results
    # the evaluation: a suite's tasks (None: the paper's unless eval_tasks names tasks) plus
    # eval_tasks; commands/plan.py resolves them (the registry is eval/'s) into eval_tasks
    eval_suite: list[str] | None = None
    eval_tasks: list[str] = field(default_factory=list)
    eval_figures: str | None = None  # task sizes and lengths (default: plan/eval_tasks.yaml)
    eval_data_dir: str | None = None  # the jobs' MLMCLM_DATA_DIR (default: the plan's)
    eval_lrs: list[float] = field(default_factory=list)  # empty: evaluate's default grid
    eval_seeds: list[int] = field(default_factory=list)
    eval_protocol: str = "default"  # `mlmclm evaluate --protocol` of every array
    eval_probe: list[str] = field(default_factory=list)  # `mlmclm evaluate --probe` files
    eval_runs_per_job: int | None = None  # fine-tuning runs per array element; None: auto
    max_job_hours: float = 24.0  # the longest time limit an evaluation array asks for
    # resolved by commands/plan.py from eval/ (never flags): protocol -> task -> how `mlmclm
    # evaluate` runs it (every protocol: the summary prices the others beside the plan's)
    eval_runs: dict = field(default_factory=dict)
    save_interval: int = 1000
    # cluster and compute estimate
    throughput: list[str] = field(default_factory=list)  # SIZE=N: CLM tokens/s per GPU
    step_times: str | None = None  # measured steps (default: plan/measured_step_times.yaml)
    gpus_per_node: int = 8
    nodes: list[str] = field(default_factory=list)  # N or SIZE=N overrides of LAYOUTS' nodes
    startup: list[str] = field(default_factory=list)  # SIZE=S: seconds a pretraining job starts
