"""The `mlmclm` command: one entry point, one module per subcommand (megatron_mlmclm/commands/).

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int | None`. Modules are
imported only when their subcommand runs (by name, from COMMANDS), so `mlmclm --help` stays fast
and a heavy dependency of one subcommand (megatron-core, sentence-transformers) never slows down
another.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import types
import warnings

from megatron_mlmclm.errors import EXIT_USAGE, UsageError
from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

# megatron-core's kernels compile at their first call, not at import (mcore_patches/jit.py): asked
# for here, as the entry point is imported and before any command imports megatron-core, so that
# the workers a command spawns, which import the entry point first, get it too.
defer_kernel_compilation()

# name -> (module, one-line help). Order is the order of the user's flow.
_PKG = "megatron_mlmclm.commands"
COMMANDS: dict[str, tuple[str, str]] = {
    "tokenize": (f"{_PKG}.tokenize", "load or train a tokenizer with bos/eos/pad/mask"),
    "preprocess": (f"{_PKG}.preprocess", "raw text -> Megatron .bin/.idx shards"),
    "index": (f"{_PKG}.index", "build (and cache) the packed sample index"),
    "pretrain": (f"{_PKG}.pretrain", "pretrain with CLM / MLM phases"),
    "convert": (f"{_PKG}.convert", "megatron <-> Hugging Face; Megatron-LM -> megatron"),
    "evaluate": (f"{_PKG}.evaluate", "fine-tune HF encoders over an LR x seed grid"),
    "report": (f"{_PKG}.report", "tables, confidence intervals and plots"),
    "plan": (f"{_PKG}.plan", "write the study's grid of configs and jobs"),
    "submit": (f"{_PKG}.submit", "submit a plan's jobs to SLURM, what is not done or queued"),
    "status": (f"{_PKG}.status", "a plan's progress, failures and GPU-hours, and its page"),
    "quickstart": (f"{_PKG}.quickstart", "small end-to-end run on CPU"),
    "study": (f"{_PKG}.study", "the study's comparisons in miniature on CPU, with verdicts"),
}


def available_commands() -> dict[str, tuple[str, str]]:
    """Subcommands whose module is present in this install."""
    out = {}
    for name, (module, help_) in COMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            out[name] = (module, help_)
    return out


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of a flag is one line (exit status 2), as every other
    refusal: the usage it would print first is `--help`'s."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def command_parser(name: str) -> tuple[types.ModuleType, argparse.ArgumentParser]:
    """The module of subcommand `name` and its argument parser."""
    module_name, help_ = COMMANDS[name]
    parser = CommandParser(prog=f"mlmclm {name}", description=help_)
    module = importlib.import_module(module_name)
    module.add_arguments(parser)
    return module, parser


def parse_command_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Flags may sit between positionals (`pretrain CONFIG --dry-run key=value`); parsers with
    sub-commands cannot be parsed that way and are parsed as usual."""
    try:
        return parser.parse_intermixed_args(argv)
    except TypeError:  # argparse: sub-parsers (nargs=A...) are not intermixable
        return parser.parse_args(argv)


def _top_help(commands) -> str:
    lines = ["usage: mlmclm COMMAND [ARGS ...] | --version", "", "commands:"]
    lines += [f"  {n:<11} {h}" for n, (_, h) in commands.items()]
    lines += ["", "Run `mlmclm COMMAND --help` for the options of one command."]
    return "\n".join(lines)


def version_line() -> str:
    """Our version and those of what a run's numbers depend on, read from the installed metadata
    (no import of torch or megatron: `--version` answers at once)."""
    from importlib import metadata

    import megatron_mlmclm

    def installed(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    deps = ", ".join(f"{d} {installed(d)}" for d in ("megatron-core", "torch", "transformers"))
    return f"mlmclm {megatron_mlmclm.__version__} ({deps})"


def quiet_optional_dependency_warnings() -> None:
    """megatron-core warns at import about every absent Apex/TE fallback; we say it once."""
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.core")


def main(argv: list[str] | None = None) -> int:
    quiet_optional_dependency_warnings()
    for stream in (sys.stdout, sys.stderr):  # a path of bytes that are not UTF-8 (argv holds
        if hasattr(stream, "reconfigure"):  # them as surrogates) prints as those bytes
            stream.reconfigure(errors="surrogateescape")
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = available_commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help(commands))
        return 0 if argv else EXIT_USAGE
    if argv[0] in ("-V", "--version"):
        print(version_line())
        return 0
    name = argv[0]
    if name not in commands:
        print(
            f"mlmclm: error: unknown command '{name}'; choose one of {', '.join(commands)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        module, parser = command_parser(name)
        args = parse_command_args(parser, argv[1:])
        rc = module.run(args)
    except UsageError as e:
        if os.environ.get("RANK", "0") == "0":  # one line per job, not one per rank
            print(f"mlmclm {name}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"mlmclm {name}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


def entry() -> None:  # pragma: no cover - thin wrapper for console_scripts
    sys.exit(main())


if __name__ == "__main__":  # spawn-started workers (preprocessing, the eval grid) need a guard
    entry()
