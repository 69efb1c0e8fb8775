"""The contenders of a row of benchmarks/train_throughput.py, fed the same samples: ours (the
Trainer), HF EuroBERT, the plain-PyTorch reference (reference_encoder.py) and ours with the
distributed optimizer. Each is a `Contender`: `step(r)` runs step r, its loss read at its end."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from _engine import hf_eurobert
from reference_encoder import ReferenceEncoder, ReferenceLoop, ReferenceStep, make_batch

LR, BETAS, EPS, WD, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def on_gpu() -> bool:
    return torch.cuda.is_available()


def build_ours(
    args,
    preset: str,
    seq: int,
    tokens: int,
    objective: str,
    precision: str,
    fp8,
    attention: str,
    extra: list[str] | None = None,
):
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.training.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench_train_throughput_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    mb = args.micro_batch or max(1, tokens // seq)
    overrides = [
        f"output_dir={out}",
        f"checkpoint.dir={out}/ckpt",
        "checkpoint.resume=false",
        "logging.tensorboard=false",
        "data.mock=true",
        f"data.mock_doc_length={args.documents}",
        f"model.preset={preset}",
        # batches built in this process, as for hf and ref (benchmarks/data_loader.py); the
        # trainer builds the next step's while it waits for this step's figures
        "data.loader=sync",
        f"model.vocab_size={args.vocab}",
        f"model.seq_length={seq}",
        # room for every step a row or the profile runs, and the reference's fetch ahead
        f"train.steps={args.warmup + args.steps + 4 * args.profile_steps + 10}",
        "train.warmup_steps=0",
        "train.decay_steps=0",
        f"train.lr={LR}",
        f"train.adam_beta1={BETAS[0]}",
        f"train.adam_beta2={BETAS[1]}",
        f"train.adam_eps={EPS}",
        f"train.weight_decay={WD}",
        f"train.clip_grad={CLIP}",
        f"train.micro_batch_size={mb}",
        f"train.global_batch_size={mb}",
        f"train.precision={precision}",
        f"phases.0.objective={objective}",
    ]
    if objective == "mlm":
        overrides.append(f"phases.0.mask_ratio={args.mask_ratio}")
    if fp8:  # inside Transformer Engine's layers only
        overrides += [f"train.fp8={fp8}", "model.kernels=te"]
    cfg = load_config(None, overrides + [f"model.attention={attention}", *(extra or []), *args.set])
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer, cfg, mb


def distopt_overrides() -> list[str]:
    """Ours with the distributed optimizer's layout, in this one process (DP = 1): nothing to
    shard, and the kernel plan runs no gradient reduce and no parameter gather, on CUDA as on
    CPU."""
    return ["parallel.use_distributed_optimizer=true"]


class Samples:
    """The run's one sample stream as ours reads it, step by step: (inputs, labels, document ids),
    numpy [mb, seq], labels IGNORE where no loss (CLM: the next token of another document), the
    MLM masks ours draws (objectives.mlm_mask)."""

    def __init__(self, trainer, phase, mb: int):
        from megatron_mlmclm.objectives import IGNORE, mlm_mask

        self.ds, self.spec, self.seed = trainer.train_ds[0], trainer.spec, trainer.cfg.data.seed
        self.phase, self.mb, self.mlm_mask, self.ignore = phase, mb, mlm_mask, IGNORE

    def rows(self, r: int) -> list[int]:
        if (r + 1) * self.mb > len(self.ds):
            raise IndexError(f"step {r} is past the benchmark's {len(self.ds)} samples")
        return list(range(r * self.mb, (r + 1) * self.mb))

    def document_ids(self, r: int) -> np.ndarray:
        """[mb, seq]: the document ids of step r's input positions."""
        return np.stack([self.ds[i]["document_ids"][:-1] for i in self.rows(r)])

    def batch(self, r: int):
        idx = self.rows(r)
        samples = [self.ds[i] for i in idx]
        tokens = np.stack([s["tokens"] for s in samples]).astype(np.int64)
        docs = np.stack([s["document_ids"] for s in samples])
        if self.phase.objective == "clm":
            labels = tokens[:, 1:].copy()
            labels[docs[:, :-1] != docs[:, 1:]] = self.ignore
            return tokens[:, :-1], labels, docs[:, :-1]
        ph = self.phase
        pairs = [
            self.mlm_mask(t[:-1], i, self.seed, ph.mask_ratio, self.spec, ph.mask_replace)
            for t, i in zip(tokens, idx)
        ]
        return np.stack([q[0] for q in pairs]), np.stack([q[1] for q in pairs]), docs[:, :-1]

    def labelled(self, r: int) -> int:
        return int((self.batch(r)[1] != self.ignore).sum())


