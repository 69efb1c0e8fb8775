"""GPU tier (`pytest -m gpu`, `make test-gpu`; docs/gpu.md): what the CPU suite cannot show.

Every check trains on the Markov mock language (a known entropy far below the unigram floor, so a
wrong mask, RoPE base or fusion shows) and compares against a reference on the same GPU with a
tolerance taken from measured noise (tests/gpu/checks.py, which the CPU suite also runs small):
learned without a CLM leak, THD vs dense-mask attention on trained weights, bf16 vs fp32, fusions
on vs off, FP8 vs bf16, TP2 / PP2 / SP vs TP1 (two GPUs), kill -9 and resume (also across a phase
change of seq_length and RoPE base), the hang watchdog under NCCL (two GPUs), then the throughput
benchmark.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import checks
import pytest
import torch
import yaml
from checks import GPU_SIZE, run_config, train
from jobs import REPO, job_env, read_metrics

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="GPU tier: no CUDA device on this machine"),
]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401  (optional: the NGC image ships it)
    except ImportError:
        return False
    return True


def fp8_capable() -> bool:
    return GPUS > 0 and torch.cuda.get_device_capability() >= (8, 9) and have_te()


RUN = run_config(GPU_SIZE)


def tail_mean(curve: dict[int, float], n: int = 10) -> float:
    steps = sorted(curve)[-n:]
    return sum(curve[s] for s in steps) / len(steps)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("path", ["fast", "thd"])
def test_learned_without_a_clm_leak(record, tmp_path, path):
    """`fast`: the path a run takes by default, TE installed or not (attention auto: varlen, the
    plain layer stack compiled, batched gradient accumulation, fused AdamW, the queued update);
    `thd`: TE's packed THD path (model.kernels=te), or its stand-in without TE."""
    attention = "auto" if path == "fast" else checks.thd_attention(have_te())
    row = checks.check_learned_without_leak(tmp_path, GPU_SIZE, attention)
    assert record(row.check, row.result, row.expected, row.ok)


def test_varlen_attention_matches_the_dense_mask(record, tmp_path):
    row = checks.check_varlen_matches_dense(tmp_path, GPU_SIZE)
    assert record(row.check, row.result, row.expected, row.ok)


def test_a_training_step_synchronises_at_most_four_times(record, tmp_path):
    """torch's own count (CUDA sync debug mode) of the synchronising calls of a bf16 step of the
    default path (varlen, compiled plain layers, fused AdamW), after the compiling steps; the CPU
    suite holds the same step to the same budget by counting operations
    (tests/test_host_sync.py)."""
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.training.step.host_syncs import cuda_sync_debug_count
    from megatron_mlmclm.training.trainer import Trainer

    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            "checkpoint.resume=false",
            "logging.tensorboard=false",
            "data.mock=true",
            f"model.vocab_size={checks.VOCAB}",
            "model.seq_length=256",
            "train.steps=20",
            "train.micro_batch_size=4",
            "train.global_batch_size=16",
            "train.precision=bf16",
        ],
    )
    trainer = Trainer(cfg)
    trainer.setup()
    steps = iter(range(20))

    def run(n: int) -> None:
        for _ in range(n):
            trainer.step = next(steps)
            trainer.train_step(cfg.phases[0])

    try:
        run(4)
        torch.cuda.synchronize()
        count, messages = cuda_sync_debug_count(lambda: run(4))
    finally:
        trainer.close()
    per_step = count / 4
    assert record(
        "synchronising calls per step (4 micro-batches, CUDA sync debug mode)",
        f"{per_step:g} per step ({trainer.kernels.attention})",
        "<= 4",
        per_step <= 4,
    ), messages


def test_a_non_finite_step_changes_no_weight_or_optimizer_state(record, tmp_path):
    """The queued update on CUDA (the figures' copy to pinned memory, its event, fused AdamW's
    found_inf): step 3's loss made NaN by the fault-injection hook; the update queued before the
    host saw the figures is skipped, and every model and main parameter and Adam state is as
    after step 2 (the CPU suite: tests/test_queued_update.py)."""
    import test_queued_update as queued

    from megatron_mlmclm.training.faults.monitor import NonFinite

    trainer = queued.trainer_for(tmp_path, "nan", "train.precision=bf16")
    try:
        assert trainer.kernels.queued_update.on, trainer.kernels.queued_update.why
        queued.train(trainer, 2)
        before = queued.state(trainer)
        trainer.faults.loss_scale = lambda step: float("nan") if step == 3 else 1.0
        trainer.step = 2
        with pytest.raises(NonFinite, match="at step 3"):
            trainer.train_step(trainer.cfg.phases[0])
        after = queued.state(trainer)
    finally:
        trainer.close()
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert record(
        "non-finite step with the queued update: weights and optimizer state",
        f"{len(changed)} of {len(after)} tensors changed",
        "0 changed",
        not changed and after.keys() == before.keys(),
    ), changed[:5]


