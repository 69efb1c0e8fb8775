"""Every command the documentation shows is one that works.

- Code blocks fenced as ```bash smoke``` in README.md and docs/*.md are the CPU-sized examples:
  each file's blocks run as written, in order, in a fresh folder that holds a link to examples/,
  with $MLMCLM_DATA_DIR set. A stretch of plain `mlmclm` lines (no shell syntax beyond quoted
  words and variables) runs line by line: bash expands each line's words, and the command runs
  forked from the test worker's preloaded server (tests/jobs.py), which skips the interpreter
  start (about 6 CPU-seconds a command); anything else runs with `bash -euo pipefail`. Where two
  files open with the same `mlmclm` commands (convert.md and evaluate.md both tokenize,
  preprocess, pretrain and export), those commands run once per test worker: the next file
  starts from a copy of the folder they left, and runs the rest of its commands there.
- Every other `mlmclm` command in README.md, docs/*.md and the header comments of examples/ (GPU
  and cluster commands that cannot run here) goes through the real argument parser of its
  subcommand; a `pretrain` command whose config ships in the repository is also resolved and
  validated exactly as `--dry-run` does, short of opening the files it names (the docs' data and
  checkpoints are the user's).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from jobs import job_env, launch

from megatron_mlmclm.cli import COMMANDS, command_parser, main, parse_command_args
from megatron_mlmclm.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLES = sorted(p for p in (REPO / "examples").rglob("*") if p.is_file())
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.M | re.S)
SHELL_BREAK = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1", ")"}


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block of a markdown file."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(path.read_text())]


def smoke_blocks(path: Path) -> list[str]:
    return [body for info, body in fenced_blocks(path) if info.split()[1:2] == ["smoke"]]


def logical_lines(text: str) -> list[str]:
    return [line.strip() for line in text.replace("\\\n", " ").splitlines() if line.strip()]


def example_header(path: Path) -> str:
    """The leading comment block of an example file, comment markers removed."""
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("#!"):
            continue
        if not line.startswith("#") or line.startswith("#SBATCH"):
            break
        lines.append(line.lstrip("#").strip())
    return "\n".join(lines)


def mlmclm_argv(line: str) -> list[str] | None:
    """The arguments after `mlmclm` / `-m megatron_mlmclm` in a shell line, or None."""
    line = re.sub(r"\[-[^\]]*\]", " ", line)  # `[--optional flags]` notation in the docs
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return None
    for i, tok in enumerate(tokens):
        if (
            tok == "mlmclm"
            or tok.endswith(("/mlmclm", "$(mlmclm"))
            or (tok == "megatron_mlmclm" and tokens[i - 1] == "-m")
        ):
            argv = []
            for t in tokens[i + 1 :]:
                if t in SHELL_BREAK:
                    break
                argv.append(t)
            return argv if argv and argv[0] in COMMANDS else None
    return None


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every statically checkable `mlmclm` command outside smoke blocks."""
    found = []
    for path in DOCS:
        for info, body in fenced_blocks(path):
            if info.split()[:1] not in ([], ["bash"], ["sh"], ["console"]) or "smoke" in info:
                continue
            for line in logical_lines(body):
                found.append((f"{path.relative_to(REPO)}: {line}", mlmclm_argv(line)))
    for path in EXAMPLES:
        for line in logical_lines(example_header(path)):
            found.append((f"{path.relative_to(REPO)}: {line}", mlmclm_argv(line)))
    # Lines that use shell variables or `...` cannot be parsed as written: they are shown, not run.
    return [
        (w, a) for w, a in found if a is not None and not any("$" in t or "..." in t for t in a)
    ]


def parsed(where: str, argv: list[str]):
    """(the subcommand's module, its parsed arguments); a test failure naming `where` if its
    parser rejects them."""
    module, parser = command_parser(argv[0])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return module, parse_command_args(parser, argv[1:])
    except SystemExit:
        pytest.fail(f"{where}\n  is rejected by the parser: {err.getvalue().strip()}")


@pytest.mark.parametrize("where,argv", documented_commands(), ids=lambda x: str(x)[:90])
def test_documented_command_parses(where, argv):
    module, args = parsed(where, argv)
    if argv[0] == "pretrain":  # resolve and validate the config, as --dry-run does
        from megatron_mlmclm.training.dry_run import dry_run_report

        config = args.config
        if config is not None and "=" not in config and not (REPO / config).is_file():
            return  # a config the user writes (e.g. from `convert from-hf`): parse only
        cwd = os.getcwd()
        os.chdir(REPO)
        try:
            dry_run_report(module.resolve(args))
        except UsageError as e:
            pytest.fail(f"{where}\n  fails validation: {e}")
        finally:
            os.chdir(cwd)


