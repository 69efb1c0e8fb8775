"""STATUS.md and status.html: a plan's status (plan/status.py) as text and as one static page
(tables with state colours, plots as inline SVG from svg.py; no script, nothing fetched), both
written atomically into the plan folder. `refresh` is what `mlmclm submit` and the report job
call: it never raises (one warning line). The standard library only.
"""

from __future__ import annotations

import os
from html import escape
from pathlib import Path

from megatron_mlmclm.plan import svg
from megatron_mlmclm.plan.status import Job, RunState, Status, read_status

FILES = ("STATUS.md", "status.html")
STATES = ("done", "running", "queued", "submitted", "not submitted", "no data", "blocked", "failed")
COLOURS = {  # background of a state's cell
    "done": "#c8e6c9",
    "running": "#bbdefb",
    "queued": "#e1e5ea",
    "submitted": "#e1e5ea",
    "not submitted": "#f5f5f5",
    "no data": "#fff3c4",
    "blocked": "#ffe0b2",
    "failed": "#ffcdd2",
}
SPENT, LEFT, DONE, FAILED, TODO = "#1f77b4", "#9ecae1", "#43a047", "#e53935", "#cfd8dc"


def hours(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}" if abs(v) < 100 else f"{v:,.0f}"


def short(v: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(v) >= size:
            return f"{v / size:.3g}{unit}"
    return f"{v:.0f}"


def tally(states: list[str]) -> str:
    return ", ".join(f"{states.count(s)} {s}" for s in STATES if s in states) or "none"


# ------------------------------------------------------------------------------------ figures


def glance(st: Status) -> list[tuple[str, str]]:
    """The page's first lines: (what, figure)."""
    p = st.planned
    left = st.left
    return [
        ("runs (pretraining)", tally([r.state for r in st.runs]) + f" of {len(st.runs)}"),
        ("jobs", tally([j.state for j in st.jobs]) + f" of {len(st.jobs)}"),
        (
            "GPU-hours spent",
            f"{hours(st.spent)} ({'sacct' if st.accounting else 'from the files: said per run'})"
            f" of the plan's {hours(p['total_gpu_hours'])} (pretraining "
            f"{hours(p['gpu_hours'])}, job starts {hours(p['startup_gpu_hours'])}, evaluation "
            f"{hours(p['eval_gpu_hours'])})",
        ),
        (
            "GPU-hours left",
            f"{hours(left.gpu_hours)}: each run's steps at its measured step time, else the "
            "plan's price a step; each array's runs at the measured seconds a run of its task "
            "and size, else the plan's",
        ),
        ("finish", st.finish()),
        ("failed jobs", str(len(st.failures))),
    ]


def report_line(j: Job) -> str:
    return f"{j.state} ({j.detail})" if j.detail else j.state


def run_row(r: RunState) -> dict[str, str]:
    f = r.files
    tokens = f"{short(f.tokens)} / {short(r.tokens_total)}" if r.tokens_total else short(f.tokens)
    return {
        "run": r.name,
        "state": r.state,
        "steps": f"{f.step:,} / {r.final_step:,}",
        "tokens": tokens,
        "last loss": f"{f.loss:.4f}" if f.loss is not None else "-",
        "checkpoint": f"{f.checkpoint:,}" if f.checkpoint is not None else "-",
        "tokens/s": short(f.tokens_per_s) if f.tokens_per_s else "-",
        "fault": f.fault or "",
        "GPU-h spent": f"{hours(r.spent.gpu_hours)} ({r.spent.source})",
        "GPU-h priced": hours(r.priced["pretrain"]),
        "GPU-h left": f"{hours(r.left.gpu_hours)} ({r.left.source})" if r.left.hours else "0",
    }


def model_row(r: RunState) -> dict[str, str]:
    row = {"model": r.name, "export": r.export.state}
    for t in r.tasks:
        row[t.task] = f"{t.done} done, {t.failed} failed, {t.left} left of {t.runs} ({t.job.state})"
    errors = [f"{t.task} {line}" for t in r.tasks for line in t.errors]
    if errors:
        row["a failed run's error"] = "; ".join(errors)
    row["GPU-h spent"] = f"{hours(r.eval_spent.gpu_hours)} ({r.eval_spent.source})"
    row["GPU-h priced"] = hours(r.priced["evaluation"])
    row["GPU-h left"] = (
        f"{hours(r.eval_left.gpu_hours)} ({r.eval_left.source})" if r.eval_left.hours else "0"
    )
    return row


def failure_row(j: Job) -> dict[str, str]:
    return {
        "job": j.key,
        "state": j.state,
        "what SLURM says": j.detail,
        "error line": j.error or "(no log found)",
        "log": str(j.log or "-"),
        "waiting on it": ", ".join(j.waiting) or "nothing",
    }


def job_row(j: Job, accounting: bool) -> dict[str, str]:
    row = {"job": j.key, "state": j.state, "detail": j.detail}
    if accounting:
        ran = [r for r in j.records if r.elapsed_s > 0]
        asked = not ran or any(r.gpus for r in ran)
        row["GPU-h"] = hours(j.gpu_hours) if asked else "no GPU asked"
        row["CPU-h"] = hours(j.cpu_hours)
    if j.error and j.state != "done":
        row["error line"] = j.error
    return row


def plots(st: Status) -> list[str]:
    """The page's three plots: spend against price per run, the running runs' loss, and the
    evaluation per model."""
    spend = [
        (
            r.name,
            [r.spent.gpu_hours + r.eval_spent.gpu_hours, r.left.gpu_hours + r.eval_left.gpu_hours],
            r.priced["total"],
        )
        for r in st.runs
    ]
    running = [(r.name, r.files.curve) for r in st.runs if r.state == "running" and r.files.curve]
    evaluation = [
        (
            r.name,
            [
                sum(t.done for t in r.tasks),
                sum(t.failed for t in r.tasks),
                sum(t.left - t.failed for t in r.tasks),
            ],
            None,
        )
        for r in st.runs
        if r.tasks
    ]
    return [
        svg.bars(
            "GPU-hours per run (pretraining and evaluation): spent, left, and the plan's price",
            spend,
            [svg.Segment("spent", SPENT), svg.Segment("left", LEFT)],
            "GPU-hours",
            marker="the plan's price",
        ),
        svg.curves(
            "Training loss of the running pretraining runs"
            + ("" if running else ": none is running"),
            running,
            "step",
            "loss",
        ),
        svg.bars(
            "Evaluation runs per model (every task)",
            evaluation,
            [svg.Segment("done", DONE), svg.Segment("failed", FAILED), svg.Segment("left", TODO)],
            "fine-tuning runs",
        ),
    ]


# ------------------------------------------------------------------------------------- pages


def md_table(rows: list[dict[str, str]]) -> list[str]:
    if not rows:
        return ["(none)", ""]
    head = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join(r.get(k, "").replace("|", "/") for k in head) + " |")
    return [*out, ""]


