"""megatron-core's optimizer as this project runs it: its kernels without Apex or Transformer
Engine, its distributed optimizer's state without them, torch's fused AdamW behind it, the skip of
a non-finite step decided on the device, and the main parameters read back after loading weights.

Each replacement is a row of registry.yaml; `apply_everywhere()` (called by apply.py in every
process that trains or converts) installs the module-level ones, the rest are called where a
run needs them (training/step/optimizer.py, training/step/update.py, checkpoint/):
`use_torch_adamw()` puts torch's AdamW in the place of an installed Transformer Engine's or Apex's
FusedAdam."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator

import torch

_applied = False


def _inplace_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    src, dst = tensor_lists
    if any(s is not d for s, d in zip(src, dst)):
        torch._foreach_copy_(dst, src)
    torch._foreach_mul_(dst, scale)


def _foreach_copy_this_to_that(this, that, overflow_buf=None):
    """megatron's copy between the main (fp32) and model (bf16) parameters, as one foreach copy
    where megatron, without Apex's multi-tensor kernel for bf16, loops over the parameters: one
    kernel launch per parameter per step. The same values (a copy is an exact cast)."""
    if overflow_buf is not None:
        return _megatron_copy_this_to_that(this, that, overflow_buf)
    if this:
        torch._foreach_copy_(list(that), list(this))


_megatron_copy_this_to_that = None


def apply_everywhere() -> None:
    """The optimizer's replacements for every run, CPU or GPU (once per process); those for a
    missing Apex or Transformer Engine apply only where megatron-core fell back."""
    global _applied
    if _applied:
        return
    # Without Apex/TE, gradient clipping scales every gradient through an out-of-place
    # `dst.copy_(src * scale)` (an extra copy of all gradients per step, ~4% of a small CPU step).
    # The in-place foreach version gives the same values.
    core_utils = importlib.import_module("megatron.core.utils")
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        if module.multi_tensor_scale_impl is core_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _inplace_multi_tensor_scale
    # Without Apex, megatron copies the updated fp32 main parameters into the bf16 model ones
    # one parameter at a time (a launch each, every step); one foreach copy does the same.
    global _megatron_copy_this_to_that
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    _megatron_copy_this_to_that = optimizer._multi_tensor_copy_this_to_that
    optimizer._multi_tensor_copy_this_to_that = _foreach_copy_this_to_that

    # The distributed optimizer's fully_reshardable save (checkpoint/) cuts each parameter's
    # state out of world tensors that leave out the padding at the ends of the buckets, at the
    # parameter's place in the padded buffer: past a bucket whose end is padded, every parameter
    # was saved with a neighbour's state, shifted by the padding, and resumed from it (megatron
    # warns only where a range runs off the end: its issue #504). Cut at the unpadded places.
    dopt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    original = dopt.DistributedOptimizer.sharded_param_state_fully_reshardable

    @functools.wraps(original)
    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        padded = [buffer.param_index_map for buffer in self.buffers]
        for buffer in self.buffers:
            buffer.param_index_map = _unpadded_index_map(buffer)
        try:
            return original(self, *args, **kwargs)
        finally:
            for buffer, index_map in zip(self.buffers, padded):
                buffer.param_index_map = index_map

    dopt.DistributedOptimizer.sharded_param_state_fully_reshardable = (
        sharded_param_state_fully_reshardable
    )
    if not dopt.HAVE_APEX_OR_TE:
        _torch_adam_state()
    _applied = True


def _unpadded_index_map(buffer) -> dict:
    """A buffer's param_index_map with each range at its place in megatron's world tensors
    (get_parameter_state_dp_zero), which hold each bucket's unpadded elements one after another."""
    shift, before = {}, 0
    for bucket in buffer.buckets:
        shift[bucket.bucket_id] = bucket.offset - before
        before += bucket.numel_unpadded
    return {
        param: (start - shift[b], end - shift[b], b)
        for param, (start, end, b) in buffer.param_index_map.items()
    }


def use_torch_adamw() -> None:
    """torch's AdamW behind megatron's optimizer where Transformer Engine or Apex is installed and
    the kernel plan does not take it (model.kernels=torch, model/kernels/): megatron picks their
    FusedAdam as it is imported, and keys its distributed optimizer's handling of Adam's `step` on
    that choice. Sets the flags megatron sets itself when neither imports, before any optimizer
    is built, with the replacements that path needs (`_torch_adam_state`). A no-op where megatron
    already fell back."""
    core = importlib.import_module("megatron.core.optimizer")
    dopt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    if core.USING_PYTORCH_OPTIMIZER and not dopt.HAVE_APEX_OR_TE:
        return
    core.USING_PYTORCH_OPTIMIZER = True
    dopt.HAVE_APEX_OR_TE = dopt.USING_TE_OPTIMIZER = dopt.USING_APEX_OPTIMIZER = False
    _torch_adam_state()


_torch_adam_state_applied = False


