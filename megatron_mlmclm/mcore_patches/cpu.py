"""megatron-core 0.16 on machines without CUDA (gloo and CPU tensors), with no source edits.

megatron-core has no CPU path: it asks for `torch.cuda.current_device()`, creates tensors with a
literal `device="cuda"`, keeps CUDA RNG states and checks
`tensor.type() == 'torch.cuda.FloatTensor'`. `apply_without_cuda()` redirects those to the CPU;
apply.py calls it only where CUDA is unavailable. Each replacement is a row of registry.yaml.
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

_FACTORIES = frozenset(
    "tensor zeros ones empty full arange rand randn randint empty_like zeros_like ones_like "
    "full_like as_tensor eye linspace".split()
)

_applied = False


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


def apply_without_cuda() -> None:
    """Patch torch and megatron-core for CPU execution (once per process)."""
    global _applied
    if _applied:
        return
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


def _initialize_affine_weight_on_cpu(layers):
    """megatron's weight init "on the GPU", for CPU tensors: the same draws from the same state.

    megatron draws each linear and embedding weight inside its CUDA RNG tracker's `fork()`, which
    warns "CPU RNG state changed within GPU RNG context" when torch's CPU generator moved inside
    it. On a GPU the weight is a CUDA tensor and the draw moves the CUDA generator only: no
    warning. Here the CUDA RNG is the CPU generator (apply_without_cuda maps one onto the other),
    so every one of these draws moved "the CPU RNG" and the check, comparing the generator with
    itself, fired once per weight at every model build. The draw is made as `fork()` makes it
    (from the tracker's state, which then advances, the process generator restored after), by
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
