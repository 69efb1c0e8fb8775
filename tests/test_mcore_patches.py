"""megatron-core's changes (megatron_mlmclm/mcore_patches/): one test per row of the registry
fails when the installed megatron-core (or torch) no longer matches what the row's replacement
was written against; the registry holds every change that importing the package and a CPU run's
step and save make to megatron-core (tests/scripts/mcore_changes.py watches every megatron
module), and a change made outside mcore_patches/ is seen; the pins can fail; and a run refuses a
changed pin at its start (exit 2, one line) unless the override names the installed version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import subprocess
import sys

import pytest
from jobs import REPO, job_env

from megatron_mlmclm.cli import main
from megatron_mlmclm.mcore_patches import apply, registry
from megatron_mlmclm.mcore_patches.registry import (
    MEGATRON_CORE,
    REPLACEMENTS,
    Pin,
    pin_holds,
    source_of,
)

SCRIPTS = REPO / "tests" / "scripts"


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


@pytest.fixture(scope="module")
def changes(tmp_path_factory) -> dict:
    """What importing the whole package and a CPU run's step and save change in megatron-core
    and torch, in a fresh process (tests/scripts/mcore_changes.py)."""
    out = tmp_path_factory.mktemp("changes")
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPTS / "mcore_changes.py"), str(out)],
        env=job_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def listed(cuda: bool) -> set[str]:
    """The registry's rows replaced at run time in a process of this machine."""
    return {
        r.target
        for r in REPLACEMENTS
        if r.kind == "patch"
        and " " not in r.target  # attributes of an optimizer instance, set by the run
        and r.target != "megatron.core.jit:jit_fuser"  # at import (test_megatron_jit.py)
        and not (cuda and r.when.startswith("no CUDA"))
        # set where the optimizer is built (use_torch_adamw), with TE or Apex only
        and not r.when.startswith("Transformer Engine or Apex installed")
    }


def test_the_registry_lists_every_change_a_run_makes_to_megatron_core(changes):
    changed, expected = set(changes["changed"]), listed(changes["cuda"])
    assert changed == expected, (
        f"changed but not in the registry: {sorted(changed - expected)}; "
        f"in the registry but not changed: {sorted(expected - changed)}"
    )


def test_a_change_made_outside_mcore_patches_is_seen(changes):
    """The script set a module attribute and a class member of megatron-core itself after the
    run: both are reported, and would fail the test above."""
    assert set(changes["planted"]) - set(changes["changed"]) == {
        "megatron.core.utils:get_attr_wrapped_model",
        "megatron.core.transformer.transformer_layer:TransformerLayer.sharded_state_dict",
    }


# --------------------------------------------------------------------------------------------------
# At start-up: every process that applies the patches checks the pins first


REGISTER = (
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.register_grad_ready"
)


def with_a_changed_pin(monkeypatch, tmp_path, source: str = REGISTER):
    """The registry as it would read after megatron-core changed `source` (its pins no longer the
    installed source's hash), cut to the rows pinning it and one row that still holds (the check
    then parses a few files, not forty); an empty cache folder; the check not yet run. -> the
    targets of the rows that rely on `source`."""
    rows = [r for r in REPLACEMENTS if any(p.source == source for p in r.pins)]
    holds = next(r for r in REPLACEMENTS if r.target.endswith(":_initialize_affine_weight_gpu"))
    changed = [
        dataclasses.replace(
            r,
            pins=tuple(
                Pin(p.source, "sha256:0123456789abcdef") if p.source == source else p
                for p in r.pins
            ),
        )
        for r in rows
    ]
    monkeypatch.setattr(registry, "REPLACEMENTS", (holds, *changed))
    monkeypatch.setattr(apply, "_applied", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(registry.ALLOW_ENV, raising=False)
    return [r.target for r in rows]


def test_a_changed_pin_refuses_the_run_at_start_and_the_override_runs_it(
    tmp_path, monkeypatch, capsys
):
    """megatron-core's register_grad_ready changed: the one line names that function, the
    package and version it is in, and every target of ours that relies on it; the override
    names the installed megatron-core and torch, and no other pair counts."""
    targets = with_a_changed_pin(monkeypatch, tmp_path)
    assert len(targets) >= 2  # our buffer's hook and its reset both rely on it
    config = tmp_path / "run.yaml"
    config.write_text("data: {mock: true}\nmodel: {vocab_size: 300}\n")
    out = tmp_path / "run"
    assert main(["pretrain", str(config), f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    installed = importlib.metadata.version("megatron-core")
    torch_version = importlib.metadata.version("torch")
    assert err.count("\n") == 0, err
    assert f"megatron-core {installed}'s {REGISTER} (relied on by {', '.join(targets)})" in err
    assert "install megatron-core==0.16.1 (as pyproject.toml pins it)" in err, err
    pair = f"megatron-core=={installed},torch=={torch_version}"
    assert f"set MLMCLM_ALLOW_MEGATRON_CORE={pair} (the installed pair it accepts)" in err, err
    assert ":_initialize_affine_weight_gpu" not in err  # its pin holds
    assert not out.exists()  # refused before the run's folder, lock or log
    # The override names the installed pair: a version alone, or another torch, does not count.
    for other in (installed, f"megatron-core=={installed},torch=0.0"):
        monkeypatch.setenv(registry.ALLOW_ENV, other)
        with pytest.raises(registry.SourceChanged):
            registry.verify_installed()
    monkeypatch.setenv(registry.ALLOW_ENV, pair)
    registry.verify_installed()
    warning = capsys.readouterr().err
    assert warning.startswith("warning: ") and REGISTER in warning, warning


def test_a_changed_torch_pin_names_torch(tmp_path, monkeypatch):
    """A row of torch whose pin no longer holds: the refusal says torch's source changed, not
    megatron-core's."""
    with_a_changed_pin(monkeypatch, tmp_path)
    row = next(r for r in REPLACEMENTS if r.target == "torch:Tensor.type")
    gone = dataclasses.replace(row, pins=(Pin("torch:Tensor.no_such_method", "exists"),))
    monkeypatch.setattr(registry, "REPLACEMENTS", (gone,))
    with pytest.raises(registry.SourceChanged) as refused:
        registry.verify_installed()
    torch_version = importlib.metadata.version("torch")
    said = str(refused.value)
    assert (
        f"torch {torch_version}'s torch:Tensor.no_such_method (relied on by torch:Tensor.type)"
        in said
    )


def test_the_pins_are_computed_once_per_install(tmp_path, monkeypatch):
    """A check whose pins held leaves a marker keyed by the pins and the pinned files' sizes and
    modification times: the next process reads no source. A changed pin is another key."""
    targets = with_a_changed_pin(monkeypatch, tmp_path)
    assert registry.changed_targets() == targets
    assert not (tmp_path / "cache").exists()  # a check that failed is remembered by nobody
    holding = registry.REPLACEMENTS[:1]
    monkeypatch.setattr(registry, "REPLACEMENTS", holding)
    assert registry.changed_targets() == []
    assert len(list((tmp_path / "cache" / "mlmclm" / "mcore-pins").iterdir())) == 1
    monkeypatch.setattr(registry, "source_of", lambda source: pytest.fail("read " + source))
    assert registry.changed_targets() == []  # from the marker
    pin = Pin(holding[0].pins[0].source, "sha256:0")
    other = dataclasses.replace(holding[0], target="t", pins=(pin,))
    monkeypatch.setattr(registry, "REPLACEMENTS", (*holding, other))
    with pytest.raises(pytest.fail.Exception):  # another pin: computed again
        registry.changed_targets()
