"""Every megatron-core (and torch) function, method and attribute this project replaces or
overrides: the list is registry.yaml, one row each, read here into `REPLACEMENTS`.

A row names the thing replaced (`target`), our code that replaces it (`by`), when that applies
(`when`) and why. Its pins say what of megatron-core the replacement was written against: a hash
of the source of each definition it replaces or re-implements, in the version it was checked
against (`checked`). `tests/test_mcore_patches.py` recomputes every pin from the installed
packages: when megatron-core changes one of them, the test of that row fails, naming it, before
any run trains with a replacement that no longer fits. Updating a row is reading the new source,
checking the replacement still does what `why` says, and then writing the new hash and version.

Two kinds of rows:
- `patch`: the attribute is replaced at run time, by code in this package (jit.py, cpu.py,
  optimizer.py). `missing_targets()` checks before patching that every one, and every pinned
  definition, still exists.
- `override`: a megatron-core method that a subclass of ours overrides, or whose work our code
  does in its place, or a private name our code calls; the code is where it runs (`by`). A
  change of the method would not raise, it would leave ours out of step.

Pins of torch (whose CPU wheels and GPU images differ) check what the replacement relies on
(`contains:` a line of its source, `parameter:` a parameter it takes, or `exists`), not a hash.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
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