def test_batched_gradient_accumulation_matches_megatrons_hook(record, tmp_path):
    """The kernel plan's batched_grad_accumulation on CUDA (foreach copy and add of bf16
    gradients into fp32 main_grad) against megatron's per-parameter hook: two micro-batches a
    step, three steps, main gradients, weights and Adam state bit for bit (the CPU suite:
    tests/test_grad_accumulation.py)."""
    import test_grad_accumulation as accumulation

    differ, changed, compared = accumulation.compare_with_megatrons_hook(
        tmp_path, "bf16", 2, "float16"
    )
    assert record(
        "batched gradient accumulation against megatron's hook (bf16, 2 micro-batches)",
        f"{len(differ)} main gradients and {len(changed)} of {compared} tensors differ",
        "0 differ",
        not differ and not changed,
    ), (differ[:5], changed[:5])


def test_thd_attention_matches_the_dense_mask(record, tmp_path):
    row = checks.check_thd_matches_dense(tmp_path, GPU_SIZE, have_te())
    assert record(row.check, row.result, row.expected, row.ok)


@pytest.mark.parametrize("causal", [True, False])
def test_flex_matches_sdpa_forward_and_backward(record, causal):
    """FlexAttention's document masks against SDPA's dense mask, outputs and gradients (Flex's
    backward exists only on CUDA; the CPU suite checks its forward)."""
    from megatron.core.transformer.enums import AttnMaskType
    from test_packed import attention_config, random_docs

    from megatron_mlmclm.model.attention import FlexDocumentAttention, SDPAttention
    from megatron_mlmclm.model.packed import document_seq_params
    from megatron_mlmclm.objectives import document_attention_mask

    torch.manual_seed(0)
    config = attention_config()
    sdpa = SDPAttention(config, 1, AttnMaskType.arbitrary, "self")
    flex = FlexDocumentAttention(config, 1, AttnMaskType.arbitrary, "self")
    s, b, d = 512, 2, 16
    base = [torch.randn(s, b, n, d, device="cuda") for n in (4, 2, 2)]
    docs = random_docs(b, s, seed=3, mean=100).cuda()
    mask = document_attention_mask(docs, causal)
    grads = []
    for core in (sdpa, flex):
        inputs = [t.clone().requires_grad_() for t in base]
        if core is flex:  # the flex path takes the document ids, never a dense mask
            out = core(*inputs, None, packed_seq_params=document_seq_params(docs, causal))
        else:
            out = core(*inputs, mask)
        out.square().sum().backward()
        grads.append([out.detach()] + [t.grad for t in inputs])
    worst = max(float((got - ref).abs().max()) for ref, got in zip(*grads))
    assert record(
        f"flex vs SDPA, output and grads ({'causal' if causal else 'bidirectional'})",
        f"max abs diff {worst:.1e}",
        "< 1e-4",
        worst < 1e-4,
    )


@pytest.mark.parametrize(
    "name,a,b",
    [
        ("bf16 vs fp32", ["train.precision=bf16"], ["train.precision=fp32"]),
        (
            "fusions auto vs off (bf16; fused AdamW, compile)",
            ["train.precision=bf16"],
            ["train.precision=bf16", "model.fusions=off"],
        ),
        (
            "compiled vs eager (bf16)",
            ["train.precision=bf16"],
            ["train.precision=bf16", "model.compile=off"],
        ),
    ],
    ids=["bf16_fp32", "fusions", "compile"],
)
def test_settings_train_alike(record, tmp_path, name, a, b):
    row = checks.check_trains_alike(tmp_path, GPU_SIZE, name, a, b)
    assert record(row.check, row.result, row.expected, row.ok)


@pytest.mark.skipif(
    not fp8_capable(),
    reason="FP8 needs Transformer Engine and compute capability >= 8.9 (Hopper, Ada)",
)
def test_fp8_is_finite_and_close_to_bf16(record, tmp_path):
    te = ["train.precision=bf16", "model.kernels=te"]  # FP8 runs inside TE's layers only
    fp8 = train(tmp_path, "fp8", GPU_SIZE, [*te, "train.fp8=delayed"])
    bf16 = train(tmp_path, "bf16", GPU_SIZE, te)
    finite = all(math.isfinite(v) for v in fp8.values())
    d = rel(tail_mean(fp8), tail_mean(bf16))
    assert record(
        "FP8 (delayed) vs bf16",
        f"finite={finite}, rel. diff {d:.4f}",
        "finite, < 0.05",
        finite and d < 0.05,
    )


