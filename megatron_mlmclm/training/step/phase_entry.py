"""Entering a phase: what the model must be told of the phase it runs, applied when it changes.

A phase's RoPE base (phases.N.rotary_base) rebuilds the rotary frequencies of every chunk; on the
packed THD path the attention kernels take the mask kind rather than a mask (causal for CLM, none
for MLM). Everything else of a phase (objective, mask ratio, stream) reaches the step through its
batches (training/batches/loader.py).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron_mlmclm.config import ModelConfig, PhaseConfig
from megatron_mlmclm.model.build import set_rotary_base
from megatron_mlmclm.model.packed import set_attention_mask_type


class PhaseEntry:
    def __init__(self, model_chunks: list[torch.nn.Module], model: ModelConfig, thd: bool):
        self.chunks, self.model, self.thd = model_chunks, model, thd
        self.rotary_base: float | None = None  # what the model has now
        self.mask_type: AttnMaskType | None = None

    def enter(self, phase: PhaseConfig) -> None:
        """Make the model the one `phase` trains (a phase that gives no RoPE base keeps the
        model's)."""
        if phase.rotary_base is not None and phase.rotary_base != self.rotary_base:
            set_rotary_base(self.chunks, self.model, phase.rotary_base)
            self.rotary_base = phase.rotary_base
        if self.thd:
            mask = AttnMaskType.causal if phase.objective == "clm" else AttnMaskType.no_mask
            if mask != self.mask_type:
                set_attention_mask_type(self.chunks, mask)
                self.mask_type = mask
