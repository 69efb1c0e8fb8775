"""What of megatron-core (and torch) this project changes: `python mcore_changes.py OUT`, read by
tests/test_mcore_patches.py. In a fresh process: every megatron.* module is watched from the
moment its own code has run, then the whole package is imported and a CPU run trains a step and
saves it; the script prints, as JSON, the changes made from outside megatron-core:

- a module attribute of megatron-core set from outside megatron-core's own files (the module's
  class becomes a subclass whose __setattr__ notes who set what; a module's own `global`
  statements write its dict directly and are megatron's state, not a change of ours);
- a class member of megatron-core (or torch's Tensor) that is not, after the step, the object it
  was when its module was imported;
- torch / torch.cuda / torch.cuda.random attributes that are not what they were at the start.

`changed` lists those; `planted` lists them again after this script sets one module attribute and
one class member of megatron-core itself (which the test requires to be seen); `cuda` is whether
CUDA was present (the CPU patches apply only without it).
"""

import importlib
import importlib.abc
import json
import pkgutil
import sys
import types
from pathlib import Path

from megatron_mlmclm.mcore_patches.jit import then_run  # imports neither torch nor megatron

MEGATRON = "megatron."
REPO = Path(__file__).resolve().parents[2]
BUILTIN = (types.WrapperDescriptorType, types.BuiltinFunctionType, types.MethodDescriptorType)
SETS: dict[str, str] = {}  # "module:name" -> where it was set from
CLASSES: dict[str, dict] = {}  # "module:Class" -> the class's members when its module was run


class _Watched(types.ModuleType):
    def __setattr__(self, name, value):
        submodule = (
            isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}"
        )
        caller = sys._getframe(1).f_code.co_filename
        if not submodule and f"{Path('megatron', 'core')}" not in caller:
            SETS[f"{self.__name__}:{name}"] = caller
        super().__setattr__(name, value)


def watch(module) -> None:
    if type(module) is not types.ModuleType or not module.__name__.startswith(MEGATRON):
        return
    for key, value in list(vars(module).items()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            CLASSES[f"{module.__name__}:{key}"] = dict(vars(value))
    module.__class__ = _Watched


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds a megatron.* module with the finders after it, and watches it once it has run."""

    def find_spec(self, name, path, target=None):
        if not name.startswith(MEGATRON):
            return None
        for module in list(sys.modules.values()):  # run before: megatron.core.jit (jit.py's hook)
            spec = getattr(module, "__spec__", None)
            if spec is not None and not getattr(spec, "_initializing", False):
                watch(module)
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :]:
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        then_run(spec, watch)
        return spec


def changes(torch_before: dict) -> list[str]:
    out = set(SETS)
    for key, members in CLASSES.items():
        module, _, name = key.partition(":")
        cls = getattr(sys.modules[module], name)
        for attr, member in vars(cls).items():
            if members.get(attr, object()) is not member and ours(attr, member):
                out.add(f"{key}.{attr}")
    for key, value in torch_members().items():
        if key in torch_before and torch_before[key] is not value and ours(key, value):
            out.add(key)
    return sorted(out)


def ours(name: str, value) -> bool:
    """Whether a class member (or torch attribute) set anew is this project's (or anyone's but
    Python's and torch's own: typing gives a Protocol's subclass its __init__ at the first
    instance, pickling caches a class's __slotnames__, torch._dynamo wraps torch.manual_seed)."""
    code = getattr(value, "__code__", None) or getattr(
        getattr(value, "__func__", None), "__code__", None
    )
    if code is None:  # C functions (typing's object.__init__) are nobody's replacement
        return not name.endswith("__slotnames__") and not isinstance(value, BUILTIN)
    # the package and this script (not a virtualenv that may sit inside the checkout, as .venv does)
    where = Path(code.co_filename).resolve()
    return any(where.is_relative_to(REPO / part) for part in ("megatron_mlmclm", "tests"))


def torch_members() -> dict:
    import torch

    out = {}
    for name in ("torch", "torch.cuda", "torch.cuda.random"):
        for key, value in list(vars(sys.modules[name]).items()):
            out[f"{name}:{key}"] = value
    for attr in dir(torch.Tensor):  # with what it inherits from torch._C.TensorBase
        if attr != "__dict__":  # a new mapping proxy at each read
            out[f"torch:Tensor.{attr}"] = getattr(torch.Tensor, attr)
    return out


def train_a_step(out: Path) -> None:
    import yaml

    from megatron_mlmclm.cli import main

    config = out / "run.yaml"
    config.write_text(yaml.safe_dump({"data": {"mock": True}, "model": {"vocab_size": 300}}))
    argv = ["pretrain", str(config), f"output_dir={out / 'run'}", "train.steps=1"]
    argv += ["train.global_batch_size=2", "train.micro_batch_size=2", "logging.tensorboard=false"]
    argv += ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2"]
    argv += ["model.ffn_hidden_size=64", "model.seq_length=32", "train.warmup_steps=0"]
    argv += ["train.decay_steps=0"]
    if main(argv) != 0:
        raise SystemExit("the run failed")


if __name__ == "__main__":
    out = Path(sys.argv[1])
    sys.meta_path.insert(0, _Watcher())
    import torch

    before = torch_members()
    import megatron_mlmclm
    import megatron_mlmclm.cli  # the entry point first, as `mlmclm` (it defers megatron's jit)

    for info in pkgutil.walk_packages(megatron_mlmclm.__path__, "megatron_mlmclm."):
        importlib.import_module(info.name)
    train_a_step(out)
    changed = changes(before)
    # One change of each kind made here, outside mcore_patches/: both must be seen.
    from megatron.core import utils
    from megatron.core.transformer.transformer_layer import TransformerLayer

    utils.get_attr_wrapped_model = lambda *a, **k: None
    TransformerLayer.sharded_state_dict = lambda *a, **k: {}
    report = {"changed": changed, "planted": changes(before), "cuda": torch.cuda.is_available()}
    print(json.dumps(report))
