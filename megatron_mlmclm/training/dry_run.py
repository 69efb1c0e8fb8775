"""What `mlmclm pretrain --dry-run` prints: the resolved config as YAML, then the kernel plan and
the budget as YAML comments, so the output still loads back as the run's config. Imports torch
(the kernel plan probes it), not megatron-core."""

from __future__ import annotations

import yaml

from megatron_mlmclm.config import RunConfig, budget_report, to_dict
from megatron_mlmclm.model.kernels import plan_kernels, resolve_device


def dry_run_report(cfg: RunConfig) -> str:
    plan = plan_kernels(cfg, resolve_device(cfg, planning=True))
    comments = plan.report().splitlines() + budget_report(cfg)
    return (
        yaml.safe_dump(to_dict(cfg), sort_keys=False)
        + "\n"
        + "\n".join(f"# {line}" for line in comments)
    )
