"""The import rule of docs/architecture.md, checked on every module of the package with `ast`.

The rule is read from the table in docs/architecture.md (the document is the rule), and every
import of every module counts: top-level, inside functions, `from megatron_mlmclm import x`,
relative. A synthetic package with known violations shows that the check finds them, naming the
file, the line and the import. Last, the scripts outside the package (benchmarks, tools) may only
import names of it that exist.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = "megatron_mlmclm"
DOC = REPO / "docs" / "architecture.md"
# Where argparse may be used: the command modules and the entry point.
COMMAND_LINE = ("commands", "cli")
ARGPARSE_CALLS = {
    "ArgumentParser",
    "add_argument",
    "add_argument_group",
    "add_subparsers",
    "add_parser",
    "add_mutually_exclusive_group",
}


def read_rules(doc: Path = DOC) -> dict[str, set[str]]:
    """{package: names it may import} from the table under '## The import rule'."""
    section = doc.read_text().split("## The import rule", 1)[1].split("\n## ", 1)[0]
    rules = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and re.fullmatch(r"`[\w.]+`", cells[0]):
            rules[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return rules


def modules(root: Path) -> list[tuple[Path, str]]:
    """(file, dotted module name) of every module under the package folder `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((path, ".".join(parts)))
    return out


def unit_of(module: str) -> str:
    """megatron_mlmclm.convert.common -> convert; megatron_mlmclm -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported(path: Path, module: str):
    """(node, targets): every import statement and the megatron_mlmclm modules (or names) it
    reaches, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        yield node, [t for t in targets if t == PKG or t.startswith(PKG + ".")]


def allowed(target: str, entries: set[str]) -> bool:
    """`target` relative to the package (flops.train_step_flops) against a rule row."""
    return any(target == e or target.startswith(e + ".") for e in entries)


def violations(root: Path, rules: dict[str, set[str]]) -> list[str]:
    """One line per import that breaks the rule: 'file:line: import ... (unit may not import X)'."""
    out = []
    for path, module in modules(root):
        unit = unit_of(module)
        where = path.relative_to(root.parent)
        if unit not in rules:
            out.append(
                f"{where}: package '{unit}' has no row in the rule table of docs/architecture.md"
            )
            continue
        source = path.read_text()
        for node, targets in imported(path, module):
            bad = {
                unit_of(t)
                for t in targets
                if unit_of(t) != unit and not allowed(t[len(PKG) + 1 :] or "__init__", rules[unit])
            }
            text = " ".join(ast.get_source_segment(source, node).split())
            out += [
                f"{where}:{node.lineno}: `{text}`: {unit} may not import {b} (docs/architecture.md)"
                for b in sorted(bad)
            ]
    return out


def import_cycles(root: Path) -> list[list[str]]:
    """Groups of modules that import each other, directly or round a loop (Tarjan's strongly
    connected components over module -> module imports, those inside functions and under
    TYPE_CHECKING included)."""
    found = dict(modules(root))
    names = set(found.values())
    graph: dict[str, set[str]] = {m: set() for m in names}
    for path, module in found.items():
        for _, targets in imported(path, module):
            for t in targets:
                while t and t not in names:  # a name inside a module -> the module
                    t = t.rpartition(".")[0]
                if t and t != module:
                    graph[module].add(t)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_round_a_loop():
    assert import_cycles(REPO / PKG) == []


def test_an_import_loop_is_found(tmp_path):
    root = tmp_path / PKG
    write(root, "__init__.py", "")
    write(root, "config.py", "from megatron_mlmclm.model.flops import count\n")
    write(root, "model/__init__.py", "")
    write(
        root,
        "model/flops.py",
        """\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from megatron_mlmclm.config import X
        """,
    )
    write(root, "model/build.py", "from megatron_mlmclm import config\n")
    assert import_cycles(root) == [[f"{PKG}.config", f"{PKG}.model.flops"]]


def training_layers(doc: Path = DOC) -> list[str]:
    """The folders of training/, bottom to top, as docs/architecture.md lists them."""
    section = doc.read_text().split("**`training/`: the loop.**", 1)[1].split("\n\n**", 1)[0]
    return re.findall(r"^- `(\w+)/`", section, re.M)


def upward_in_training(root: Path, layers: list[str]) -> list[str]:
    """'file:line: folder -> folder' for each import of a training/ folder by a folder listed
    before it (the run's modules on top of training/ may import any)."""
    rank = {name: i for i, name in enumerate(layers)}
    out = []
    for path, module in modules(root):
        parts = module.split(".")
        if parts[1:2] != ["training"] or len(parts) < 4 or parts[2] not in rank:
            continue
        for node, targets in imported(path, module):
            for t in targets:
                there = t.split(".")
                if there[1:2] == ["training"] and len(there) > 2:
                    if there[2] not in rank or rank[there[2]] > rank[parts[2]]:
                        where = f"{path.relative_to(root.parent)}:{node.lineno}"
                        out.append(f"{where}: {parts[2]} -> {there[2]}")
    return out


def test_training_folders_import_only_those_below():
    layers = training_layers()
    assert layers == ["faults", "logs", "batches", "step", "start"], layers
    present = {
        p.name
        for p in (REPO / PKG / "training").iterdir()
        if p.is_dir() and p.name != "__pycache__"
    }
    assert present == set(layers), present
    problems = upward_in_training(REPO / PKG, layers)
    assert not problems, "upward imports in training/:\n" + "\n".join(problems)


def test_an_upward_import_in_training_is_found(tmp_path):
    root = tmp_path / PKG
    write(root, "__init__.py", "")
    write(root, "training/__init__.py", "")
    write(root, "training/trainer.py", "from megatron_mlmclm.training.start import decide\n")
    write(root, "training/faults/__init__.py", "")
    write(root, "training/faults/monitor.py", "from megatron_mlmclm.training.logs import metrics\n")
    write(root, "training/logs/__init__.py", "")
    write(
        root, "training/logs/metrics.py", "from megatron_mlmclm.training.trainer import Trainer\n"
    )
    assert upward_in_training(root, ["faults", "logs"]) == [
        f"{PKG}/training/faults/monitor.py:1: faults -> logs",
        f"{PKG}/training/logs/metrics.py:1: logs -> trainer",
    ]


def argparse_outside_commands(root: Path) -> list[str]:
    """Modules outside commands/ and cli.py that build parsers or declare flags."""
    out = []
    for path, module in modules(root):
        if unit_of(module) in COMMAND_LINE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            name = None
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            elif isinstance(node, ast.FunctionDef) and node.name == "add_arguments":
                name = "def add_arguments"
            if name in ARGPARSE_CALLS or name == "def add_arguments":
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {name}")
    return out


# --------------------------------------------------------------------------------------- tests


def test_every_module_follows_the_import_rule():
    problems = violations(REPO / PKG, read_rules())
    assert not problems, "imports against docs/architecture.md:\n" + "\n".join(problems)


def test_the_rule_table_names_every_package_and_only_those():
    rules = read_rules()
    present = {unit_of(m) for _, m in modules(REPO / PKG)}
    assert len(rules) >= 15
    assert set(rules) == present, (
        f"no row: {sorted(present - set(rules))}, rows for nothing: {sorted(set(rules) - present)}"
    )
    for unit, entries in rules.items():  # every name a row allows exists
        for e in entries:
            first = e.split(".")[0]
            assert first in present or first == "_sample_index", (unit, e)
    assert "training" not in rules["convert"] and "training" not in rules["eval"]


def test_the_command_line_lives_in_commands():
    problems = argparse_outside_commands(REPO / PKG)
    assert not problems, "argparse outside commands/ and cli.py:\n" + "\n".join(problems)


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_violations_are_found_with_file_line_and_import(tmp_path):
    """A synthetic package: each kind of import that breaks the rule, next to allowed ones."""
    root = tmp_path / PKG
    write(root, "__init__.py", "")
    write(root, "errors.py", "")
    write(root, "convert/__init__.py", "")
    write(
        root,
        "convert/export.py",
        """\
        import json

        from megatron_mlmclm.checkpoint import load_checkpoint
        from megatron_mlmclm.convert import mapping


        def vocab(cfg):
            from megatron_mlmclm.training.trainer import token_spec_and_vocab
            return token_spec_and_vocab(cfg)
        """,
    )
    write(root, "eval/__init__.py", "")
    write(root, "eval/heads.py", "import megatron_mlmclm.model.build as build\n")
    write(root, "plan/__init__.py", "")
    write(
        root,
        "plan/compute.py",
        """\
        from megatron_mlmclm import config
        from megatron_mlmclm.config import step_flops
        from megatron_mlmclm.model import build
        """,
    )
    write(root, "data/__init__.py", "")
    write(
        root,
        "data/loader.py",
        """\
        from .. import objectives
        from . import tokenizer
        """,
    )
    write(root, "objectives.py", "from megatron_mlmclm import checkpoint, data\n")
    write(root, "newpkg/__init__.py", "")
    got = violations(root, read_rules())
    assert got == [
        f"{PKG}/convert/export.py:8: `from megatron_mlmclm.training.trainer import "
        "token_spec_and_vocab`: convert may not import training (docs/architecture.md)",
        f"{PKG}/data/loader.py:1: `from .. import objectives`: data may not import objectives "
        "(docs/architecture.md)",
        f"{PKG}/eval/heads.py:1: `import megatron_mlmclm.model.build as build`: eval may not "
        "import model (docs/architecture.md)",
        f"{PKG}/newpkg/__init__.py: package 'newpkg' has no row in the rule table of "
        "docs/architecture.md",
        f"{PKG}/objectives.py:1: `from megatron_mlmclm import checkpoint, data`: objectives may "
        "not import checkpoint (docs/architecture.md)",
        f"{PKG}/plan/compute.py:3: `from megatron_mlmclm.model import build`: plan may not "
        "import model (docs/architecture.md)",
    ], "\n".join(got)


