"""--profile of benchmarks/train_throughput.py: where a step of ours spends its time (GPU-busy
fraction, top kernels and host operators, host time by Python caller, synchronisations), and the
reference's steps on the same batches profiled alike."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from _engine import sync
from _throughput_contenders import Samples, build_ours, on_gpu, reference_loop
from _throughput_rows import describe_documents, document_figures, fmt


def stepper(one_step: Callable[[int], None]) -> Callable[..., None]:
    """run(steps, then_sync=True): `steps` more steps of `one_step`, numbered on from call to
    call (so that each step finds the batch fetched ahead), then a drain unless `then_sync` is
    off."""
    numbers = iter(range(10**9))

    def run(steps: int, then_sync: bool = True) -> None:
        for _ in range(steps):
            one_step(next(numbers))
        if then_sync:
            sync()

    return run


def unprofiled_step_time(run: Callable[..., None], warmup: int, n: int) -> float:
    """Seconds a step, `n` steps back to back as training runs them after `warmup`: the clock
    starts after one step's host work, while the device still runs that step, not after a drain
    that training never has."""
    run(warmup)
    run(1, then_sync=False)
    t0 = time.perf_counter()
    run(n)
    return (time.perf_counter() - t0) / n


def profile_ours(args, attention: str, ref_attention: str, precision: str) -> None:
    """Where a step of ours spends its time: see the module docstring (--profile)."""
    from torch.profiler import ProfilerActivity, profile

    preset = args.presets.split(",")[0]
    seq = max(int(s) for s in args.seqs.split(","))
    tokens = int(args.tokens_per_step.split(",")[0])
    objectives = args.objectives.split(",")
    objective = "mlm" if "mlm" in objectives else objectives[0]
    trainer, cfg, mb = build_ours(args, preset, seq, tokens, objective, precision, None, attention)
    phase, n, gpu = cfg.phases[0], args.profile_steps, on_gpu()
    source = Samples(trainer, phase, mb)

    def one_step(k: int) -> None:
        trainer.step = k
        trainer.train_step(trainer.phase_at_step(k))

    run = stepper(one_step)
    plain = unprofiled_step_time(run, args.warmup, n)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    # The lead-in step is traced, not recorded; the n steps after it are recorded as one.
    lead_in = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with profile(activities=activities, schedule=lead_in) as prof:
        run(1, then_sync=False)
        prof.step()
        t0 = time.perf_counter()
        run(n)
        wall = time.perf_counter() - t0
    if args.trace:
        prof.export_chrome_trace(args.trace)
    table = prof.key_averages()
    if gpu:
        print(table.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    # The busy fraction is the device's time inside the timed window over the window; that time
    # includes the lead-in step's last kernels, which run inside it. The device work of a step is
    # taken from the next pass, which starts drained: its kernels are its own steps' alone.
    window_work = device_ms(prof) if gpu else None
    # Where the host's time goes, by Python caller: a second, shorter pass with stacks (they
    # slow the host, so the timed pass above runs without them).
    with profile(activities=activities, with_stack=True) as prof:
        run(min(n, 2))
    print("ours:", end=" ")
    print_host_callers(prof, min(n, 2))
    busy = busy_plain = work = None
    if gpu and window_work is not None:
        busy = window_work / 1e3 / wall
        work = device_ms(prof) / min(n, 2)
        # The profiler slows the host (each launch is recorded), not the kernels: a step's
        # device work over the unprofiled step is the busy fraction of a step as it trains.
        busy_plain = work / 1e3 / plain
    print(
        f"profile: {preset} s{seq} {objective} {precision}, mb {mb}, attention {attention}; "
        f"{args.warmup} warm-up steps, then {n} steps each: unprofiled {plain:.4f} s/step, "
        f"profiled {wall / n:.4f} s/step; GPU busy {fmt(busy, '.1%')} of the profiled wall "
        f"time ({fmt(busy_plain, '.1%')} of the unprofiled step's), device work "
        f"{fmt(work, '.1f')} ms/step"
    )
    print(describe_documents(document_figures(source, range(args.warmup, args.warmup + n)), seq))
    ref = {}
    back_to_back = None
    if not args.no_ref:
        ref = profile_reference(args, cfg, source, ref_attention, n)
        back_to_back = plain / ref["plain"]
        print(
            f"back to back, unprofiled (as training runs steps): ours {plain:.4f} s/step, "
            f"reference {ref['plain']:.4f} s/step, ours / reference {back_to_back:.3f}"
        )
    cuda_syncs, syncs = count_syncs(run, n, "ours")
    trainer.close()
    print(
        f"RESULT train_throughput_profile host_syncs_per_step={fmt(syncs, 'g')} "
        f"gpu_busy={fmt(busy, '.3f')} gpu_busy_unprofiled={fmt(busy_plain, '.3f')}"
        + (f" cuda_syncs_per_step={cuda_syncs:g}" if gpu else "")
        + f" device_ms={fmt(work, '.2f')} ref_device_ms={fmt(ref.get('work'), '.2f')}"
        + f" back_to_back_vs_reference={fmt(back_to_back, '.3f')}"
        + f" ref_host_syncs_per_step={fmt(ref.get('syncs'), 'g')}"
        + (f" ref_cuda_syncs_per_step={fmt(ref.get('cuda_syncs'), 'g')}" if gpu else "")
    )


def profile_reference(args, cfg, source: Samples, ref_attention: str, n: int) -> dict:
    """The reference's steps on ours' batches, profiled as ours' are: unprofiled back to back (after
    a lead-in step, the clock stopped by a drain), then under the profiler from a drain (its
    device work per step: the kernels' time summed, None on CPU; its top kernels), its host time
    by caller (a pass with stacks), its synchronisations (CUDA's count and HostSyncCounter's).
    Step numbers run on from pass to pass, so that each step finds the batch fetched ahead."""
    from torch.profiler import ProfilerActivity, profile

    gpu = on_gpu()
    bf16 = gpu and cfg.train.precision == "bf16"
    run = stepper(reference_loop(args, cfg, source, ref_attention, bf16))
    plain = unprofiled_step_time(run, args.warmup, n)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run(n)
        wall = (time.perf_counter() - t0) / n
    work = device_ms(prof) / n if gpu else None
    print(
        f"reference, same batches: unprofiled {plain:.4f} s/step, profiled {wall:.4f} s/step; "
        f"device work {fmt(work, '.1f')} ms/step"
    )
    if gpu:
        table = prof.key_averages().table(
            sort_by="self_device_time_total", row_limit=12, max_name_column_width=60
        )
        print(table)
    with profile(activities=activities, with_stack=True) as prof:
        run(min(n, 2))
    print("reference:", end=" ")
    print_host_callers(prof, min(n, 2))
    cuda_syncs, syncs = count_syncs(run, n, "reference")
    return {"plain": plain, "work": work, "cuda_syncs": cuda_syncs, "syncs": syncs}


def device_ms(prof) -> float:
    """The device time of the profiled kernels, copies and fills, summed, in ms. Not the ranges
    torch marks on the device around work already counted (`Optimizer.step#AdamW.step` spans
    the fused AdamW's kernels: counted, the optimizer's time would be added twice), as torch's
    own "Self CUDA time total" leaves them out."""
    from torch.autograd import DeviceType

    return (
        sum(
            getattr(e, "device_time", None) or e.cuda_time
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation
        )
        / 1e3
    )


def count_syncs(run: Callable[[int], None], n: int, who: str) -> tuple[float | None, float | None]:
    """(CUDA's count of synchronising calls per step or None off CUDA, HostSyncCounter's or None
    where it cannot count) over n steps of `run(n)`, printed with their commonest sites."""
    from megatron_mlmclm.training.step.host_syncs import HostSyncCounter, cuda_sync_debug_count

    cuda_syncs = None
    if on_gpu():
        count, messages = cuda_sync_debug_count(lambda: run(n))
        cuda_syncs = count / n
        print(f"{who}: CUDA sync debug mode: {cuda_syncs:g} synchronising calls per step")
        for m in messages[:8]:
            print(f"  {m.splitlines()[0][:140]}")
    # Last: the counter is a dispatch mode, under which torch.compile does not trace and torch
    # runs no higher-order operator without a rule for it (FlexAttention): on the flex path it
    # stops the step, and --attention sdpa counts the rest. A diagnostic: whatever stops the
    # counted steps is printed, and the profile goes on.
    syncs = None
    try:
        with HostSyncCounter() as counter:
            run(n)
        syncs = counter.total / n
        print(f"{who}: host synchronisations over {n} steps ({syncs:g} per step), commonest sites:")
        print("\n".join(counter.report().splitlines()[:20]))
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:200]
        print(f"{who}: HostSyncCounter cannot count this step: {type(e).__name__}: {first}")
    return cuda_syncs, syncs


def print_host_callers(prof, steps: int, top: int = 14, frames: int = 4) -> None:
    """The host's self time of torch's operators, summed by operator and its innermost Python
    frames (the profiler's Python events are the operators' ancestors)."""
    totals: dict[tuple, list] = {}
    for e in prof.events():
        if ".py(" in e.name or e.name.startswith("<built-in") or e.self_cpu_time_total <= 0:
            continue
        where, parent = [], e.cpu_parent
        while parent is not None and len(where) < frames:
            if ".py(" in parent.name and "/torch/" not in parent.name:
                where.append(parent.name.split("/")[-1])
            parent = parent.cpu_parent
        entry = totals.setdefault((e.name, " < ".join(where) or "?"), [0.0, 0])
        entry[0] += e.self_cpu_time_total
        entry[1] += 1
    print(f"host time by caller (self CPU per step over {steps} steps, innermost frame first):")
    for (name, where), (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us / 1e3 / steps:7.2f} ms {count / steps:6.0f}x {name[:40]:40s} {where[:220]}")