def sections(st: Status) -> list[tuple[str, list[dict[str, str]]]]:
    """The tables, titled, in the page's order."""
    out = [
        ("Failures: the error line of each failed job's log, and what waits on it",
         [failure_row(j) for j in st.failures]),
        ("Pretraining runs", [run_row(r) for r in st.runs]),
        ("Exports and evaluation, per model", [model_row(r) for r in st.runs]),
    ]  # fmt: skip
    for kind in ("pretrain", "convert", "evaluate", "report"):
        jobs = [job_row(j, st.accounting) for j in st.jobs if j.kind == kind]
        out.append((f"Jobs: {kind}", jobs))
    return out


def markdown(st: Status) -> str:
    out = [
        f"# Study status: {st.plan}",
        "",
        f"Written {st.written} by `mlmclm status`. {st.source}.",
    ]
    out += [f"{note}." for note in st.notes]
    out += [""] + [f"- **{what}**: {figure}" for what, figure in glance(st)]
    out += [f"- **the report**: {report_line(st.report)}", ""]
    for title, rows in sections(st):
        out += [f"## {title}", "", *md_table(rows)]
    return "\n".join(out)


CSS = """
body { font-family: "DejaVu Sans", Arial, sans-serif; font-size: 13px; margin: 16px;
       color: #212121; background: #fafafa; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 24px; }
table { border-collapse: collapse; background: #fff; margin: 6px 0; }
th, td { border: 1px solid #cfd8dc; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #eceff1; }
td.err { font-family: "DejaVu Sans Mono", monospace; font-size: 12px; max-width: 520px; }
.glance td:first-child { font-weight: bold; }
figure { margin: 12px 0; } svg { border: 1px solid #cfd8dc; background: #fff; }
""" + "".join(f"td.s-{s.replace(' ', '-')} {{ background: {c}; }}\n" for s, c in COLOURS.items())


def html_table(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "<p>(none)</p>"
    head = list(dict.fromkeys(k for r in rows for k in r))
    out = ["<table>", "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"]
    for r in rows:
        cells = []
        for h in head:
            v = r.get(h, "")
            cls = f' class="s-{v.replace(" ", "-")}"' if v in COLOURS else ""  # a state
            cls = ' class="err"' if "error" in h else cls
            cells.append(f"<td{cls}>{escape(v)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join([*out, "</table>"])


def html(st: Status) -> str:
    glance_rows = "".join(
        f"<tr><td>{escape(w)}</td><td>{escape(f)}</td></tr>" for w, f in glance(st)
    )
    report = report_line(st.report)
    glance_rows += f'<tr><td>the report</td><td class="s-{st.report.state.replace(" ", "-")}">'
    glance_rows += f"{escape(report)}</td></tr>"
    body = [
        f"<h1>Study status: {escape(str(st.plan))}</h1>",
        f"<p>Written {escape(st.written)} by <code>mlmclm status</code>. {escape(st.source)}."
        + "".join(f" {escape(n)}." for n in st.notes)
        + "</p>",
        f'<table class="glance">{glance_rows}</table>',
    ]
    body += [f"<figure>{p}</figure>" for p in plots(st)]
    for title, rows in sections(st):
        body += [f"<h2>{escape(title)}</h2>", html_table(rows)]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>Study status: {escape(st.plan.name)}</title>\n<style>{CSS}</style>\n</head>\n"
        "<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )


def write_atomic(path: Path, content: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(content, encoding="utf-8")
    os.replace(tmp, path)


def write_pages(st: Status) -> list[Path]:
    """STATUS.md and status.html in the plan folder, each replaced whole."""
    paths = [st.plan / name for name in FILES]
    write_atomic(paths[0], markdown(st))
    write_atomic(paths[1], html(st))
    return paths


def refresh(plan: str | Path, env: dict[str, str], ask: bool = True, say=print) -> None:
    """Read the status and write its pages; any failure is one warning line, never an error:
    what calls it (`mlmclm submit`, the report job) has done its own work already."""
    try:
        write_pages(read_status(plan, env, ask=ask))
    except Exception as e:  # noqa: BLE001 - the status page must never break a submission
        say(f"warning: the status page was not refreshed ({type(e).__name__}: {e})")
