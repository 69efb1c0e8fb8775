"""A run's history: what decided each of its steps, kept in every checkpoint (`history`).

A checkpoint's config is the one its last segment ran with; a run resumed with another learning
rate, or with checkpoint.allow_data_change onto other data, trained its earlier steps otherwise.
The history says how: one event per segment of the run's steps, in order, each with the step it
starts at, what started it (`start`: fresh or from train.init_from; `resume`; `branch`: from
another run's checkpoint, whose own history comes before it; `phase N`: the phase schedule
entering phase N), the sample position its first step reads, and the settings in force from
there: the run's config, flattened (`settings`), and its data fingerprint (`data`, from
training/start/fingerprint.py), each given only where it changed since the event before (the first
event gives all of them; a phase event none: the config decides the phases), with the keys that are
gone since (`settings_removed`, `data_removed`: a section set to null, or a fingerprint key no
longer made). A resume that changed the data by checkpoint.allow_data_change names the keys it
changed (`data_changed`). A checkpoint saved before histories were kept reads as one `start` event
with its own config (`unrecorded`): what its steps trained with before its last resume is not known,
and a branch of it says so (`unrecorded_steps`).

training/start/branch.py compares a branch source's history, segment by segment, with the run the
branch would be from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_mlmclm.config import PhasePlan, RunConfig, to_dict
from megatron_mlmclm.training.start.fingerprint import same_value


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def unflat(settings: dict[str, Any]) -> dict[str, Any]:
    """flat's inverse (of keys that flat can have made together: no key is a section of another)."""
    tree: dict[str, Any] = {}
    for key, value in settings.items():
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return tree


def _apply(before: dict[str, Any], changed: dict[str, Any], removed: list[str]) -> dict[str, Any]:
    """The settings `before` updated by an event's: its removed keys dropped, its changed keys set,
    and any key that is a section of a changed key, or under one, dropped too (a null section that
    became a mapping, or the reverse, in a history saved before removals were recorded)."""
    out = {k: v for k, v in before.items() if k not in removed}
    for key in changed:
        for old in [k for k in out if key.startswith(k + ".") or k.startswith(key + ".")]:
            del out[old]
    return {**out, **changed}


@dataclass
class Segment:
    """Steps [start, end) of a run and what they trained with."""

    start: int
    end: int
    event: str  # what started it: start, resume or branch
    settings: dict[str, Any]  # the config, flattened
    data: dict[str, Any]  # the data fingerprint
    unrecorded: bool = False  # assumed from a checkpoint saved before histories were kept

    def config(self) -> dict[str, Any]:
        return unflat(self.settings)


def event(
    kind: str,
    step: int,
    position: int,
    cfg: RunConfig,
    fingerprint: dict[str, Any],
    before: list[dict[str, Any]],
) -> dict[str, Any]:
    """The event of a segment that `kind` starts at `step`, after the events `before`."""
    last = segments(before, step)[-1] if before else None
    settings, data = flat(to_dict(cfg)), dict(fingerprint)
    out: dict[str, Any] = {
        "step": step,
        "event": kind,
        "position": position,
        "settings": _changed(last.settings if last else {}, settings),
        "data": _changed(last.data if last else {}, data),
    }
    for what, now in (("settings", settings), ("data", data)):
        gone = sorted(set(getattr(last, what)) - set(now)) if last else []
        if gone:
            out[f"{what}_removed"] = gone
    changed = [k for k in data if last is not None and not same_value(last.data.get(k), data[k])]
    if kind == "resume" and changed:
        out["data_changed"] = changed  # checkpoint.allow_data_change let it through
    return out


def _changed(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in now.items() if k not in before or before[k] != v}


def unrecorded(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The history of a checkpoint saved before histories were kept: its own config from step 0."""
    return [
        {
            "step": 0,
            "event": "start",
            "position": 0,
            "settings": flat(state.get("config") or {}),
            "data": dict(state.get("data_fingerprint") or {}),
            "unrecorded": True,
        }
    ]


def of_checkpoint(state: dict[str, Any]) -> list[dict[str, Any]]:
    """A checkpoint's trainer state's history, up to its step."""
    return list(state.get("history") or unrecorded(state))


def phase_events(cfg: RunConfig, offset: int, start: int, end: int) -> list[dict[str, Any]]:
    """The phase changes of a run of `cfg` within steps (start, end), whose stream positions are
    offset by `offset` (a resume with allow_data_change)."""
    plan = PhasePlan.of(cfg)
    return [
        {"step": s, "event": f"phase {i}", "position": plan.position(s) + offset}
        for i, s in enumerate(plan.starts)
        if start < s < end and plan.index(s) == i
    ]


def segments(history: list[dict[str, Any]], end: int) -> list[Segment]:
    """The history's segments that begin before step `end` (the last one ends there), each with
    every setting in force; phase events start none."""
    out: list[Segment] = []
    settings: dict[str, Any] = {}
    data: dict[str, Any] = {}
    for e in history:
        if e["step"] >= end:
            break
        if "settings" not in e:  # a phase change
            continue
        settings = _apply(settings, e["settings"], e.get("settings_removed", []))
        data = _apply(data, e["data"], e.get("data_removed", []))
        if out:
            out[-1].end = e["step"]
        out.append(Segment(e["step"], end, e["event"], settings, data, bool(e.get("unrecorded"))))
    return out


def unrecorded_steps(history: list[dict[str, Any]], end: int) -> tuple[int, int] | None:
    """Steps [start, end) of the history's `unrecorded` segment, which a checkpoint saved before
    histories were kept stands for with its own config and data (what ran before its last resume
    is not known), or None when every segment before `end` was recorded."""
    return next(((s.start, s.end) for s in segments(history, end) if s.unrecorded), None)


def positions(history: list[dict[str, Any]], end: int) -> list[tuple[int, str, int]]:
    """(step, event, sample position) of every event before step `end`."""
    return [(e["step"], e["event"], e["position"]) for e in history if e["step"] < end]