def test_argparse_outside_commands_is_found(tmp_path):
    root = tmp_path / PKG
    write(root, "__init__.py", "")
    write(
        root,
        "data/dataset.py",
        """\
        def add_arguments(parser):
            parser.add_argument("--seq-length", type=int)
        """,
    )
    write(
        root,
        "commands/index.py",
        """\
        def add_arguments(parser):
            parser.add_argument("--seq-length", type=int)
        """,
    )
    assert argparse_outside_commands(root) == [
        f"{PKG}/data/dataset.py:1: def add_arguments",
        f"{PKG}/data/dataset.py:2: add_argument",
    ]


# Scripts outside the package that import from it; nothing runs them in the suite, so a renamed
# function would break them silently (benchmarks have, before this check).
SCRIPTS = ("benchmarks", "tools", "tests/scripts")


def missing_names(paths: list[Path]) -> list[str]:
    """'file:line: from M import N' for each import of the package (anywhere in the file) whose
    module or name does not exist. Modules are imported for real: names made at run time count."""
    problems = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                pairs = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in pairs:
                if module.split(".")[0] != PKG:
                    continue
                where = f"{path.name}:{node.lineno}: " + (
                    f"import {module}" if name is None else f"from {module} import {name}"
                )
                try:
                    mod = importlib.import_module(module)
                except ImportError:
                    problems.append(where)
                    continue
                if name is None or hasattr(mod, name) or is_submodule(module, name):
                    continue
                problems.append(where)
    return problems


def is_submodule(module: str, name: str) -> bool:
    """`from package import module` names a submodule that need not be imported yet; under a
    plain module, find_spec raises instead of returning None."""
    try:
        return importlib.util.find_spec(f"{module}.{name}") is not None
    except ImportError:
        return False


def test_scripts_outside_the_package_import_names_that_exist():
    paths = sorted(p for d in SCRIPTS for p in (REPO / d).glob("*.py"))
    assert len(paths) >= 10, paths
    problems = missing_names(paths)
    assert not problems, "imports of names that do not exist:\n" + "\n".join(problems)


def test_an_import_of_a_missing_name_is_found(tmp_path):
    write(
        tmp_path,
        "bench.py",
        """\
        from megatron_mlmclm.config import load_config


        def main():
            from megatron_mlmclm.config import no_such_function
            import megatron_mlmclm.no_such_module
            from megatron_mlmclm import training
            from megatron_mlmclm.errors import UsageError, no_such_error
        """,
    )
    assert missing_names([tmp_path / "bench.py"]) == [
        "bench.py:5: from megatron_mlmclm.config import no_such_function",
        "bench.py:6: import megatron_mlmclm.no_such_module",
        "bench.py:8: from megatron_mlmclm.errors import no_such_error",
    ]
