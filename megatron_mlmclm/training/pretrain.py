"""`mlmclm pretrain CONFIG [key.sub=value ...]`: one command on CPU (gloo) and GPU (NCCL).

    mlmclm pretrain examples/configs/tiny.yaml train.steps=20
    torchrun --nproc_per_node 4 -m megatron_mlmclm pretrain cfg.yaml parallel.tensor_model_parallel_size=2
"""

from __future__ import annotations

import sys

from megatron_mlmclm.config import load_config


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?", help="YAML run config (defaults when omitted)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override config values, e.g. train.steps=50 phases.0.mask_ratio=0.3")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config, print it resolved, and exit")


def run(args) -> int:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # no file, only overrides
        config, overrides = None, [config] + overrides
    cfg = load_config(config, overrides)
    if args.dry_run:
        import yaml

        from megatron_mlmclm.config import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    return pretrain(cfg)


def pretrain(cfg) -> int:
    from megatron_mlmclm.runtime import distributed as rt
    from megatron_mlmclm.training.preemption import EXIT_PREEMPTED, Preempted
    from megatron_mlmclm.training.trainer import Trainer, TrainingDiverged

    trainer = Trainer(cfg)
    try:
        trainer.setup()
        trainer.train()
    except TrainingDiverged as e:
        if rt.is_main():
            print(f"mlmclm pretrain: error: {e}", file=sys.stderr)
        return 1
    except Preempted as e:
        if rt.is_main():
            print(f"mlmclm pretrain: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    finally:
        trainer.close()
        rt.destroy_distributed()
    return 0
