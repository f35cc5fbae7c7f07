"""Bar and line charts and heat maps as SVG text, with the standard library alone.

The report's plots (bars, lines, and heat maps of per-layer numerics) are all this project draws. matplotlib drew
them before, but with it installed torchmetrics (which lightning imports) loads matplotlib.pyplot at import time:
about half a second of every process start (measured again on 2026-12-04: docs/developers.md). The output is a
pure function of the input (no dates, no random ids), so a report made again is the same bytes.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

WIDTH = 750
CHAR = 7.0  # the mean advance of a 12 px sans-serif character: room for labels without measuring fonts
ROW = 24  # a bar's row, and the height it adds to a bar chart
GRID, AXIS, BAR = "#dddddd", "#333333", "#1f77b4"
# matplotlib's tab10, so the loss curves keep the colours they had
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def nice_ticks(lo: float, hi: float, count: int = 5) -> tuple[list[float], int]:
    """Ticks 1, 2 or 5 x 10^k apart, about `count` intervals, the first <= lo and the last >= hi; and the
    decimals that show them exactly."""
    if hi <= lo:  # a single value: a range around it
        half = abs(lo) * 0.1 or 1.0
        lo, hi = lo - half, hi + half
    raw = (hi - lo) / count
    exponent = math.floor(math.log10(raw))
    m = next(m for m in (1, 2, 5, 10) if m * 10.0**exponent >= raw)
    if m == 10:
        m, exponent = 1, exponent + 1
    step = m * 10.0**exponent
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    # i * m / 10^-k rather than i * step: 3 * 0.1 is 0.30000000000000004, 3 / 10 is 0.3
    ticks = [float(i * m * 10**exponent if exponent >= 0 else i * m / 10**-exponent) for i in range(first, last + 1)]
    return ticks, max(0, -exponent)


def text(x: float, y: float, content: str, anchor: str = "start", extra: str = "") -> str:
    # dy shifts the baseline down so that y is the text's middle, as dominant-baseline would, but everywhere
    return f'<text x="{x:.1f}" y="{y:.1f}" dy="0.35em" text-anchor="{anchor}"{extra}>{escape(content)}</text>'


def line(x1: float, y1: float, x2: float, y2: float, colour: str, width: float = 1) -> str:
    return f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{colour}" stroke-width="{width}"/>'


def document(width: float, height: float, title: str, body: list[str]) -> str:
    # A white ground: GitHub's dark mode would otherwise show dark text on a dark page.
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="12">',
        f'<rect class="ground" width="{width:.0f}" height="{height:.0f}" fill="white"/>',
        text(width / 2, 16, title, "middle", ' font-size="14"'),
    ]
    return "\n".join(head + body + ["</svg>"]) + "\n"


def x_axis(ticks: list[float], decimals: int, to_x, top: float, bottom: float, label: str, mid: float) -> list[str]:
    """Vertical grid lines with their tick labels under the plot, and the axis label under those."""
    parts = []
    for t in ticks:
        parts.append(line(to_x(t), top, to_x(t), bottom, GRID))
        parts.append(text(to_x(t), bottom + 12, format(t, f",.{decimals}f"), "middle"))
    return parts + [text(mid, bottom + 32, label, "middle")]


def bar_chart(title: str, bars: list[tuple[str, float]], xlabel: str, number_format: str) -> str:
    """Horizontal bars from 0 (values >= 0), the first at the top, each with its value at its end."""
    values = [format(value, number_format) for _, value in bars]
    left = 16 + CHAR * max(len(name) for name, _ in bars)
    right = 16 + CHAR * max(len(v) for v in values)
    width = max(WIDTH, left + 300 + right)  # names too long for 750 px widen the chart rather than overlap
    top, bottom = 32, 32 + ROW * len(bars)
    ticks, decimals = nice_ticks(0, max(value for _, value in bars) or 1)
    scale = (width - left - right) / ticks[-1]
    body = x_axis(ticks, decimals, lambda v: left + v * scale, top, bottom, xlabel, (left + width - right) / 2)
    for row, ((name, value), shown) in enumerate(zip(bars, values)):
        middle = top + ROW * (row + 0.5)
        body.append(
            f'<rect class="bar" x="{left:.1f}" y="{middle - 8:.1f}" width="{value * scale:.2f}" '
            f'height="16" fill="{BAR}"/>'
        )
        body.append(text(left - 6, middle, name, "end"))
        body.append(text(left + value * scale + 4, middle, shown))
    body.append(line(left, top, left, bottom, AXIS))
    body.append(line(left, bottom, width - right, bottom, AXIS))
    return document(width, bottom + 48, title, body)


def line_chart(title: str, series: list[tuple[str, list[tuple[float, float]]]], xlabel: str, ylabel: str) -> str:
    """A polyline per series over nice ticks on both axes, with a legend under the plot."""
    # A NaN or infinite loss (a run stopped for it) has no place on the axes: left out, its neighbours joined.
    series = [(name, [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]) for name, points in series]
    xs = [x for _, points in series for x, _ in points] or [0.0]
    ys = [y for _, points in series for _, y in points] or [0.0]
    # y: the data's range and a margin, so the curves fill the height; x: out to nice ticks, as steps mostly are
    margin = (max(ys) - min(ys)) * 0.05 or abs(ys[0]) * 0.1 or 1.0
    ylo, yhi = min(ys) - margin, max(ys) + margin
    yticks, ydecimals = nice_ticks(ylo, yhi, 6)
    yticks = [t for t in yticks if ylo <= t <= yhi]  # at least two: a step is at most 2.5 x a sixth of the range
    xticks, xdecimals = nice_ticks(min(xs), max(xs))
    ylabels = [format(t, f",.{ydecimals}f") for t in yticks]
    left, right = 36 + CHAR * max(len(label) for label in ylabels), 24
    top, bottom = 32, 332

    def to_x(x: float) -> float:
        return left + (x - xticks[0]) / (xticks[-1] - xticks[0]) * (WIDTH - left - right)

    def to_y(y: float) -> float:  # SVG's y grows downwards
        return bottom - (y - ylo) / (yhi - ylo) * (bottom - top)

    body = x_axis(xticks, xdecimals, to_x, top, bottom, xlabel, (left + WIDTH - right) / 2)
    for t, shown in zip(yticks, ylabels):
        body.append(line(left, to_y(t), WIDTH - right, to_y(t), GRID))
        body.append(text(left - 6, to_y(t), shown, "end"))
    middle = (top + bottom) / 2
    body.append(text(14, middle, ylabel, "middle", f' transform="rotate(-90 14 {middle:.1f})"'))
    body.append(
        f'<rect x="{left:.1f}" y="{top}" width="{WIDTH - left - right:.1f}" height="{bottom - top}" '
        f'fill="none" stroke="{AXIS}"/>'
    )
    legend = bottom + 56
    for i, (name, points) in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        coordinates = " ".join(f"{to_x(x):.1f},{to_y(y):.1f}" for x, y in points)
        body.append(f'<polyline points="{coordinates}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        if len(points) == 1:  # a polyline of one point draws nothing: a dot instead
            body.append(f'<circle cx="{to_x(points[0][0]):.1f}" cy="{to_y(points[0][1]):.1f}" r="3" fill="{colour}"/>')
        y = legend + 18 * i
        body.append(line(left, y, left + 24, y, colour, 2))
        body.append(text(left + 30, y, name))
    return document(WIDTH, legend + 18 * len(series), title, body)


# A sequential scale from pale to dark (viridis' ends and middle), for values on a log axis.
HEAT = [(253, 231, 37), (94, 201, 98), (33, 145, 140), (59, 82, 139), (68, 1, 84)]


def heat_colour(fraction: float) -> str:
    """The colour at `fraction` (0: the smallest value, 1: the largest) of HEAT, linearly between its stops."""
    position = min(max(fraction, 0.0), 1.0) * (len(HEAT) - 1)
    i = min(int(position), len(HEAT) - 2)
    a, b, t = HEAT[i], HEAT[i + 1], position - i
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(a, b))


def heat_map(title: str, rows: list[str], columns: list[int], values: dict[tuple[str, int], float], label: str) -> str:
    """A cell per (row, column) coloured by log10 of its value (positive, finite; others left blank), the first
    row at the top; a colour bar with the scale's ends under it."""
    shown = [v for v in values.values() if math.isfinite(v) and v > 0]
    lo, hi = (math.log10(min(shown)), math.log10(max(shown))) if shown else (0.0, 1.0)
    span = hi - lo or 1.0
    left = 16 + CHAR * max(len(r) for r in rows)
    top, cell_height = 32, 16
    cell_width = max(4.0, min(40.0, (WIDTH - left - 24) / max(1, len(columns))))
    bottom = top + cell_height * len(rows)
    body = []
    for r, row in enumerate(rows):
        body.append(text(left - 6, top + cell_height * (r + 0.5), row, "end"))
        for c, column in enumerate(columns):
            value = values.get((row, column))
            if value is None or not math.isfinite(value) or value <= 0:
                continue
            colour = heat_colour((math.log10(value) - lo) / span)
            body.append(
                f'<rect class="cell" x="{left + c * cell_width:.1f}" y="{top + r * cell_height:.1f}" '
                f'width="{cell_width:.2f}" height="{cell_height}" fill="{colour}"><title>{escape(row)}, step '
                f"{column}: {value:.4g}</title></rect>"
            )
    # Step labels under the columns, about eight of them.
    every = max(1, math.ceil(len(columns) / 8))
    for c in range(0, len(columns), every):
        body.append(text(left + (c + 0.5) * cell_width, bottom + 12, str(columns[c]), "middle"))
    right = left + cell_width * len(columns)
    body.append(text((left + right) / 2, bottom + 30, "optimizer step", "middle"))
    bar_top = bottom + 48
    for i in range(100):
        body.append(f'<rect x="{left + i * 2:.1f}" y="{bar_top}" width="2" height="10" fill="{heat_colour(i / 99)}"/>')
    body.append(text(left, bar_top + 22, f"{10**lo:.3g}", "middle"))
    body.append(text(left + 200, bar_top + 22, f"{10**hi:.3g}", "middle"))
    body.append(text(left + 212, bar_top + 5, f"{label} (log scale)"))
    return document(max(WIDTH, right + 24), bar_top + 40, title, body)