class Contender:
    """One contender of a row: `step(r)` runs step r (its loss read at its end), `close()` lets
    its memory go, `params` counts its model's parameters."""

    def __init__(self, step: Callable[[int], None], params: int, close=None):
        self.step, self.params, self._close = step, params, close

    def close(self) -> None:
        if self._close is not None:
            self._close()
        self.step = self._close = None


def parameters(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def ours_contender(trainer, name: str, row: dict, labelled: list[int] | None) -> Contender:
    def step(r: int) -> None:
        trainer.step = r
        stats = trainer.train_step(trainer.phase_at_step(r))
        if labelled is not None:
            labelled.append(int(stats["tokens"]))
        if r == 0:
            row["step0_loss"][name] = stats["loss"]

    return Contender(step, parameters(trainer.model), trainer.close)


def build_hf(cfg, bf16: bool, compile_model: bool):
    m = cfg.model
    model = hf_eurobert(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        seq_length=m.seq_length,
    )
    device = "cuda" if on_gpu() else "cpu"
    model.to(device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=on_gpu()
    )
    fwd = torch.compile(model) if compile_model else model
    return model, fwd, opt


def hf_contender(cfg, source: Samples, bf16: bool, compile_model: bool, row: dict) -> Contender:
    model, fwd, opt = build_hf(cfg, bf16, compile_model)
    dev = torch.device("cuda" if on_gpu() else "cpu")
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)

    def step(r: int) -> None:
        inputs, labels, _ = source.batch(r)
        inputs = torch.from_numpy(inputs).to(dev, non_blocking=True)
        labels = torch.from_numpy(labels).to(dev, non_blocking=True)
        with amp:
            logits = fwd(input_ids=inputs, attention_mask=torch.ones_like(inputs)).logits
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)).float(),
                labels.view(-1),
                ignore_index=source.ignore,
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # read each step, as a training loop logs it
        if r == 0:
            row["step0_loss"]["hf"] = value

    return Contender(step, parameters([model]))


def build_ref(cfg, vocab: int, causal: bool, ref_attention: str, bf16: bool, compile_model: bool):
    m = cfg.model
    torch.manual_seed(0)
    model = ReferenceEncoder(
        m.shape(),
        vocab,
        m.seq_length,
        m.rotary_base,
        m.norm_epsilon,
        m.init_method_std,
        ref_attention,
        causal,
    ).to("cuda" if on_gpu() else "cpu")
    return ReferenceStep(model, LR, BETAS, EPS, WD, CLIP, compile_model, bf16)


def reference_loop(args, cfg, source: Samples, ref_attention: str, bf16: bool) -> ReferenceLoop:
    """The reference fed ours' samples: step r's batch built, pinned and sent while step r - 1
    runs (reference_encoder.ReferenceLoop)."""
    dev = torch.device("cuda" if on_gpu() else "cpu")
    compile_model = on_gpu() and not args.no_compile
    causal = source.phase.objective == "clm"
    ref = build_ref(cfg, source.spec.vocab_size, causal, ref_attention, bf16, compile_model)
    return ReferenceLoop(ref, lambda r: make_batch(*source.batch(r), source.ignore, dev))


def ref_contender(args, cfg, source: Samples, ref_attention: str, bf16: bool, row: dict):
    loop = reference_loop(args, cfg, source, ref_attention, bf16)

    def step(r: int) -> None:
        loss = loop(r)
        if r == 0:
            row["step0_loss"]["ref"] = loss

    return Contender(step, parameters([loop.step.model]))