def test_the_documentation_shows_checked_commands():
    """The extraction above keeps finding commands (a format change must not silence it)."""
    commands = documented_commands()
    assert len(commands) >= 20, commands
    assert {a[0] for _, a in commands} >= {
        "tokenize",
        "preprocess",
        "index",
        "pretrain",
        "convert",
        "evaluate",
        "report",
        "plan",
    }


SMOKE_FILES = [p for p in DOCS if smoke_blocks(p)]
# Shell syntax that a line's words cannot carry through a forked command.
SHELL_SYNTAX = re.compile(r"[|&;<>()`]|\$\(")


def plain_mlmclm(line: str) -> bool:
    """`mlmclm SUBCOMMAND ...` with nothing but words, quotes and variables after it."""
    code = shlex.split(line, comments=True)
    return (
        bool(code)
        and code[0] == "mlmclm"
        and mlmclm_argv(line) is not None
        and not any(SHELL_SYNTAX.search(t) for t in shlex.split(line, comments=True, posix=False))
    )


def run_in_bash(script: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def run_forked(line: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """A plain `mlmclm` line: its words as bash expands them (`set -u`: an unset variable fails
    as it would in the block), run by `mlmclm`'s own main in a process forked from the preloaded
    server, in `cwd` with `env`."""
    words = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "printf '%s\\0' " + line.split(None, 1)[1]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")[:-1]
    return launch(("mlmclm", words), env=dict(job_env(), **env), cwd=cwd, timeout=600)


def test_every_flow_step_has_a_smoke_example():
    shown = " ".join(" ".join(smoke_blocks(p)) for p in SMOKE_FILES)
    for sub in (
        "tokenize",
        "preprocess",
        "index",
        "pretrain",
        "convert to-hf",
        "convert from-hf",
        "evaluate",
        "report",
        "plan",
    ):
        assert f"mlmclm {sub}" in shown, f"no ```bash smoke``` block runs `mlmclm {sub}`"


def shared_openings() -> set[tuple[str, ...]]:
    """The leading commands any two smoke files have in common: plain `mlmclm` lines only, which
    leave no shell state (variables, working folder) behind for the lines after them."""
    scripts = [logical_lines("\n".join(smoke_blocks(p))) for p in SMOKE_FILES]
    found = set()
    for a, b in itertools.combinations(scripts, 2):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k] and a[k].startswith("mlmclm "):
            k += 1
        if k:
            found.add(tuple(a[:k]))
    return found


SHARED_OPENINGS = shared_openings()
_OPENING_FOLDERS: dict[tuple[str, ...], Path] = {}  # an opening -> a copy of what it left


def test_the_smoke_files_share_their_opening_commands():
    """convert.md and evaluate.md open alike: if they drift apart, each runs its own opening (and
    the smoke tests take longer), which this test notices."""
    docs = {p.name: logical_lines("\n".join(smoke_blocks(p))) for p in SMOKE_FILES}
    assert tuple(docs["evaluate.md"][:4]) in SHARED_OPENINGS
    assert tuple(docs["convert.md"][:4]) == tuple(docs["evaluate.md"][:4])


def test_only_plain_mlmclm_lines_run_forked(tmp_path):
    assert plain_mlmclm('mlmclm tokenize --train "$MLMCLM_DATA_DIR/x.gz" --out tok  # a comment')
    assert plain_mlmclm("mlmclm pretrain tiny.yaml data.train=[shards/a_text_document]")
    for line in (
        "mlmclm plan --out p | tee log",
        "mlmclm pretrain tiny.yaml > log",
        "mlmclm pretrain $(cat config)",
        "mlmclm pretrain tiny.yaml && ls",
        "cd runs",
        "mlmclm frobnicate",
        "# mlmclm plan",
    ):
        assert not plain_mlmclm(line), line
    # bash expands the words: quotes and variables as a block would see them; an unset one fails
    env = dict(os.environ, WHERE="a b")
    proc = run_forked('mlmclm plan --out "$WHERE/p" --sizes nonesuch', tmp_path, env)
    assert proc.args == ["plan", "--out", "a b/p", "--sizes", "nonesuch"] and proc.returncode == 2
    with pytest.raises(subprocess.CalledProcessError):
        run_forked("mlmclm plan --out $UNSET_VARIABLE_HERE", tmp_path, env)


@pytest.mark.slow
@pytest.mark.parametrize("doc", SMOKE_FILES, ids=lambda p: p.name)
def test_smoke_blocks_run_as_written(doc, tmp_path, tmp_path_factory, data_dir):
    lines = logical_lines("\n".join(smoke_blocks(doc)))
    cuts = sorted(len(o) for o in SHARED_OPENINGS if tuple(lines[: len(o)]) == o)
    start = max((k for k in cuts if tuple(lines[:k]) in _OPENING_FOLDERS), default=0)
    if start:
        shutil.copytree(
            _OPENING_FOLDERS[tuple(lines[:start])], tmp_path, dirs_exist_ok=True, symlinks=True
        )
    else:
        (tmp_path / "examples").symlink_to(REPO / "examples")
    env = dict(
        os.environ,
        MLMCLM_DATA_DIR=str(data_dir),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    ends = [k for k in cuts if k > start] + [len(lines)]
    for begin, end in zip([start, *ends], ends):
        # A file that shares no opening runs its blocks' text unchanged.
        script = "\n".join(lines[begin:end]) if cuts else "\n".join(smoke_blocks(doc))
        stretch = [line for line in logical_lines(script) if not line.startswith("#")]
        if all(plain_mlmclm(line) for line in stretch):
            procs = [run_forked(line, tmp_path, env) for line in stretch]
        else:
            procs = [run_in_bash(script, tmp_path, env)]
        for proc in procs:
            assert proc.returncode == 0, (
                f"{doc.name}: a smoke block failed (rc {proc.returncode}): {proc.args}\n"
                f"{proc.stderr[-3000:]}"
            )
        if end in cuts:
            kept = tmp_path_factory.mktemp("smoke-opening")
            shutil.copytree(tmp_path, kept, dirs_exist_ok=True, symlinks=True)
            _OPENING_FOLDERS[tuple(lines[:end])] = kept


SBATCH_COMMANDS = {  # examples/slurm/: the command each template runs with its arguments
    "pretrain.sbatch": ["pretrain"],
    "convert.sbatch": ["convert", "to-hf"],
    "evaluate_array.sbatch": ["evaluate"],
    "report.sbatch": ["report"],
}


def cluster_steps(env: dict) -> list[tuple[str, list[str]]]:
    """docs/cluster.md's commands in order, their variables expanded from `env`: each `mlmclm`
    command (also behind `srun $CONTAINER_ARGS`), and each `sbatch TEMPLATE ARGS` as the command
    its job runs."""
    steps = []
    for info, body in fenced_blocks(REPO / "docs" / "cluster.md"):
        if info.split()[:1] not in ([], ["bash"]):
            continue
        for line in logical_lines(body):
            line = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), line)
            words = shlex.split(line, comments=True)
            templates = [i for i, w in enumerate(words) if Path(w).name in SBATCH_COMMANDS]
            if words[:1] == ["sbatch"] and templates:
                at = templates[0]
                steps.append((line, [*SBATCH_COMMANDS[Path(words[at]).name], *words[at + 1 :]]))
            elif mlmclm_argv(line) is not None:
                steps.append((line, mlmclm_argv(line)))
    return steps


