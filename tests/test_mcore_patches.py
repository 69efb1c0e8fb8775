"""megatron-core's changes (megatron_mlmclm/mcore_patches/): one test per row of the registry
fails when the installed megatron-core (or torch) no longer matches what the row's replacement
was written against; the registry holds every replacement the patches make (found by comparing
megatron-core's modules and classes before and after they are applied); and the pins can fail.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
import sys

import pytest
from jobs import job_env

from megatron_mlmclm.mcore_patches.registry import (
    MEGATRON_CORE,
    REPLACEMENTS,
    Pin,
    pin_holds,
    source_of,
)


@pytest.mark.parametrize("row", REPLACEMENTS, ids=[r.target for r in REPLACEMENTS])
def test_the_replaced_thing_is_what_the_replacement_was_written_against(row):
    changed = []
    for pin in row.pins:
        holds, found = pin_holds(pin)
        if not holds:
            changed.append(f"{pin.source}: pinned {pin.check}, installed {found}")
    assert not changed, (
        f"{row.target} ({row.kind}, by {row.by}) was checked against {row.checked}, and "
        f"megatron-core changed it since: {'; '.join(changed)}. Read the new source, check "
        f"that the replacement still does what its row says ({row.why}), then update the row."
    )


def test_the_rows_were_checked_against_the_installed_megatron_core():
    installed = importlib.metadata.version("megatron-core")
    assert MEGATRON_CORE == f"megatron-core {installed}"
    assert all(r.checked.startswith(MEGATRON_CORE) for r in REPLACEMENTS)
    for r in REPLACEMENTS:
        assert r.kind in ("patch", "override") and r.by and r.when and r.why and r.pins, r


def test_a_pin_fails_when_its_source_changes():
    """What the pins are computed from, read by hand from megatron-core 0.16.1, and a pin that
    does not match (a changed hash, a line no longer there, a name gone) fails."""
    assert source_of("megatron.core.jit:jit_fuser") == "jit_fuser = torch.jit.script"
    source = "megatron.core.optimizer.optimizer:_multi_tensor_copy_this_to_that"
    text = source_of(source)
    assert text.startswith("def _multi_tensor_copy_this_to_that(") and "copy_" in text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    assert pin_holds(Pin(source, f"sha256:{digest}")) == (True, f"sha256:{digest}")
    assert not pin_holds(Pin(source, "sha256:0000000000000000"))[0]
    assert not pin_holds(Pin(source, "contains:a line megatron never wrote"))[0]
    assert not pin_holds(Pin("megatron.core.optimizer.optimizer:no_such_function", "exists"))[0]
    assert not pin_holds(Pin("megatron.core.optimizer.optimizer:no_such_function", "sha256:0"))[0]


# In a fresh process: every module-level function, attribute and class member of megatron-core
# (and of torch.cuda / torch.Tensor) before and after apply_patches(), compared by identity.
CHANGED = """
import importlib, json, sys
import torch
from megatron_mlmclm.mcore_patches.registry import REPLACEMENTS
from megatron_mlmclm.mcore_patches.apply import apply_patches

for r in REPLACEMENTS:
    if " " not in r.target:  # not an attribute of an optimizer built by the run
        importlib.import_module(r.target.split(":")[0])


def members():
    # name -> (object, is a class member): a class member set anew counts as replaced, a new
    # module attribute does not (importing a submodule adds one).
    out = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (
            name.startswith("megatron.core") or name in ("torch", "torch.cuda", "torch.cuda.random")
        ):
            continue
        for key, value in list(vars(module).items()):
            out[f"{name}:{key}"] = (value, False)
            if isinstance(value, type) and value.__module__ == name:
                for attr, member in list(vars(value).items()):
                    out[f"{name}:{key}.{attr}"] = (member, True)
    return out


before = members()
apply_patches()
after = members()
changed = [
    k
    for k, (value, member) in after.items()
    if (k in before and before[k][0] is not value) or (k not in before and member)
]
print(json.dumps(sorted(changed)))
print(json.dumps(torch.cuda.is_available()))
"""


def test_the_registry_lists_every_replacement_the_patches_make():
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", CHANGED],
        env=job_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    changed_line, cuda_line = proc.stdout.strip().splitlines()[-2:]
    changed, cuda = set(json.loads(changed_line)), json.loads(cuda_line)
    listed = {
        r.target
        for r in REPLACEMENTS
        if r.kind == "patch"
        and " " not in r.target  # attributes of an optimizer instance, set by the run
        and r.target != "megatron.core.jit:jit_fuser"  # at import (test_megatron_jit.py)
        and not (cuda and r.when.startswith("no CUDA"))
        # set where the optimizer is built (use_torch_adamw), with TE or Apex only
        and not r.when.startswith("Transformer Engine or Apex installed")
    }
    assert changed == listed, (
        f"replaced but not in the registry: {sorted(changed - listed)}; "
        f"in the registry but not replaced: {sorted(listed - changed)}"
    )
