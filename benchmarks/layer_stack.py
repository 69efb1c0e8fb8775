"""The plain layers compiled as one stack (kernel plan row `plain_stack`) against the same layers
compiled layer by layer (two graphs per layer, the core attention between them), in one process
on one model: the host-side cost of calling compiled code, which bounds a small-batch GPU step.

Both contenders are the same Trainer's `train_step` (MLM, mock data, fused AdamW); between steps
only `LayerKernels.stack_on` changes, so the model, optimizer, batches and kernels are shared and
the difference is how many compiled calls a step makes: 2 for the stack, 4 x layers layer by
layer. Steps alternate (rotating order); the headline is the median s/step. On CPU the shapes are
small on purpose (the work is host-bound there, as a 16k-token step on an H100 or H200 is): the
ratio is a proxy for the host-side saving, not a GPU measurement. On CUDA it runs as it is.

    PYTHONPATH=. python benchmarks/layer_stack.py            # compiled (a minute or two first)
    PYTHONPATH=. python benchmarks/layer_stack.py --quick    # seconds: eager, tiny, 2 steps
    # how often the stack compiles on the varlen path (the warm-up rounds' seconds), fresh cache:
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python benchmarks/layer_stack.py \
        --layers 12 --attention varlen --warmup 6 --steps 5
    # 210m at 16k tokens a step on a GPU (tools/gpu_check.sh, part `stack`):
    PYTHONPATH=. python benchmarks/layer_stack.py --precision bf16 --layers 12 --hidden 768 \
        --ffn 3072 --heads 12 --kv-heads 12 --seq 2048 --micro-batch 8 --vocab 128256

Last line: RESULT layer_stack ratio=<stack_s/layers_s> ours_s=<stack_s> baseline_s=<layers_s>
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
from _engine import add_shape_arguments, apply_quick, build_trainer, time_rows

warnings.filterwarnings("ignore", category=UserWarning)  # megatron's no-Apex/TE notices


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    add_shape_arguments(p)
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds (the compiles)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument(
        "--attention",
        choices=("auto", "sdpa", "varlen"),
        default="auto",
        help="model.attention (varlen runs its stand-in off CUDA)",
    )
    p.set_defaults(layers=8, hidden=64, ffn=192, seq=64, micro_batch=2, vocab=2048)
    args = p.parse_args()
    apply_quick(args)
    if args.quick:
        args.warmup, args.steps = 1, 2
    torch.set_num_threads(args.threads)
    compiled = "off" if args.quick else "on"  # --quick: eager (checks the script, not the gain)
    trainer, cfg = build_trainer(
        args,
        [
            "phases.0.objective=mlm",
            f"phases.0.mask_ratio={args.mask_ratio}",
            f"model.compile={compiled}",
            f"model.attention={args.attention}",
        ],  # fmt: skip
        prefix="bench_layer_stack_",
    )
    plan = trainer.engine.kernels
    assert plan.plain_stack.on, f"the plan does not stack the layers here: {plan.plain_stack.why}"
    kernels = trainer.engine.model_chunks[0].decoder.layers[0].kernels
    phase = cfg.phases[0]
    print(
        f"layer stack vs layer by layer: {args.layers} layers, hidden {args.hidden}, seq "
        f"{args.seq}, micro-batch {args.micro_batch}, MLM, {args.precision}, compile {compiled}, "
        f"attention {plan.attention}, {torch.get_num_threads()} thread(s), device "
        f"{'cuda' if torch.cuda.is_available() else 'cpu'}; {args.warmup} warm-up rounds + "
        f"{args.steps} timed steps each, rotating order"
    )

    def loop(stack: bool):
        def run(_round: int) -> None:
            kernels.stack_on = stack
            trainer.train_step(phase)
            trainer.step += 1

        return run

    warm: dict[str, list[float]] = {}
    times = time_rows({"stack": loop(True), "layers": loop(False)}, args.warmup, args.steps, warm)
    med = {n: statistics.median(v) for n, v in times.items()}
    for n, seconds in warm.items():  # a compile shows as a long round: one per graph, or more
        print(f"  {n:<7} warm-up rounds {' '.join(f'{t:.2f}' for t in seconds)} s")
    for n in times:
        print(f"  {n:<7} median {med[n] * 1e3:8.2f} ms/step  (min {min(times[n]) * 1e3:.2f})")
    ratio = med["stack"] / med["layers"]
    print(
        f"RESULT layer_stack ratio={ratio:.3f} ours_s={med['stack']:.5f} "
        f"baseline_s={med['layers']:.5f}"
    )


if __name__ == "__main__":
    main()