def test_the_cluster_walkthrough_runs_on_cpu(tmp_path, monkeypatch):
    """docs/cluster.md as a new cluster user runs it, on CPU: every command parses; the plans run
    as written (they train nothing); every pretraining job resolves its config (`--dry-run`);
    the probe's folder, as its job would leave it, prices the re-plan (`--throughput`), and the
    evaluation probe's file, as its run would leave it, prices the next (`--eval-probe`)."""
    env = {
        "REPO": str(REPO),
        "STUDY_DIR": str(tmp_path / "study"),
        "DATA_DIR": str(tmp_path / "data"),
        "MLMCLM_DATA_DIR": str(tmp_path / "data" / "eval"),
        "SLURM_DIR": str(REPO / "examples" / "slurm"),
        "CONTAINER_ARGS": "--container-image=img.sqsh",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    steps = cluster_steps(env)
    assert [a[0] for _, a in steps].count("plan") == 3 and ("pretrain" in [a[0] for _, a in steps])
    ran = []
    for where, argv in steps:
        module, args = parsed(where, argv)
        if argv[0] == "plan":
            with contextlib.redirect_stdout(io.StringIO()) as out:
                assert module.run(args) == 0, where
            ran.append(out.getvalue())
        elif argv[0] == "pretrain" and Path(args.config).is_file():
            args.dry_run = True
            with contextlib.redirect_stdout(io.StringIO()):
                module.run(args)  # a config the plan wrote, with the command's overrides
            cfg = yaml.safe_load(Path(args.config).read_text())
            if cfg["name"].startswith("probe-"):  # what the probe's job leaves in its folder
                run = Path(cfg["output_dir"])
                run.mkdir(parents=True)
                (run / "config.yaml").write_text(Path(args.config).read_text())
                record = {"step": 10, "phase": 0, "objective": "clm", "loss": 9.0}
                record.update(tokens_per_s=1.6e6, tokens_per_s_per_device=1e5)
                (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
            ran.append(f"pretrain {cfg['name']}")
        elif argv[0] == "evaluate" and args.probe:  # what the evaluation probe writes
            Path(env["STUDY_DIR"], "probes").mkdir(parents=True, exist_ok=True)
            sst2 = {"family": "sc", "batch": 32, "steps": 200, "startup_s": 30.0, "step_s": 0.05,
                    "first_steps_s": 2.0, "scored_per_s": 3000.0}  # fmt: skip
            probe = {"kind": "mlmclm-eval-probe", "schema": 1, "size": args.probe, "device": "GPU",
                     "protocol": args.protocol, "tasks": {"sst2": sst2}}  # fmt: skip
            Path(args.out).write_text(json.dumps(probe))
            ran.append(f"probe {args.probe}")
        elif argv[0] == "status":  # the morning's look at the plan: files only, no SLURM here
            with contextlib.redirect_stdout(io.StringIO()) as out:
                assert module.run(args) == 0, where
            ran.append(f"status {out.getvalue()}")
    assert ran[1] == "pretrain probe-610m" and "probed: 610m" in ran[2], ran
    assert ran[3] == "probe 610m", ran
    status = next(r for r in ran if r.startswith("status "))
    assert "pt-610m-clm-42k" in status or "610m-clm-42k" in status, status[:2000]
    assert (Path(env["STUDY_DIR"]) / "plan" / "status.html").is_file()
    summary = (Path(env["STUDY_DIR"]) / "plan" / "SUMMARY.md").read_text()
    assert "| sst2 | sc | 610m |" in summary and "| measured |" in summary
    assert "evaluation data to fetch" in ran[0] and "--fetch" in ran[0]
    assert "pretrain 610m-clm-42k" in ran
    # the by-hand evaluation arrays: one task each, one GPU an element, the protocol named, sized
    # for the task's 6 learning rates x 5 seeds
    arrays = {
        "--runs-per-element" in w: (w, a)
        for w, a in steps
        if a[0] == "evaluate" and "--array=0-" in w
    }
    for words, args in arrays.values():
        assert "--gpus-per-node 1" in words and "--time " in words, words
        assert args[args.index("--protocol") + 1] == "encodeval" and len(args_tasks(args)) == 1
    runs = 30
    last = int(re.search(r"--array=0-(\d+)", arrays[False][0]).group(1))
    assert last + 1 == runs
    words, args = arrays[True]  # K runs an element: ceil(runs / K) elements
    k = int(args[args.index("--runs-per-element") + 1])
    assert int(re.search(r"--array=0-(\d+)", words).group(1)) + 1 == -(-runs // k)
    # each time limit is the one the plan gives its array at the cost model's price
    for per_element, (words, _) in ((k, arrays[True]), (1, arrays[False])):
        plan = tmp_path / f"limit-{per_element}"
        argv = ["plan", "--out", str(plan), "--sizes", "610m", "--eval-tasks", "sst2"]
        argv += ["--eval-protocol", "encodeval", "--eval-runs-per-job", str(per_element)]
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 0
        summary = (plan / "SUMMARY.md").read_text()
        limit = re.search(rf"\| sst2 \| 610m \| {per_element} \| \d+ \| (\S+) \|", summary)
        assert limit and f"--time {limit.group(1)} " in words, (limit, words)


def args_tasks(args: list[str]) -> list[str]:
    """The task names after `--task` in an `mlmclm evaluate` argv."""
    at = args.index("--task") + 1
    return list(itertools.takewhile(lambda a: not a.startswith("--"), args[at:]))
