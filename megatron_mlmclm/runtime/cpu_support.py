"""Run megatron-core 0.16 on machines without CUDA (gloo + CPU tensors), with no source edits.

megatron-core has no CPU path: it asks for `torch.cuda.current_device()`, creates tensors with a
literal `device="cuda"`, keeps CUDA RNG states and checks
`tensor.type() == 'torch.cuda.FloatTensor'`. Everything needed to redirect those to the CPU lives
in this one module and is applied only when CUDA is unavailable (`apply()` is a no-op otherwise).
`PATCH_TARGETS` lists every object we replace so that a test can prove each still exists in the
installed megatron-core: when an upgrade moves one, that test fails instead of training silently
going wrong.

`apply_megatron_fixes()` holds fixes for megatron bugs that are not CPU-specific (they bite any run
without Apex/Transformer Engine) and is applied everywhere.
"""

from __future__ import annotations

import functools
import importlib
import types

import torch

# Modules that call tensor factories with a literal device="cuda"; their module-global `torch` is
# replaced by a proxy that maps a CUDA device to the CPU.
CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
)

# (module, attribute) pairs replaced by apply(); checked by tests/test_cpu_support.py.
PATCH_TARGETS = (
    ("torch.cuda", "current_device"),
    ("torch.cuda", "synchronize"),
    ("torch.cuda", "get_rng_state"),
    ("torch.cuda", "set_rng_state"),
    ("torch.cuda", "manual_seed"),
    ("torch.cuda.random", "get_rng_state"),
    ("torch", "Tensor.cuda"),
    ("torch", "Tensor.type"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.tensor_parallel.layers", "_initialize_affine_weight_gpu"),
) + tuple((m, "torch") for m in CUDA_LITERAL_MODULES)

# Megatron bugs fixed everywhere (not only on CPU).
FIX_TARGETS = (
    ("megatron.core.utils", "local_multi_tensor_scale"),
    ("megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl"),
    ("megatron.core.optimizer.optimizer", "multi_tensor_scale_impl"),
    ("megatron.core.optimizer.optimizer", "_multi_tensor_copy_this_to_that"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.sharded_state_dict"),
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._init_optimizer_states_with_dummy_values",
    ),
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._set_main_param_and_optimizer_states",
    ),
    ("megatron.core.optimizer.distrib_optimizer", "HAVE_APEX_OR_TE"),
)

# megatron-core private names this project relies on outside the patches (checkpoint.py: the
# main-parameter check after loading weights); checked with the targets above.
PRIVATE_API = (
    (
        "megatron.core.optimizer.optimizer",
        "Float16OptimizerWithFloat16Params._get_model_and_main_params_data_float16",
    ),
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._get_model_and_main_params_data_float16",
    ),
)

_FACTORIES = frozenset(
    "tensor zeros ones empty full arange rand randn randint empty_like zeros_like ones_like "
    "full_like as_tensor eye linspace".split()
)

_applied = False
_fixes_applied = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


class _CpuTorch(types.ModuleType):
    """Stands in for `torch` inside CUDA_LITERAL_MODULES: same names, CPU factories."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        return _cpu_factory(attr) if name in _FACTORIES else attr


def _resolve(module: str, attr: str):
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def check_targets() -> list[str]:
    """Targets that no longer exist in the installed torch/megatron-core (empty when all good)."""
    missing = []
    for module, attr in PATCH_TARGETS + FIX_TARGETS + PRIVATE_API:
        try:
            _resolve(module, attr)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{attr}")
    return missing


def apply() -> bool:
    """Patch torch/megatron-core for CPU execution. Returns True when patches were applied."""
    global _applied
    apply_megatron_fixes()
    if cuda_available() or _applied:
        return _applied
    missing = check_targets()
    if missing:
        raise RuntimeError(f"megatron-core CPU support: patch targets missing: {missing}")

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)

    # .cuda() on a CPU tensor stays on the CPU (it returns self, as .cuda() does on a CUDA tensor).
    torch.Tensor.cuda = lambda self, *a, **k: self
    # `param.type() == 'torch.cuda.FloatTensor'` guards in the optimizers: answer as if on CUDA.
    original_type = torch.Tensor.type

    def type_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_as_cuda

    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(
        new_state
    )
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    layers._initialize_affine_weight_gpu = _initialize_affine_weight_on_cpu(layers)

    proxy = _CpuTorch()
    for name in CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = proxy
    _applied = True
    return True


def _initialize_affine_weight_on_cpu(layers):
    """megatron's weight init "on the GPU", for CPU tensors: the same draws from the same state.

    megatron draws each linear and embedding weight inside its CUDA RNG tracker's `fork()`, which
    warns "CPU RNG state changed within GPU RNG context" when torch's CPU generator moved inside
    it. On a GPU the weight is a CUDA tensor and the draw moves the CUDA generator only: no
    warning. Here the CUDA RNG is the CPU generator (apply() maps one onto the other), so every
    one of these draws moved "the CPU RNG" and the check, comparing the generator with itself,
    fired once per weight at every model build. The draw is made as `fork()` makes it (from the
    tracker's state, which then advances, the process generator restored after), by
    `torch.random.fork_rng` instead: the same numbers, the same states after, no false warning;
    the tracker's own `fork()`, and its check, are left as they are for everything else.
    """

    random = importlib.import_module("megatron.core.tensor_parallel.random")

    @functools.wraps(layers._initialize_affine_weight_gpu)
    def initialize(weight, init_method, partition_dim, stride=1, is_expert=False):
        layers.set_tensor_model_parallel_attributes(
            tensor=weight, is_parallel=True, dim=partition_dim, stride=stride
        )
        tracker = random.get_cuda_rng_tracker()
        name = (
            random.get_expert_parallel_rng_tracker_name()
            if is_expert
            else random._MODEL_PARALLEL_RNG_TRACKER_NAME
        )
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(tracker.states_[name])
            init_method(weight)
            tracker.states_[name] = torch.get_rng_state()

    return initialize


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


def apply_megatron_fixes() -> None:
    """Fix megatron-core bugs that affect every run without Apex/TE (CPU or GPU)."""
    global _fixes_applied
    if _fixes_applied:
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

    dopt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    if not dopt.HAVE_APEX_OR_TE:
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
    _fixes_applied = True
