"""The kernel plan as a record: each decision with why (`Choice`), what the run's TransformerConfig
takes from it, the dry run's rows and the log's one line, and the process settings it applies."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatron_mlmclm.model.kernels.machine import use_compile_cache


@dataclass(frozen=True)
class Choice:
    on: bool
    why: str


@dataclass(frozen=True)
class KernelPlan:
    device: str  # "cuda" | "cpu"
    # Transformer Engine's layers, attention and FusedAdam (model.kernels=te), or torch's.
    transformer_engine: Choice
    fusions: dict[str, Choice]
    overlap_grad_reduce: Choice
    overlap_param_gather: Choice
    align_param_gather: Choice
    p2p: str  # pipeline send/recv: "batched" | "overlapped" | "none" (PP = 1)
    p2p_why: str
    sequence_parallel: Choice
    context_parallel: Choice
    attention: str  # "te-thd" | "thd-reference" | "varlen" | "flex" | "sdpa"
    attention_why: str
    # torch's fused AdamW behind megatron's optimizer (its fallback without TE/Apex is unfused).
    fused_adamw: Choice = Choice(False, "")
    # The update queued before the step's figures reach the host (training/step/update.py).
    queued_update: Choice = Choice(False, "")
    # megatron's layer or the plain-torch one (model/layers.py), and what torch.compile covers.
    plain_layers: Choice = Choice(False, "")
    plain_stack: Choice = Choice(False, "")
    compile: Choice = Choice(False, "")
    # The backward's gradients into megatron's fp32 main_grad: one foreach kernel per backward
    # pass, or megatron's one kernel per parameter (training/step/data_parallel.py, DataParallel).
    batched_grad_accumulation: Choice = Choice(False, "")
    # The stack as consecutive chunks of layers, one compiled graph each (model/layers.py).
    stack_chunks: int = 1
    stack_chunks_why: str = ""
    # Data-parallel ranks times context-parallel ranks: the gradient reduce's group.
    data_parallel_size: int = 1
    data_parallel_why: str = ""
    context_parallel_size: int = 1
    # What communicates each step over the launch's groups ("none" in a world of one), and what.
    collectives: str = "none"
    collectives_why: str = ""
    # THD streams: the whole micro-batch's token count is padded to `thd_token_multiple` (FP8
    # GEMMs; TP under sequence parallelism); with CP each sequence to `cp_sequence_multiple`.
    thd_token_multiple: int = 1
    thd_multiple_why: str = ""
    cp_sequence_multiple: int = 1
    # Process settings made before CUDA starts (apply_to_process).
    cuda_device_max_connections: str | None = None
    connections_why: str = ""
    tf32: bool | None = None  # None: torch's default
    tf32_why: str = ""
    compile_cache: str = ""  # TORCHINDUCTOR_CACHE_DIR (machine.compile_cache_dir)

    @property
    def thd(self) -> bool:
        """Packed THD sequences (TE's kernel, or its pure-torch stand-in on CPU)."""
        return self.attention in THD_PATHS

    def transformer_kwargs(self) -> dict:
        """The TransformerConfig fields this plan sets."""
        kw = {name: c.on for name, c in self.fusions.items()}
        kw.update(
            sequence_parallel=self.sequence_parallel.on,
            # model/init.py redraws every weight by global parameter. megatron's own
            # init still runs: it is also where megatron marks tensor-parallel weights
            # (without the marks the gradient norm counts TP shards as replicas).
            use_cpu_initialization=False,
            batch_p2p_comm=self.p2p == "batched",
            overlap_p2p_comm=self.p2p == "overlapped",
        )
        if self.context_parallel.on:
            # p2p ring exchange of K/V (what THD supports); each micro-batch's CP-padded length
            # differs, so pipeline stages exchange shapes first.
            kw.update(
                context_parallel_size=self.context_parallel_size,
                cp_comm_type="p2p",
                variable_seq_lengths=True,
                # megatron-core refuses variable lengths with its default MoE dispatcher,
                # even in a model without experts (this one): name the one it accepts.
                moe_token_dispatcher_type="alltoall",
            )
        return kw

    def rows(self) -> list[tuple[str, bool | str, str]]:
        """(name, on or value, why) for every decision, in print order."""
        te = self.transformer_engine
        out = [("transformer_engine", te.on, te.why)]
        out += [(n, c.on, c.why) for n, c in self.fusions.items()]
        out += [
            ("data_parallel", str(self.data_parallel_size), self.data_parallel_why),
            ("overlap_grad_reduce", self.overlap_grad_reduce.on, self.overlap_grad_reduce.why),
            ("overlap_param_gather", self.overlap_param_gather.on, self.overlap_param_gather.why),
            ("align_param_gather", self.align_param_gather.on, self.align_param_gather.why),
            ("pipeline_p2p", self.p2p, self.p2p_why),
            ("sequence_parallel", self.sequence_parallel.on, self.sequence_parallel.why),
            ("context_parallel", self.context_parallel.on, self.context_parallel.why),
            ("initialization", "global", INIT_WHY),
            ("attention", self.attention, self.attention_why),
            ("fused_adamw", self.fused_adamw.on, self.fused_adamw.why),
            ("queued_update", self.queued_update.on, self.queued_update.why),
            ("plain_layers", self.plain_layers.on, self.plain_layers.why),
            ("plain_stack", self.plain_stack.on, self.plain_stack.why),
            ("stack_chunks", str(self.stack_chunks), self.stack_chunks_why),
            ("compile", self.compile.on, self.compile.why),
            ("compile_cache", self.compile_cache, COMPILE_CACHE_WHY),
            (
                "batched_grad_accumulation",
                self.batched_grad_accumulation.on,
                self.batched_grad_accumulation.why,
            ),
            ("collectives", self.collectives, self.collectives_why),
            ("host_syncs", "one a step", HOST_SYNCS_WHY),
        ]
        if self.thd:
            out.append(("thd_token_multiple", str(self.thd_token_multiple), self.thd_multiple_why))
        if self.device == "cuda":
            out.append(
                (
                    "CUDA_DEVICE_MAX_CONNECTIONS",
                    self.cuda_device_max_connections or "unset",
                    self.connections_why,
                )
            )
            out.append(("tf32", "off" if self.tf32 is False else "default", self.tf32_why))
        return out

    def report(self) -> str:
        """The plan as text (`--dry-run`): one line a decision."""
        width = max(len(n) for n, _, _ in self.rows())
        lines = [f"kernel plan for {self.device}:"]
        for name, on, why in self.rows():
            value = on if isinstance(on, str) else ("on" if on else "off")
            lines.append(f"  {name:<{width}}  {value:<8}  {why}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One log line: what is on, and why anything is off."""
        on = [n for n, v, _ in self.rows() if v is True]
        off: dict[str, list[str]] = {}  # why -> names, so a shared reason is said once
        for name, value, why in self.rows():
            if value is False:
                off.setdefault(why, []).append(name)
        said = "; ".join(f"{', '.join(names)} ({why})" for why, names in off.items())
        return (
            f"kernels on {self.device}: on: {', '.join(on) or 'none'}; attention: "
            f"{self.attention}; pipeline p2p: {self.p2p}; off: {said or 'none'}"
        )

    def apply_to_process(self) -> None:
        """What must be in place before CUDA starts: called by the trainer before the process
        group (a value the user exported is kept)."""
        if self.cuda_device_max_connections is not None:
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", self.cuda_device_max_connections)
        if self.tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32
        use_compile_cache(self.compile_cache)  # this run's, not the first run's of the process


THD_PATHS = ("te-thd", "thd-reference")
COMPILE_CACHE_WHY = (
    "Inductor's caches (its graphs, kernels and Triton's under them), kept across the run's "
    "restarts: a restart loads what the first start compiled; $MLMCLM_CACHE_DIR/inductor "
    "shares them between runs (a TORCHINDUCTOR_CACHE_DIR you exported is kept)"
)
INIT_WHY = (
    "every parameter drawn whole from (train.seed, its checkpoint key, its layer) and "
    "sliced: every TP/PP/VPP layout starts from the single-process model (model/init.py)"
)
HOST_SYNCS_WHY = (
    "batches laid out and labelled positions, cu_seqlens and RoPE positions computed on the "
    "host; loss totals, gradient norm and the non-finite check come back in one transfer, "
    "which with queued_update waits for them only, not the update (training/step/host_syncs.py)"
)
