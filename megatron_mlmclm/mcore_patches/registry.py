"""Every megatron-core (and torch) function, method and attribute this project replaces or
overrides, with why, the version it was checked against, and what pins it.

A row names the thing replaced (`target`), our code that replaces it (`by`), when that applies
(`when`) and why. Its pins say what of megatron-core the replacement was written against: a hash
of the source of each definition it replaces or re-implements, in the version it was checked
against (`checked`). `tests/test_mcore_patches.py` recomputes every pin from the installed
packages: when megatron-core changes one of them, the test of that row fails, naming it, before
any run trains with a replacement that no longer fits. Updating a row is reading the new source,
checking the replacement still does what `why` says, and then writing the new hash and version.

Two kinds of rows:
- `patch`: the attribute is replaced at run time, by code in this package (jit.py, cpu.py,
  optimizer.py). `missing_targets()` checks before patching that every one still exists.
- `override`: a megatron-core method that a subclass of ours overrides, or whose work our code
  does in its place, or a private name our code calls; the code is where it runs (`by`). A
  change of the method would not raise, it would leave ours out of step.

Pins of torch (whose CPU wheels and GPU images differ) check what the replacement relies on
(`contains:` a line of its source, or `exists`), not a hash.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path

MEGATRON_CORE = "megatron-core 0.16.1"
WITH_TORCH = MEGATRON_CORE + ", torch 2.13"


@dataclass(frozen=True)
class Pin:
    """`source`: "module:qualname" (the definitions binding that name, every one of them: a
    function, a class, an assignment or an import) or "module" (the whole file). `check`:
    "sha256:<first 16 hex digits>" of that source, "contains:<text>", "exists" or
    "parameter:<name>" (the callable takes that parameter)."""

    source: str
    check: str


@dataclass(frozen=True)
class Replacement:
    target: str  # "module:qualname" of what is replaced
    kind: str  # "patch" | "override"
    by: str  # our code
    when: str
    why: str
    pins: tuple[Pin, ...]
    checked: str = MEGATRON_CORE


def sha(source: str, digest: str) -> Pin:
    return Pin(source, "sha256:" + digest)


_DP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
_BUCKETS = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup"
_OPT = "megatron.core.optimizer.optimizer"
_DOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_GPT = "megatron.core.models.gpt.gpt_model:GPTModel"
_BLOCK_MODULE = "megatron.core.transformer.transformer_block"
_BLOCK = f"{_BLOCK_MODULE}:TransformerBlock"
_ROPE = "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding"
_NO_CUDA = "no CUDA device (apply.py)"
_NO_APEX = "megatron-core fell back: neither Apex nor Transformer Engine imports (apply.py)"

REPLACEMENTS: tuple[Replacement, ...] = (
    # ----------------------------------------------------------------- start-up (jit.py)
    Replacement(
        "megatron.core.jit:jit_fuser",
        "patch",
        "mcore_patches.jit.defer_kernel_compilation",
        "the process asks before importing megatron-core: the mlmclm entry point, the test "
        "session, the scripts that import megatron-core",
        "megatron's ~40 torch.compile'd kernels compile at their first call, not at import: "
        "importing Inductor cost 1.5 s of every process's start",
        (sha("megatron.core.jit", "0de81ea1c3a8fd5b"),),
    ),
    # -------------------------------------------------------------- without CUDA (cpu.py)
    *(
        Replacement(
            f"torch.cuda:{name}",
            "patch",
            "mcore_patches.cpu.apply_without_cuda",
            _NO_CUDA,
            why,
            (Pin(f"torch.cuda:{name}", "exists"),),
            WITH_TORCH,
        )
        for name, why in (
            ("current_device", "megatron asks for the current CUDA device: the CPU"),
            ("synchronize", "megatron's timers and checkpoint writer wait for CUDA: no-op"),
            ("get_rng_state", "megatron saves the CUDA RNG state: the CPU generator's"),
            ("set_rng_state", "megatron restores the CUDA RNG state: the CPU generator's"),
            ("manual_seed", "megatron seeds the CUDA RNG: the CPU generator"),
        )
    ),
    Replacement(
        "torch.cuda.random:get_rng_state",
        "patch",
        "mcore_patches.cpu.apply_without_cuda",
        _NO_CUDA,
        "megatron's RNG tracker imports it from torch.cuda.random: the CPU generator's state",
        (Pin("torch.cuda.random:get_rng_state", "exists"),),
        WITH_TORCH,
    ),
    Replacement(
        "torch:Tensor.cuda",
        "patch",
        "mcore_patches.cpu.apply_without_cuda",
        _NO_CUDA,
        "megatron moves tensors with .cuda(): a CPU tensor stays where it is",
        (Pin("torch:Tensor.cuda", "exists"),),
        WITH_TORCH,
    ),
    Replacement(
        "torch:Tensor.type",
        "patch",
        "mcore_patches.cpu.apply_without_cuda",
        _NO_CUDA,
        "megatron's optimizers accept only 'torch.cuda.*Tensor' types: a CPU tensor answers so",
        (Pin("torch:Tensor.type", "exists"),),
        WITH_TORCH,
    ),
    Replacement(
        "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
        "patch",
        "mcore_patches.cpu.apply_without_cuda",
        _NO_CUDA,
        "the RNG tracker's CUDA state is the CPU generator's",
        (sha("megatron.core.tensor_parallel.random:_get_cuda_rng_state", "0c2b8f05b864739e"),),
    ),
    Replacement(
        "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
        "patch",
        "mcore_patches.cpu.apply_without_cuda",
        _NO_CUDA,
        "the RNG tracker's CUDA state is the CPU generator's",
        (sha("megatron.core.tensor_parallel.random:_set_cuda_rng_state", "dea947ca0b7dc92b"),),
    ),
    Replacement(
        "megatron.core.tensor_parallel.layers:_initialize_affine_weight_gpu",
        "patch",
        "mcore_patches.cpu._initialize_affine_weight_on_cpu",
        _NO_CUDA,
        "the same draws from the tracker's state, without the tracker's false 'CPU RNG state "
        "changed' warning once per weight (see the function)",
        (
            sha(
                "megatron.core.tensor_parallel.layers:_initialize_affine_weight_gpu",
                "bb9ae540382ad9e8",
            ),
        ),
    ),
    *(
        Replacement(
            f"{module}:torch",
            "patch",
            "mcore_patches.cpu._CpuTorch",
            _NO_CUDA,
            "the module creates tensors with a literal device='cuda': its `torch` maps that "
            "device to the CPU (the whole module is pinned: the literals can be anywhere)",
            (sha(module, digest),),
        )
        for module, digest in (
            ("megatron.core.pipeline_parallel.schedules", "e2bdb6f18cdd9201"),
            ("megatron.core.transformer.utils", "045881e40ba9df2d"),
            ("megatron.core.optimizer.optimizer", "32e7cfd874c72b00"),
            ("megatron.core.optimizer.clip_grads", "4a68e9aae8cb1188"),
            ("megatron.core.utils", "1d4e52091aa975ce"),
            ("megatron.core.distributed.param_and_grad_buffer", "e10c283edfcab3a6"),
            ("megatron.core.dist_checkpointing.strategies.state_dict_saver", "3b35f1e9cc1dd3a4"),
            ("megatron.core.dist_checkpointing.exchange_utils", "3e5c7999a67fcaa4"),
        )
    ),
    # ------------------------------------------------------- every run (optimizer.py)
    *(
        Replacement(
            f"{module}:multi_tensor_scale_impl",
            "patch",
            "mcore_patches.optimizer._inplace_multi_tensor_scale",
            "megatron-core fell back to its local_multi_tensor_scale (no Apex or TE)",
            "gradient clipping scaled every gradient out of place (dst.copy_(src * scale), a "
            "copy of all gradients a step): one in-place foreach multiply, the same values",
            (
                sha(f"{module}:multi_tensor_scale_impl", digest),
                sha("megatron.core.utils:local_multi_tensor_scale", "c68dc586744c53ee"),
            ),
        )
        for module, digest in (
            ("megatron.core.optimizer.clip_grads", "47414bc64407a7f6"),
            (_OPT, "6d74a0e762adfa57"),
        )
    ),
    Replacement(
        f"{_OPT}:_multi_tensor_copy_this_to_that",
        "patch",
        "mcore_patches.optimizer._foreach_copy_this_to_that",
        "every run (megatron's own is kept where it passes an overflow buffer: Apex)",
        "without Apex megatron copies the fp32 main parameters into the bf16 model ones one "
        "parameter at a time (a launch each, every step): one foreach copy, the same values",
        (sha(f"{_OPT}:_multi_tensor_copy_this_to_that", "1c15b8061ac05aaa"),),
    ),
    Replacement(
        f"{_DOPT}.load_state_dict",
        "patch",
        "mcore_patches.optimizer.apply_everywhere (load_state_dict)",
        _NO_APEX,
        "loading gave every parameter the same Adam `step` tensor, which torch's AdamW then "
        "advanced once per parameter: wrong bias correction after a resume. Each parameter "
        "gets its own copy",
        (
            sha("megatron.core.optimizer.distrib_optimizer:HAVE_APEX_OR_TE", "5c396ed5f00bdbb6"),
            sha(f"{_DOPT}.load_state_dict", "393f78388da771d3"),
        ),
    ),
    Replacement(
        f"{_DOPT}.sharded_state_dict",
        "patch",
        "mcore_patches.optimizer.apply_everywhere (sharded_state_dict)",
        _NO_APEX,
        "loading into a fresh optimizer asserted that the still empty Adam state has one "
        "`step`: the state is created first by a zero step at lr = wd = 0",
        (
            sha(f"{_DOPT}.sharded_state_dict", "39ea1893053ab5d2"),
            sha(f"{_DOPT}._init_optimizer_states_with_dummy_values", "c1aa69839875b470"),
        ),
    ),
    Replacement(
        f"{_DOPT}._set_main_param_and_optimizer_states",
        "patch",
        "mcore_patches.optimizer.apply_everywhere (set_states)",
        _NO_APEX,
        "the fully_reshardable load copied `step` from each parameter's saved state, which "
        "carries it only in the param groups (KeyError): `step` is left out of the copy",
        (sha(f"{_DOPT}._set_main_param_and_optimizer_states", "0fb8c1343b9d7584"),),
    ),
    Replacement(
        "torch.optim.AdamW (built by megatron-core): param_groups' fused / foreach",
        "patch",
        "mcore_patches.optimizer.use_fused_adamw (training/optimizer.py)",
        "the kernel plan's fused_adamw: after the optimizer is built and after every load",
        "megatron builds torch's AdamW without `fused` (its fallback without TE or Apex): one "
        "kernel per tensor group instead of a loop, the same state and checkpoints",
        (
            sha(
                "megatron.core.optimizer:_get_megatron_optimizer_based_on_param_groups",
                "176a5068cd92e4d5",
            ),
            Pin("torch.optim.adamw:AdamW", "parameter:fused"),
        ),
        WITH_TORCH,
    ),
    Replacement(
        "torch.optim.AdamW (built by megatron-core): found_inf",
        "patch",
        "mcore_patches.optimizer.skip_step_where (training/update.py)",
        "each queued update (the kernel plan's queued_update), removed after it",
        "the skip of a non-finite step decided on the device: torch's fused AdamW skips its "
        "update where found_inf is set, as under a grad scaler; megatron's step_with_ready_grads "
        "runs torch's step and copies the (unchanged) main parameters back",
        (
            Pin(
                "torch.optim.adam:Adam.step", 'contains:found_inf=getattr(self, "found_inf", None)'
            ),
            sha(f"{_OPT}:MixedPrecisionOptimizer.step_with_ready_grads", "dbc34bb4698caf74"),
            sha(f"{_OPT}:FP32Optimizer.step_with_ready_grads", "3a19eb8cc729dc04"),
            sha(f"{_OPT}:ChainedOptimizer.step_with_ready_grads", "ce6ea078ff7cc941"),
            sha(f"{_DOPT}.step_with_ready_grads", "b8a48d4f60acb666"),
        ),
        WITH_TORCH,
    ),
    Replacement(
        f"{_OPT}:Float16OptimizerWithFloat16Params._get_model_and_main_params_data_float16",
        "override",
        "mcore_patches.optimizer.model_and_main_params (checkpoint.py)",
        "train.init_from: after loading weights into a built optimizer",
        "a private method, called to check that every fp32 main copy took the loaded weights",
        (
            sha(
                f"{_OPT}:Float16OptimizerWithFloat16Params._get_model_and_main_params_data_float16",
                "95389406b3324d83",
            ),
            sha(f"{_DOPT}._get_model_and_main_params_data_float16", "46e8968a4a048ed0"),
        ),
    ),
    # ------------------------------------------- overridden by our subclasses, or run by us
    Replacement(
        f"{_GPT}.__init__",
        "override",
        "model.build.EncoderLM.__init__",
        "every model",
        "GPTModel builds megatron's TransformerBlock itself: EncoderLM hands it a block spec "
        "with no layers and builds the block class its own spec names in that place (and calls "
        "finish_init on its modules, as GPTModel's __init__ ends)",
        (
            sha(f"{_GPT}.__init__", "544209c33f031dec"),
            sha(f"{_BLOCK}.__init__", "2b66e3bd251bc0ed"),
            sha(f"{_BLOCK_MODULE}:_get_block_submodules", "a3739b656fdf10d8"),
        ),
    ),
    Replacement(
        f"{_GPT}._preprocess",
        "override",
        "model.build.EncoderLM._preprocess",
        "every model (acts on varlen batches)",
        "a private method: per-token RoPE rows where one row holds many sequences",
        (sha(f"{_GPT}._preprocess", "c107f8e8f17cb56f"),),
    ),
    Replacement(
        f"{_GPT}._postprocess",
        "override",
        "model.build.EncoderLM._postprocess",
        "every model with labels",
        "a private method: logits and loss only at the labelled positions",
        (sha(f"{_GPT}._postprocess", "bf6e15ce83d26d5f"),),
    ),
    Replacement(
        "megatron.core.transformer.transformer_block:TransformerBlock.forward",
        "override",
        "model.layers.PlainTransformerBlock.forward",
        "the kernel plan's plain_stack",
        "the layer stack as one function (or a few chunks); megatron's forward elsewhere",
        (
            sha(
                "megatron.core.transformer.transformer_block:TransformerBlock.forward",
                "7fced05fdc6d30a4",
            ),
        ),
    ),
    Replacement(
        "megatron.core.transformer.transformer_layer:TransformerLayer.forward",
        "override",
        "model.layers.PlainTransformerLayer.forward",
        "the kernel plan's plain_layers",
        "the layer's forward in plain torch, bit for bit megatron's (tests/test_layers.py)",
        (
            sha(
                "megatron.core.transformer.transformer_layer:TransformerLayer.forward",
                "14cb4790e7b3f20e",
            ),
            sha(
                "megatron.core.transformer.transformer_layer:TransformerLayer._forward_attention",
                "8d34a6cb3a93d5c0",
            ),
            sha(
                "megatron.core.transformer.transformer_layer:TransformerLayer._forward_mlp",
                "f8ce9e596c8bf45f",
            ),
        ),
    ),
    Replacement(
        "megatron.core.transformer.attention:Attention.attn_mask_type",
        "override",
        "model.packed.set_attention_mask_type (training/phase_entry.py)",
        "packed THD batches, at each phase change",
        "the mask kind (causal or none) is set on the built attention modules, which read it "
        "at every forward",
        (sha("megatron.core.transformer.attention:Attention.forward", "f4d3e149657c1673"),),
    ),
    Replacement(
        f"{_DP}._make_backward_post_hook",
        "override",
        "training.data_parallel.DataParallel",
        "always (its batched accumulation with the kernel plan's batched_grad_accumulation)",
        "a private method: the hook keeps a chunk's gradients and moves them into main_grad "
        "together, registering them with megatron's bucket groups as megatron's hook does",
        (
            sha(f"{_DP}._make_backward_post_hook", "c2b021b1e8181f4a"),
            sha(f"{_BUCKETS}.register_grad_ready", "d5cedcfeae001757"),
        ),
    ),
    Replacement(
        f"{_DP}.zero_grad_buffer",
        "override",
        "training.data_parallel.DataParallel.zero_grad_buffer",
        "batched_grad_accumulation without Apex's fused accumulation",
        "megatron's reset of the step, without zeroing the buffers (a step's first gradient is "
        "copied, not added)",
        (
            sha(f"{_DP}.zero_grad_buffer", "0ec9feb00280ea06"),
            sha(f"{_BUCKETS}.reset", "e05b8dc435b5467e"),
        ),
    ),
    Replacement(
        f"{_DP}.start_grad_sync",
        "override",
        "training.data_parallel.DataParallel.start_grad_sync / finish_grad_sync",
        "always",
        "no reduction over a data-parallel group of one rank; a bucket whose parameter got no "
        "gradient is started at the end; stale main_grads of unzeroed buffers zeroed",
        (
            sha(f"{_DP}.start_grad_sync", "bfd5177f21407e54"),
            sha(f"{_DP}.finish_grad_sync", "352240a0e8c6d954"),
        ),
    ),
    Replacement(
        "megatron.core.distributed.finalize_model_grads:finalize_model_grads",
        "override",
        "training.data_parallel.scale_by_tokens",
        "always (megatron's finalize runs without the token count)",
        "the per-token gradient scaling without its host read of the count and as one foreach "
        "multiply",
        (
            sha(
                "megatron.core.distributed.finalize_model_grads:finalize_model_grads",
                "6e707bbdff75d596",
            ),
        ),
    ),
    Replacement(
        f"{_OPT}:ChainedOptimizer.step",
        "override",
        "training.update.Update (figures, the queued and host-first updates)",
        "every step",
        "the step's parts run by us: prepare_grads, the gradient norm by foreach norms on the "
        "device (megatron's fallback reads one value per parameter), the clip, "
        "step_with_ready_grads",
        (
            sha(f"{_OPT}:ChainedOptimizer.step", "564cf7bc15fedef1"),
            sha(f"{_OPT}:MixedPrecisionOptimizer.step", "2ab68c25d1abafc1"),
            sha(f"{_OPT}:FP32Optimizer.step", "732c136969b24fb2"),
            sha(f"{_OPT}:MegatronOptimizer.get_grad_norm", "1d617d2db25898cd"),
        ),
    ),
    Replacement(
        f"{_ROPE}.inv_freq",
        "override",
        "model.build.set_rotary_base, apply_rope_scaling",
        "a phase's rotary_base; model.rope_scaling",
        "the frequencies are rebuilt on the built module, with its private _apply_scaling, and "
        "its forward's cache cleared",
        (
            sha(f"{_ROPE}._apply_scaling", "2a8ebc51d3ee7909"),
            sha(f"{_ROPE}.forward", "c9271dae214538ae"),
        ),
    ),
)


# ------------------------------------------------------------------------ the pins, computed
def _source_file(module: str) -> Path:
    """The file of `module`, found without importing it (nor its package's __init__)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(module)
    for base in spec.submodule_search_locations:
        path = Path(base, *rest)
        if path.with_suffix(".py").is_file():
            return path.with_suffix(".py")
        if (path / "__init__.py").is_file():
            return path / "__init__.py"
    raise ModuleNotFoundError(module)


def _bindings(body: list[ast.stmt], name: str) -> list[ast.stmt]:
    """The statements of `body` that bind `name`: a definition, an assignment or an import, or
    an if / try / with block holding one (the whole block: the condition is part of it)."""
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                found.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.append(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                found.append(node)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [getattr(node, b, []) for b in ("body", "orelse", "finalbody")]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            if any(_bindings(block, name) for block in blocks):
                found.append(node)
    return found


def source_of(source: str) -> str:
    """The text a pin's `source` names (see Pin)."""
    module, _, qualname = source.partition(":")
    text = _source_file(module).read_text()
    if not qualname:
        return text
    body: list[ast.stmt] = ast.parse(text).body
    *classes, name = qualname.split(".")
    for cls in classes:
        found = [n for n in _bindings(body, cls) if isinstance(n, ast.ClassDef)]
        if not found:
            raise AttributeError(f"{module} has no class {cls}")
        body = found[0].body
    nodes = _bindings(body, name)
    if not nodes:
        raise AttributeError(f"{module} has no {qualname}")
    return "\n".join(ast.get_source_segment(text, n) or "" for n in nodes)


def resolve(target: str):
    """The object at "module:qualname" (imports the module)."""
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def pin_holds(pin: Pin) -> tuple[bool, str]:
    """(does the installed package still match the pin, what it found)."""
    kind, _, expected = pin.check.partition(":")
    if kind in ("exists", "parameter"):
        try:
            obj = resolve(pin.source)
        except (ImportError, AttributeError) as e:
            return False, f"missing ({e})"
        if kind == "exists":
            return True, "exists"
        takes = expected in inspect.signature(obj).parameters
        return takes, f"parameter {expected}: {takes}"
    try:
        text = source_of(pin.source)
    except (ModuleNotFoundError, AttributeError) as e:
        return False, f"missing ({e})"
    if kind == "contains":
        return expected in text, f"contains {expected!r}: {expected in text}"
    found = hashlib.sha256(text.encode()).hexdigest()[:16]
    return found == expected, f"sha256:{found}"


def missing_targets() -> list[str]:
    """The patch targets that no longer exist in the installed torch / megatron-core."""
    missing = []
    for r in REPLACEMENTS:
        if r.kind != "patch" or " " in r.target:  # an attribute of an instance: pinned only
            continue
        try:
            resolve(r.target)
        except (ImportError, AttributeError):
            missing.append(r.target)
    return missing
