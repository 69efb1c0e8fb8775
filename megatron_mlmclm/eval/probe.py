"""The evaluation probe: what a fine-tuning run costs on this machine, measured, for the planner.

`mlmclm evaluate --probe SIZE --tokenizer TOK --task T1 T2 ... --out FILE.json` builds a randomly
initialised EuroBERT encoder of the model preset's shape (config/schema.py MODEL_PRESETS) with the
tokenizer's vocabulary, as an exported folder is (fp32 weights, the tokenizer with the
pretraining document rule: no BOS, EOS), in a temporary folder; then fine-tunes each task on it
with the real pipeline (the task's data read and encoded in full, its batches, its head, the
loop of eval/finetune.py under the protocol's settings) for `steps` steps, and measures:

- startup_s: from the run's start (as `run_finetune` starts: task entry, tokenizer, data read and
  encoded, model and head built and moved to the device, optimizer) to its first step. The
  process's own start (importing torch and transformers) is not in it;
- first_steps_s: the first WARMUP_STEPS steps (compilation, allocator warm-up), and step_s: the
  median step after them, each step's time taken on the device's stream (CUDA events; on CPU
  the clock), the device synchronised before the figures are read;
- mean_tokens, padded_tokens: real tokens per training input, and the padded length of a batch
  row (each batch is padded to its longest input), over the batches the probe trained on (IR: a
  query and its document together);
- scored_per_s (sc, tc, qa): validation inputs scored per second, on at most PROBE_SCORED of them;
  documents_per_s, queries_per_s (ir): corpus documents and queries encoded per second, on a
  bounded sample (eval/families/ir.py `probe`).

No validation runs during the probe's steps: its figures come from the bounded evaluation
above, so a probe of MS MARCO does not encode 8.8M passages.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import transformers

from megatron_mlmclm.config.schema import MODEL_PRESETS
from megatron_mlmclm.document import document_tokenizer, shards_rule
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.families import family_of
from megatron_mlmclm.eval.finetune import (
    autocast_for,
    build_setup,
    max_length_for,
    resolve_device,
    resolved_precision,
    seed_everything,
    train,
    write_text_atomic,
)
from megatron_mlmclm.eval.grid import expand
from megatron_mlmclm.eval.input_form import load_tokenizer
from megatron_mlmclm.eval.protocols import resolve
from megatron_mlmclm.eval.tasks import get_task
from megatron_mlmclm.hf_folder import NO_CODE

PROBE_KIND = "mlmclm-eval-probe"
PROBE_SCHEMA = 1
WARMUP_STEPS = 10  # steps left out of step_s (compilation, warm-up): first_steps_s
PROBE_SCORED = 512  # validation inputs scored (sc, tc, qa)


def probe_model(size: str, tokenizer_dir: str | Path, out: str | Path) -> Path:
    """A random-init EuroBERT folder of preset `size`'s shape with the tokenizer's vocabulary."""
    from transformers import AutoTokenizer, EuroBertConfig, EuroBertModel

    if size not in MODEL_PRESETS:
        raise UsageError(f"--probe {size}: choose a model preset: {', '.join(MODEL_PRESETS)}")
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True, **NO_CODE)
    except Exception as e:
        raise UsageError(f"cannot load the tokenizer {tokenizer_dir}: {e}") from None
    if tok.pad_token_id is None or tok.eos_token_id is None or not tok.is_fast:
        raise UsageError(
            f"--tokenizer {tokenizer_dir} must be a fast tokenizer with pad and eos tokens "
            "(one `mlmclm tokenize` wrote)"
        )
    shape = MODEL_PRESETS[size]
    cfg = EuroBertConfig(
        vocab_size=len(tok),
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["ffn_hidden_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_query_groups"],
        head_dim=shape["kv_channels"],
        max_position_embeddings=shape["seq_length"],
        mlp_bias=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        mask_token_id=tok.mask_token_id,
    )
    torch.manual_seed(0)
    EuroBertModel(cfg).save_pretrained(str(out))
    document_tokenizer(tok, **shards_rule(None), save_text_rule=False)  # as an export saves it
    tok.save_pretrained(str(out))
    return Path(out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _masks(batch):
    """The attention masks of a collated batch (a dict, or IR's (queries, documents))."""
    if isinstance(batch, Mapping):  # a dict, or a tokenizer's BatchEncoding
        return [batch["attention_mask"]] if "attention_mask" in batch else []
    if isinstance(batch, (list, tuple)):
        return [m for part in batch for m in _masks(part)]
    return []


class StepClock:
    """train()'s `watch`: when each step ended (CUDA events recorded on the stream, read once
    the run is over; on CPU the clock) and the tokens of each batch."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: list = []
        self.first_step_at = 0.0
        self.rows = self.real = self.padded = 0

    def _mark(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def started(self) -> None:
        _sync(self.device)
        self.first_step_at = time.perf_counter()
        self._mark()

    def stepped(self, step: int, batch) -> None:
        self._mark()
        masks = _masks(batch)
        if masks:
            self.rows += masks[0].shape[0]
            self.real += sum(int(m.sum()) for m in masks)
            self.padded += sum(m.numel() for m in masks)

    def step_seconds(self) -> list[float]:
        _sync(self.device)
        if self.device.type == "cuda":
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def probe_task(model_dir: str, task: str, steps: int, protocol: str, **settings):
    """The probe's figures for one task (the module's head); `settings`: FinetuneConfig fields
    (device, threads, task_files, max_eval_examples: PROBE_SCORED by default)."""
    [cfg] = expand(
        [model_dir],
        [task],
        [1e-4],
        [0],
        protocol=protocol,
        max_steps=steps,
        epochs=None,
        eval_every=steps + 1,  # the last step's validation alone: replaced below
        progress=False,
        **{"max_eval_examples": PROBE_SCORED, **settings},
    )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()  # the run's start, as run_finetune's
    entry = resolve(get_task(cfg.task, cfg.task_files), cfg.protocol)
    tokenizer = load_tokenizer(cfg.model, cfg.inputs)
    dev = resolve_device(cfg)
    seed_everything(cfg.seed)
    setup = build_setup(cfg, entry, tokenizer, dev)
    evaluate, setup.evaluate = setup.evaluate, lambda model, split: {}
    clock = StepClock(dev)
    out = train(setup, cfg, dev, watch=clock)
    seconds = clock.step_seconds()
    timed = seconds[WARMUP_STEPS:] or seconds
    figures = {
        "family": entry.family,
        "batch": cfg.batch_size,
        "steps": out["steps"],
        "startup_s": clock.first_step_at - t0,
        "step_s": statistics.median(timed),
        "first_steps_s": sum(seconds[:WARMUP_STEPS]),
        "mean_tokens": clock.real / clock.rows,
        "padded_tokens": clock.padded / clock.rows,
    }
    model = setup.model
    model.eval()
    family = family_of(entry)
    with torch.no_grad(), autocast_for(cfg, dev)():
        if family.probe is not None:
            figures.update(family.probe(entry, cfg, model, max_length_for(cfg), lambda: _sync(dev)))
        else:
            _sync(dev)
            t = time.perf_counter()
            evaluate(model, "validation")
            _sync(dev)
            scored = setup.info["eval_examples"]["validation"]
            figures["scored_per_s"] = scored / (time.perf_counter() - t)
    return figures, dataclasses.replace(cfg, device=str(dev))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_probe(
    size: str,
    tokenizer: str | Path,
    tasks: list[str],
    out: str | Path,
    steps: int = 200,
    protocol: str = "default",
    log=print,
    **settings,
) -> dict:
    """Probe every task of `tasks` at model preset `size`; write the figures to `out` (JSON,
    atomically) and return them. `settings`: FinetuneConfig fields (device, threads,
    task_files, max_eval_examples)."""
    if steps < 1:
        raise UsageError("--probe-steps must be >= 1")
    figures: dict[str, dict] = {}
    cfg = None
    with tempfile.TemporaryDirectory(prefix=f"mlmclm-probe-{size}-") as tmp:
        model_dir = str(probe_model(size, tokenizer, Path(tmp) / f"probe-{size}"))
        for name in dict.fromkeys(tasks):
            log(f"probe {size}: {name} ({steps} steps)")
            figures[name], cfg = probe_task(model_dir, name, steps, protocol, **settings)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    dev = resolve_device(cfg) if cfg is not None else torch.device("cpu")
    record = {
        "kind": PROBE_KIND,
        "schema": PROBE_SCHEMA,
        "size": size,
        "protocol": protocol,
        "device": device_name(dev),
        "precision": resolved_precision(cfg, dev) if cfg is not None else "fp32",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "megatron_mlmclm": _own_version(),
        },
        "tasks": figures,
    }
    write_text_atomic(Path(out), json.dumps(record, indent=1) + "\n")
    return record


def _own_version() -> str:
    try:
        return importlib.metadata.version("megatron_mlmclm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
