"""Every megatron-core (and torch) function, method and attribute this project replaces or
overrides: the list is registry.yaml, one row each, read here into `REPLACEMENTS`.

A row names the thing replaced (`target`), our code that replaces it (`by`), when that applies
(`when`) and why. Its pins say what of megatron-core the replacement was written against: a hash
of the source of each definition it replaces or re-implements, in the version it was checked
against (`checked`). `tests/test_mcore_patches.py` recomputes every pin from the installed
packages: when megatron-core changes one of them, the test of that row fails, naming it, before
any run trains with a replacement that no longer fits. Every process that applies the patches
checks the same pins first (`verify_installed`, apply.py): a run on a megatron-core (or torch)
whose pinned source changed is refused, naming each changed source and the targets that rely on
it, unless $MLMCLM_ALLOW_MEGATRON_CORE names the installed pair, `megatron-core==X,torch==Y`
(the user has read the new source). Updating a row is reading the new source, checking the
replacement still does what `why` says, and then writing the new hash and version.

Two kinds of rows:
- `patch`: the attribute is replaced at run time, by code in this package (jit.py, cpu.py,
  optimizer.py; megatron's checkpoint-writer queue by runtime/lifetime.py, which owns the
  process's lifetime rules). `missing_targets()` checks, where an override lets a changed source
  run, that every one, and every pinned definition, still exists.
- `override`: a megatron-core method that a subclass of ours overrides, or whose work our code
  does in its place, or a private name our code calls; the code is where it runs (`by`). A
  change of the method would not raise, it would leave ours out of step.

Pins of torch (whose CPU wheels and GPU images differ) check what the replacement relies on
(`contains:` a line of its source, `parameter:` a parameter it takes, or `exists`), not a hash.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REGISTRY = Path(__file__).with_name("registry.yaml")


@dataclass(frozen=True)
class Pin:
    """`source`: "module:qualname" (the definitions binding that name, every one of them: a
    function, a class, an assignment or an import, or the if / try block holding one) or
    "module" (the whole file). `check`: "sha256:<first 16 hex digits>" of that source,
    "contains:<text>", "exists" or "parameter:<name>" (the callable takes that parameter). In
    registry.yaml a pin is written "<source> <check>"."""

    source: str
    check: str


@dataclass(frozen=True)
class Replacement:
    target: str  # "module:qualname" of what is replaced (or, for an instance, what it is)
    kind: str  # "patch" | "override"
    by: str  # our code
    when: str
    why: str
    pins: tuple[Pin, ...]
    checked: str  # the versions it was checked against


def _load() -> tuple[str, tuple[Replacement, ...]]:
    data = yaml.safe_load(REGISTRY.read_text(encoding="utf-8"))
    rows = tuple(
        Replacement(
            target=row["target"],
            kind=row["kind"],
            by=row["by"],
            when=row["when"],
            why=row["why"],
            pins=tuple(Pin(*pin.split(" ", 1)) for pin in row["pins"]),
            checked=row.get("checked", data["checked"]),
        )
        for row in data["replacements"]
    )
    return data["checked"], rows


MEGATRON_CORE, REPLACEMENTS = _load()
PINNED = MEGATRON_CORE.replace(" ", "==")  # as pip installs it: megatron-core==0.16.1


# ------------------------------------------------------------------------ the pins, computed
@functools.cache
def _package_folders(top: str) -> tuple[str, ...]:
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(top)
    return tuple(spec.submodule_search_locations)


def _source_file(module: str) -> Path:
    """The file of `module`, found without importing it (nor its package's __init__)."""
    top, *rest = module.split(".")
    for base in _package_folders(top):
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
    """The object at "module:qualname", or the module (imports it)."""
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
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
    """What the replacements act on that no longer exists in the installed torch / megatron-core:
    each patch's target and every pinned definition (a run fails on it at once, where a test of
    the pins would fail first)."""
    names = [r.target for r in REPLACEMENTS if r.kind == "patch" and " " not in r.target]
    names += [pin.source for r in REPLACEMENTS for pin in r.pins]
    missing = []
    for name in dict.fromkeys(names):  # in order, once each
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    return missing


# ------------------------------------------------------------------ the pins, checked at start-up
ALLOW_ENV = "MLMCLM_ALLOW_MEGATRON_CORE"


class SourceChanged(Exception):
    """The installed megatron-core (or torch) no longer matches the pins: one line, naming the
    targets (runtime/distributed.py turns it into the run's usage error, exit status 2)."""


def verify_installed() -> None:
    """Raise SourceChanged, naming each pinned source that changed, the targets that rely on it
    and the package it is in, unless every pin of the registry holds in the installed packages,
    or $MLMCLM_ALLOW_MEGATRON_CORE names the installed pair (`accepted_pair()`: the user has read
    the new source; then a warning, on stderr). Called once per process, by apply.apply_patches;
    the pins of source text are computed once per install (about 1 CPU-s: every pinned file
    parsed) and remembered by the size and modification time of each file in the user's cache
    folder."""
    failed = failed_pins()
    if not failed:
        return
    changed = "; ".join(
        f"{_distribution(source)} {_version(_distribution(source))}'s {source} (relied on by "
        f"{', '.join(targets)})"
        for source, targets in _changed_sources(failed).items()
    )
    message = (
        f"the installed source changed where mcore_patches/registry.yaml pins it (checked "
        f"against {MEGATRON_CORE}): {changed}"
    )
    dists = {_distribution(pin.source) for pin in failed}
    remedy = f"install {PINNED} (as pyproject.toml pins it)"
    if "torch" in dists:
        remedy = f"install a torch with the source those rows pin (their `checked`) and {PINNED}"
    pair = accepted_pair()
    if os.environ.get(ALLOW_ENV) != pair:
        raise SourceChanged(
            f"{message}; {remedy}, or, having read the new source of what changed, set "
            f"{ALLOW_ENV}={pair} (the installed pair it accepts)"
        )
    missing = missing_targets()
    if missing:
        raise SourceChanged(
            f"the installed {' and '.join(sorted({_distribution(m) for m in missing}))} no "
            f"longer has {', '.join(missing)}, which mcore_patches replaces or relies on; {remedy}"
        )
    print(f"warning: {message} (run anyway: {ALLOW_ENV}={pair})", file=sys.stderr)


def accepted_pair() -> str:
    """What $MLMCLM_ALLOW_MEGATRON_CORE must say to run on changed sources: the installed
    megatron-core and torch, as pip names them (`megatron-core==X,torch==Y`), so an acceptance
    lapses when either package changes again."""
    return f"megatron-core=={_version('megatron-core')},torch=={_version('torch')}"


def _changed_sources(failed: set[Pin]) -> dict[str, list[str]]:
    """Each pinned source of `failed` (in registry order) -> the targets of the rows pinning it."""
    out: dict[str, list[str]] = {}
    for r in REPLACEMENTS:
        for pin in r.pins:
            if pin in failed and r.target not in out.setdefault(pin.source, []):
                out[pin.source].append(r.target)
    return out


def changed_targets() -> list[str]:
    """The targets of the rows of which some pin no longer holds, in registry order."""
    return _targets_of(failed_pins())


def _targets_of(failed: set[Pin]) -> list[str]:
    return list(dict.fromkeys(r.target for r in REPLACEMENTS if failed & set(r.pins)))


def _distribution(source: str) -> str:
    """The installed package that holds a pin's source: torch or megatron-core."""
    return "torch" if source.split(".")[0].split(":")[0] == "torch" else "megatron-core"


def failed_pins() -> set[Pin]:
    """The registry's pins that no longer hold in the installed packages."""
    source_pins = {p for r in REPLACEMENTS for p in r.pins if _is_source_pin(p)}
    cached = _cache_marker(source_pins)
    known_good = cached is not None and cached.exists()
    failed = {
        pin
        for r in REPLACEMENTS
        for pin in r.pins
        if not (known_good and pin in source_pins) and not pin_holds(pin)[0]
    }
    if cached is not None and not known_good and not failed & source_pins:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.touch()
        except OSError:
            pass  # no cache: the pins are computed again by the next process
    return failed


def _is_source_pin(pin: Pin) -> bool:
    return not pin.check.startswith(("exists", "parameter"))


def _cache_marker(pins: set[Pin]) -> Path | None:
    """The file whose existence says that `pins` held in these very files (named by a digest of
    the pins and each file's path, size and modification time); None where a file is missing."""
    try:
        files = sorted({str(_source_file(p.source.partition(":")[0])) for p in pins})
        stats = [(f, st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)]]
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (ModuleNotFoundError, OSError, RuntimeError):  # RuntimeError: no home folder
        return None
    key = json.dumps([sorted(f"{p.source} {p.check}" for p in pins), stats])
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return cache / "mlmclm" / "mcore-pins" / digest


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