@two_gpus
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=false"],
        ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
        ["parallel.pipeline_model_parallel_size=2"],
        # the data-parallel fast path: the stack in chunks, the reduce-scatter overlapped
        ["parallel.use_distributed_optimizer=true", "model.stack_chunks=2"],
    ],
    ids=["tp2", "tp2_sp", "pp2", "dp2_distopt"],
)
def test_model_parallel_layouts_match_tp1(record, tmp_path, layout):
    """fp32 (TF32 off, the kernel plan's fp32 reference), from scratch: initialisation by global
    parameter gives every layout the single-process model. At DP = 2 the plan overlaps the
    reduce-scatter and the parameter gather with the chunked layer stack (NCCL's collectives, the
    CPU suite's tests/test_data_parallel.py on gloo)."""
    fp32 = ["train.precision=fp32", "train.steps=10"]
    two = train(tmp_path, "two", GPU_SIZE, [*fp32, *layout], nproc=2)
    one = train(tmp_path, "one", GPU_SIZE, fp32, nproc=1)
    worst = max(rel(two[s], one[s]) for s in one)
    assert record(
        f"{' '.join(o.split('.')[1] for o in layout)} vs TP1 (fp32, 10 steps)",
        f"max per-step rel. diff {worst:.2e}",
        "< 1e-3",
        worst < 1e-3,
    )


PHASE_CHANGE = {
    **RUN,
    "phases": [
        {"objective": "mlm", "share": 0.5, "mask_ratio": {"from": 0.3, "to": 0.15}},
        {
            "objective": "mlm",
            "share": 0.5,
            "mask_ratio": 0.15,
            "seq_length": 512,
            "rotary_base": 160000,
        },
    ],
}


@pytest.mark.parametrize("run_config", [RUN, PHASE_CHANGE], ids=["clm-mlm", "seq-rope-change"])
def test_kill_and_resume_is_exact(record, tmp_path, run_config):
    """kill -9 after the step-20 checkpoint, restart: every later loss equals an uninterrupted
    run's (deterministic kernels requested for both). seq-rope-change crosses a phase boundary at
    step 25 that doubles the sequence length (THD at another length) and switches the RoPE base
    (TE's fused RoPE with rebuilt frequencies): never run on a GPU."""
    env = {
        **job_env(),
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run_config))
    args = [
        sys.executable,
        "-m",
        "megatron_mlmclm",
        "pretrain",
        str(config),
        "checkpoint.save_interval=10",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    subprocess.run(
        args + [f"output_dir={ref}"], env=env, check=True, timeout=600, capture_output=True
    )
    proc = subprocess.Popen(
        args + [f"output_dir={run}"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    target = run / "checkpoints" / "iter_0000020"
    deadline = time.time() + 600
    while not target.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    subprocess.run(
        args + [f"output_dir={run}"], env=env, check=True, timeout=600, capture_output=True
    )
    got = {m["step"]: m["loss"] for m in read_metrics(run) if "loss" in m}
    want = {m["step"]: m["loss"] for m in read_metrics(ref) if "loss" in m}
    later = [s for s in want if s > 20]
    same = sum(got.get(s) == want[s] for s in later)
    finite = all(math.isfinite(v) for v in want.values())
    name = "" if run_config is RUN else " across a seq_length + RoPE change"
    assert record(
        f"kill -9 at step 20 and resume{name}",
        f"{same}/{len(later)} later losses equal",
        "all equal (bitwise), finite",
        same == len(later) and finite,
    )


@two_gpus
def test_hung_rank_under_nccl_ends_the_job_with_the_hang_code(record, tmp_path):
    """The watchdog under NCCL (never run on a GPU): rank 1 hangs at step 5; the rank waiting in
    the NCCL all-reduce must fire its own watchdog (exit 76) before NCCL's collective timeout, and
    the job must be gone within the allowance + 60 s."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(RUN))
    exit_file = tmp_path / "exit_code"
    env = {
        **job_env(),
        "MLMCLM_INJECT_FAULTS": "hang rank=1 step=5",
        "MLMCLM_EXIT_FILE": str(exit_file),
    }
    start = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "megatron_mlmclm",
            "pretrain",
            str(config),
            f"output_dir={tmp_path / 'run'}",
            "train.hang_timeout_s=20",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.time() - start
    code = exit_file.read_text().strip() if exit_file.exists() else "none"
    ok = proc.returncode != 0 and code == "76" and took < 20 + 60 + 60  # + setup
    assert record(
        "hung rank under NCCL (DP2)",
        f"exit file {code}, {took:.0f} s",
        "76, within allowance + 60 s after setup",
        ok,
    ), proc.stderr[-3000:]


def test_throughput_benchmark(record):
    """benchmarks/train_throughput.py on its headline row; MFU reported, not asserted beyond
    'runs and is positive' (docs/gpu.md gives the MFU to expect)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "train_throughput.py"),
            "--presets",
            "210m",
            "--seqs",
            "2048",
            "--objectives",
            "mlm",
            "--fp8",
            "",
            "--warmup",
            "2",
            "--steps",
            "5",
        ],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    mfu = re.search(r"ours [\d.]+ s \([\d.]+ tok/s/GPU, MFU ([\d.]+)%", proc.stdout)
    print(proc.stdout)
    assert record(
        "throughput 210m seq 2048 MLM bf16",
        f"MFU {mfu.group(1) if mfu else '?'}%; {line.removeprefix('RESULT ')}",
        "runs; MFU 35-47% on H100 (docs/gpu.md)",
        "ratio=" in line and mfu is not None,
    )