def _torch_adam_state() -> None:
    """The distributed optimizer's state handling with torch's Adam (once per process)."""
    global _torch_adam_state_applied
    if _torch_adam_state_applied:
        return
    _torch_adam_state_applied = True
    dopt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    # Without Apex/TE, load_state_dict gives every parameter the *same* Adam `step` tensor;
    # torch's AdamW then increments it once per parameter per step, so bias correction is
    # wrong after resume and training silently diverges. Give each parameter its own copy.
    original = dopt.DistributedOptimizer.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    dopt.DistributedOptimizer.load_state_dict = load_state_dict

    # Loading into a fresh optimizer calls state_dict(), which without Apex/TE asserts that
    # the (still empty) Adam state has exactly one `step`. Create the state first with a
    # zero-gradient step at lr = wd = 0 (parameters unchanged); loading then overwrites it.
    original_ssd = dopt.DistributedOptimizer.sharded_state_dict

    @functools.wraps(original_ssd)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *a, **k):
        if is_loading and len(self.optimizer.state) == 0:
            saved = [(g["lr"], g["weight_decay"]) for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"], g["weight_decay"] = 0.0, 0.0
            self._init_optimizer_states_with_dummy_values()
            for g, (lr, wd) in zip(self.optimizer.param_groups, saved):
                g["lr"], g["weight_decay"] = lr, wd
        return original_ssd(self, model_sharded_state_dict or {}, is_loading, *a, **k)

    dopt.DistributedOptimizer.sharded_state_dict = sharded_state_dict

    # The fully_reshardable load path copies every Adam state tensor of a parameter from the
    # checkpoint, `step` included, but the checkpoint (rightly) carries `step` only in the
    # param groups: KeyError. Leave `step` out of the copy; load_state_dict has set it.
    original_set = dopt.DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original_set)
    def set_states(self, model_param, tensors):
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        step = state.pop("step", None)
        try:
            return original_set(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    dopt.DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def use_fused_adamw(optimizers: list, fused: bool) -> None:
    """Set torch's AdamW behind megatron's optimizers to the kernel plan's: fused (one kernel per
    tensor group) or as megatron built it (its fallback without TE or Apex passes neither `fused`
    nor `foreach`, so torch picks its foreach kernels). A checkpoint carries its param groups'
    flags and loading restores them, so this runs again after every load, both ways: a run saved
    fused and resumed with model.fusions=off runs the unfused AdamW it asked for. Fused AdamW
    keeps its step counters on the parameters' device, the unfused one on the host (torch's
    defaults)."""
    for inner in optimizers:
        if not isinstance(inner, torch.optim.AdamW):
            continue
        if fused:
            inner.defaults.update(fused=True, foreach=False)
        flags = {"fused": inner.defaults.get("fused"), "foreach": inner.defaults.get("foreach")}
        for group in inner.param_groups:
            group.update(flags)
            for param in group["params"]:
                state = inner.state.get(param, {})
                step = state.get("step")
                where = param.device if fused else torch.device("cpu")
                if isinstance(step, torch.Tensor) and step.device != where:
                    state["step"] = step.to(where, torch.float32)


def is_fused_adamw(inner) -> bool:
    """torch's AdamW with every param group fused: the one optimizer that reads `found_inf`."""
    return isinstance(inner, torch.optim.AdamW) and all(
        group.get("fused") for group in inner.param_groups
    )


@contextlib.contextmanager
def skip_step_where(optimizers: list, found_inf: torch.Tensor) -> Iterator[None]:
    """Inside the block, torch's fused AdamW `optimizers` skip their update, weight decay and step
    count where `found_inf` (a device scalar) is nonzero: torch's Adam reads the attribute
    `found_inf` from the optimizer, where torch's grad scaler sets it. Removed on the way out,
    so an optimizer step outside the block is never skipped."""
    for optimizer in optimizers:
        if not is_fused_adamw(optimizer):  # the unfused kernels refuse found_inf
            raise RuntimeError("skip_step_where needs torch's fused AdamW (kernel plan)")
    for optimizer in optimizers:
        optimizer.found_inf = found_inf
    try:
        yield
    finally:
        for optimizer in optimizers:
            del optimizer.found_inf


def model_and_main_params(optimizer) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(model parameter, its fp32 main copy) for each parameter of one of megatron's
    mixed-precision optimizers (bf16: Float16OptimizerWithFloat16Params, the distributed
    optimizer), through their private `_get_model_and_main_params_data_float16`; [] for an fp32
    optimizer, which keeps no copies. Raises where a mixed-precision optimizer no longer has the
    method, instead of reporting no copies."""
    mixed = importlib.import_module("megatron.core.optimizer.optimizer").MixedPrecisionOptimizer
    if not isinstance(optimizer, mixed):
        return []
    model, main = optimizer._get_model_and_main_params_data_float16()
    return list(zip(model, main))


def model_and_updated_params(optimizer) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, the tensor the optimizer's AdamW updates for it: its fp32 main copy,
    under the distributed optimizer this rank's shard of it, in fp32 the parameter itself) for
    each parameter of one of megatron's optimizers, paired as its prepare_grads pairs them to hand
    AdamW their gradients, through the private groups it pairs (registry.yaml)."""
    if hasattr(optimizer, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        groups = [
            (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
            (optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
        ]
    elif hasattr(optimizer, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        groups = [
            (optimizer.float16_groups, optimizer.fp32_from_float16_groups),
            (optimizer.fp32_from_fp32_groups, optimizer.fp32_from_fp32_groups),
        ]
    else:  # FP32Optimizer: AdamW updates the model's own parameters
        params = [group["params"] for group in optimizer.optimizer.param_groups]
        groups = [(params, params)]
    return [
        pair
        for models, updated in groups
        for model_group, updated_group in zip(models, updated)
        for pair in zip(model_group, updated_group)
    ]
