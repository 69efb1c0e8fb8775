"""Two small plots as inline SVG, for the status page (status_page.py): horizontal stacked bars
with an optional marker per row, and line curves. The standard library only; no script, nothing
fetched: the page stays one static file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

FONT = 'font-family="DejaVu Sans, Arial, sans-serif" font-size="11"'
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
GRID = "#e0e0e0"


@dataclass(frozen=True)
class Segment:
    name: str  # the legend's (a bar's hover text says it with the value)
    colour: str


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]: steps of 1, 2 or 5 x 10^k, from a multiple of the
    step at or below `low`."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [0.0, 1.0]
    if not high - low > 1e-9 * max(abs(low), abs(high), 1e-300):  # one value: a span around it
        pad = 0.1 * abs(low) if abs(low) > 1e-200 else 1.0
        low, high = low - pad, high + pad
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    start = math.floor(low / step + 1e-9) * step
    return [start + i * step for i in range(math.ceil((high - start) / step - 1e-9) + 1)]


def fmt(v: float) -> str:
    if v == 0:
        return "0"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def text(x: float, y: float, words: str, anchor: str = "start", extra: str = "") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" {FONT} text-anchor="{anchor}"{extra}>{escape(words)}</text>'
    )


def line(x1: float, y1: float, x2: float, y2: float, colour: str = GRID, width: int = 1) -> str:
    return (
        f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{colour}" '
        f'stroke-width="{width}"/>'
    )


def rect(x: float, y: float, w: float, h: float, colour: str, title: str = "") -> str:
    hover = f"<title>{escape(title)}</title>" if title else ""
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{colour}">'
        f"{hover}</rect>"
    )


def frame(title: str, width: int, height: int) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
        rect(0, 0, width, height, "#ffffff"),
        text(4, 16, title, extra=' font-weight="bold"'),
    ]


def legend(items: list[tuple[str, str]], x: float, y: float, lines: bool = False) -> list[str]:
    out = []
    for name, colour in items:
        mark = line(x, y - 4, x + 14, y - 4, colour, 2) if lines else rect(x, y - 9, 12, 10, colour)
        out += [mark, text(x + 18, y, name)]
        x += 30 + 7 * len(name)
    return out


def bars(
    title: str,
    rows: list[tuple[str, list[float], float | None]],
    segments: list[Segment],
    unit: str,
    marker: str | None = None,
    width: int = 1180,
) -> str:
    """One row per (label, values, mark): the values stacked left to right in the segments'
    colours, the mark (e.g. the plan's price) as a black tick named `marker`; an x axis in
    `unit`."""
    label_w = min(320, 12 + 7 * max((len(r[0]) for r in rows), default=4))
    plot_w, row_h, top = width - label_w - 30, 16, 44
    height = top + row_h * max(len(rows), 1) + 34
    high = max([sum(v) for _, v, _ in rows] + [m or 0.0 for _, _, m in rows] + [0.0])
    axis = ticks(0.0, high) if high > 0 else [0.0, 1.0]
    scale = plot_w / axis[-1]
    out = frame(title, width, height)
    out += legend([(s.name, s.colour) for s in segments], label_w, 34)
    if marker:
        x = label_w + 40 + sum(30 + 7 * len(s.name) for s in segments)
        out += [line(x, 26, x, 36, "#000000", 2), text(x + 6, 34, marker)]
    for t in axis:
        x = label_w + t * scale
        out += [line(x, top - 4, x, height - 30), text(x, height - 16, fmt(t), "middle")]
    out.append(text(label_w + plot_w / 2, height - 3, unit, "middle"))
    for i, (label, values, mark) in enumerate(rows):
        y = top + i * row_h
        out.append(text(label_w - 6, y + 11, label, "end"))
        x = float(label_w)
        for v, seg in zip(values, segments):
            if v > 0:
                out.append(rect(x, y + 2, v * scale, row_h - 4, seg.colour,
                                f"{label}: {seg.name} {fmt(v)} {unit}"))  # fmt: skip
                x += v * scale
        if mark is not None:
            mx = label_w + mark * scale
            out.append(line(mx, y, mx, y + row_h, "#000000", 2))
            out.append(rect(mx - 3, y, 6, row_h, "none", f"{label}: {marker} {fmt(mark)} {unit}"))
    out.append("</svg>")
    return "\n".join(out)


def curves(
    title: str,
    series: list[tuple[str, list[tuple[float, float]]]],
    x_label: str,
    y_label: str,
    width: int = 1180,
    height: int = 320,
) -> str:
    """Curves (label, [(x, y)]) on shared axes: x from 0, y around the values."""
    points = [p for _, ps in series for p in ps]
    if not points:
        return "\n".join([*frame(title, width, 28), "</svg>"])
    out = frame(title, width, height)
    left, right, top, bottom = 60, 20, 44, 40
    pw, ph = width - left - right, height - top - bottom
    ys = [y for _, y in points]
    xs, yt = ticks(0.0, max(x for x, _ in points)), ticks(min(ys), max(ys))

    def at(x: float, y: float) -> tuple[float, float]:
        return left + x / xs[-1] * pw, top + ph - (y - yt[0]) / (yt[-1] - yt[0]) * ph

    colours = [PALETTE[i % len(PALETTE)] for i in range(len(series))]
    out += legend([(name, c) for (name, _), c in zip(series, colours)], left, 34, lines=True)
    for t in xs:
        x = at(t, yt[0])[0]
        out += [line(x, top, x, top + ph), text(x, top + ph + 14, fmt(t), "middle")]
    for t in yt:
        y = at(0, t)[1]
        out += [line(left, y, left + pw, y), text(left - 4, y + 4, fmt(t), "end")]
    out.append(text(left + pw / 2, height - 6, x_label, "middle"))
    mid = top + ph / 2
    out.append(text(12, mid, y_label, "middle", f' transform="rotate(-90 12 {mid:.1f})"'))
    for (name, ps), colour in zip(series, colours):
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (at(*p) for p in ps))
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2">'
            f"<title>{escape(name)}</title></polyline>"
        )
        if len(ps) == 1:  # one step logged: a dot
            x, y = at(*ps[0])
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')
    out.append("</svg>")
    return "\n".join(out)
