"""benchmarks.svg_plots: the report's bar and line charts, read back as XML and checked against their data."""

import math
import xml.etree.ElementTree as ET

import pytest

from benchmarks.svg_plots import PALETTE, bar_chart, line_chart, nice_ticks

SVG = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def texts(root: ET.Element) -> list[str]:
    return [t.text for t in root.iter(f"{SVG}text")]


def bars(root: ET.Element) -> list[ET.Element]:
    return [r for r in root.iter(f"{SVG}rect") if r.get("class") == "bar"]


def numbers(labels: list[str]) -> list[float]:
    found = []
    for label in labels:
        try:
            found.append(float(label.replace(",", "")))
        except ValueError:
            continue
    return found


def is_nice(step: float) -> bool:
    """1, 2 or 5 x 10^k."""
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    return any(math.isclose(mantissa, m) for m in (1, 2, 5))


@pytest.mark.parametrize(
    "lo, hi", [(0, 1234), (0, 7.3), (2.31, 2.35), (-3, 17), (0, 1e6), (5, 5), (0, 0), (0.0004, 0.0009)]
)
def test_ticks_are_evenly_nice_steps_that_cover_the_range(lo, hi):
    ticks, decimals = nice_ticks(lo, hi)
    assert ticks[0] <= lo and ticks[-1] >= hi and 3 <= len(ticks) <= 12
    steps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert all(math.isclose(s, steps[0]) for s in steps) and is_nice(steps[0])
    shown = [format(t, f".{decimals}f") for t in ticks]
    assert len(set(shown)) == len(shown) and all(math.isclose(float(s), t, abs_tol=1e-12) for s, t in zip(shown, ticks))


def test_ticks_are_exact_decimals():
    assert nice_ticks(0, 0.9)[0] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 1234) == ([0.0, 500.0, 1000.0, 1500.0], 0)


def test_bars_are_drawn_in_order_with_widths_proportional_to_their_values():
    data = [("fsdp", 1500.0), ("ddp", 1000.0), ("single", 250.0), ("idle", 0.0)]
    root = parse(bar_chart("Tokens/s", data, "tokens/s per device", ",.0f"))
    rects = bars(root)
    assert len(rects) == len(data)
    ys = [float(r.get("y")) for r in rects]
    assert ys == sorted(ys) and len(set(ys)) == len(ys)  # the first bar at the top
    widths = [float(r.get("width")) for r in rects]
    assert widths[0] > 0 and widths[3] == 0
    for width, (_, value) in zip(widths, data):
        assert width / widths[0] == pytest.approx(value / 1500.0, abs=1e-3)
    labels = texts(root)
    for name, shown in [("fsdp", "1,500"), ("ddp", "1,000"), ("single", "250"), ("idle", "0")]:
        assert name in labels and shown in labels
    assert "Tokens/s" in labels and "tokens/s per device" in labels


def test_the_bar_axis_starts_at_zero_and_its_ticks_reach_past_the_longest_bar():
    data = [("a", 730.0), ("b", 123.0)]
    root = parse(bar_chart("t", data, "x", ".1f"))
    tick_values = numbers([t for t in texts(root) if t not in ("730.0", "123.0")])
    assert tick_values[0] == 0 and tick_values[-1] >= 730 and is_nice(tick_values[1] - tick_values[0])
    # The longest bar spans the same fraction of the axis as its value of the last tick.
    grid = sorted(float(line.get("x1")) for line in root.iter(f"{SVG}line") if line.get("y1") != line.get("y2"))
    axis_left, last_tick = grid[0], grid[-1]
    width = float(bars(root)[0].get("width"))
    assert width / (last_tick - axis_left) == pytest.approx(730 / tick_values[-1], abs=1e-3)


def test_a_chart_grows_with_its_bars_and_a_single_bar_is_drawn():
    one = parse(bar_chart("t", [("only", 42.0)], "x", ".0f"))
    five = parse(bar_chart("t", [(str(i), 42.0) for i in range(5)], "x", ".0f"))
    assert float(five.get("height")) > float(one.get("height"))
    assert len(bars(one)) == 1 and float(bars(one)[0].get("width")) > 0
    assert len({r.get("width") for r in bars(five)}) == 1  # all equal
    zeros = parse(bar_chart("t", [("a", 0.0), ("b", 0.0)], "x", ".0f"))
    assert [float(r.get("width")) for r in bars(zeros)] == [0, 0]


def points(polyline: ET.Element) -> list[tuple[float, float]]:
    return [tuple(float(v) for v in pair.split(",")) for pair in polyline.get("points").split()]


def tick_labels(root: ET.Element, anchor: str, axis: str) -> list[tuple[float, float]]:
    """(value, SVG coordinate) of the numeric labels anchored so: "end" for y ticks, "middle" for x ticks."""
    found = []
    for t in root.iter(f"{SVG}text"):
        if t.get("text-anchor") == anchor and numbers([t.text]):
            found.append((numbers([t.text])[0], float(t.get(axis))))
    return sorted(found)


def calibration(ticks: list[tuple[float, float]]):
    """SVG coordinate -> data value, from the first and last tick."""
    (v0, c0), (v1, c1) = ticks[0], ticks[-1]
    return lambda c: v0 + (c - c0) * (v1 - v0) / (c1 - c0)


def test_a_line_chart_maps_each_series_monotonically_with_its_own_colour():
    series = [
        ("single", [(1, 10.5), (2, 8.0), (3, 6.25), (4, 5.5)]),
        ("ddp", [(1, 10.4), (2, 9.0), (4, 4.0)]),
        ("fsdp", [(2, 7.0)]),
    ]
    root = parse(line_chart("Training loss", series, "optimizer step", "train/loss"))
    lines = list(root.iter(f"{SVG}polyline"))
    assert len(lines) == len(series)
    assert [line.get("stroke") for line in lines] == PALETTE[:3]
    everything = [(x, y) for _, data in series for x, y in data]
    drawn = [p for line in lines for p in points(line)]
    assert len(drawn) == len(everything)
    for (x1, y1), (sx1, sy1) in zip(everything, drawn):
        for (x2, y2), (sx2, sy2) in zip(everything, drawn):
            if y1 > y2:
                assert sy1 < sy2  # SVG's y grows downwards
            if x1 > x2:
                assert sx1 > sx2
            if x1 == x2:
                assert sx1 == sx2
    # The drawn points lie inside the axes' frame.
    frame = next(r for r in root.iter(f"{SVG}rect") if r.get("fill") == "none")
    left, top = float(frame.get("x")), float(frame.get("y"))
    right, bottom = left + float(frame.get("width")), top + float(frame.get("height"))
    assert all(left <= x <= right and top < y < bottom for x, y in drawn)
    labels = texts(root)
    assert {"single", "ddp", "fsdp", "optimizer step", "train/loss", "Training loss"} <= set(labels)
    # Read back through the tick labels, every point is where its data say; the y axis is the data's range
    # with a margin, the x axis reaches from a tick at or before the first step to one at or after the last.
    yticks, xticks = tick_labels(root, "end", "y"), tick_labels(root, "middle", "x")
    for found in (yticks, xticks):
        steps = [b[0] - a[0] for a, b in zip(found, found[1:])]
        assert len(found) >= 3 and is_nice(steps[0]) and all(math.isclose(s, steps[0]) for s in steps)
    assert xticks[0][0] <= 1 and xticks[-1][0] >= 4
    to_y, to_x = calibration(yticks), calibration(xticks)
    for (x, y), (sx, sy) in zip(everything, drawn):
        assert to_x(sx) == pytest.approx(x, abs=0.01) and to_y(sy) == pytest.approx(y, abs=0.02)
    assert 10.5 < to_y(top) < 10.5 + 0.1 * 6.5 and 4.0 - 0.1 * 6.5 < to_y(bottom) < 4.0
    assert all(top <= c <= bottom for _, c in yticks)
    assert to_x(left) == pytest.approx(xticks[0][0], abs=0.01) and to_x(right) == pytest.approx(xticks[-1][0], abs=0.01)
    assert len(list(root.iter(f"{SVG}circle"))) == 1  # fsdp's single point, which a polyline would not show


def test_flat_and_single_point_series_and_non_finite_losses_are_drawn_without_error():
    root = parse(line_chart("t", [("flat", [(0, 3.0), (10, 3.0)]), ("dot", [(5, 3.0)])], "x", "y"))
    assert len(list(root.iter(f"{SVG}polyline"))) == 2
    root = parse(line_chart("t", [("stopped", [(1, 5.0), (2, float("nan")), (3, 4.0)])], "x", "y"))
    assert len(points(next(root.iter(f"{SVG}polyline")))) == 2
    assert "nan" not in ET.tostring(root, encoding="unicode")


def test_names_are_escaped():
    name = "a<b & c"
    bar = bar_chart(name, [(name, 1.0)], name, ".0f")  # title, bar and axis label
    line = line_chart(name, [(name, [(0, 1.0), (1, 2.0)])], name, name)  # title, both axes' labels, legend
    for svg, times in ((bar, 3), (line, 4)):
        assert "a&lt;b &amp; c" in svg and name not in svg
        assert texts(parse(svg)).count(name) == times


def test_the_same_data_give_the_same_bytes():
    data = [("x", 1.5), ("y", 2.5)]
    assert bar_chart("t", data, "x", ".2f") == bar_chart("t", list(data), "x", ".2f")
    series = [("a", [(0, 1.0), (1, 0.5)])]
    assert line_chart("t", series, "x", "y") == line_chart("t", [("a", [(0, 1.0), (1, 0.5)])], "x", "y")


def test_a_heat_map_draws_a_cell_per_positive_value_coloured_in_order_of_its_logarithm():
    from benchmarks.svg_plots import HEAT, heat_map

    rows, columns = ["embedding", "block0", "head"], [9, 19, 29]
    values = {(r, c): 10.0 ** (i + 3 * j - 4) for j, r in enumerate(rows) for i, c in enumerate(columns)}
    values[("head", 29)] = float("nan")  # not drawn
    root = parse(heat_map("ratios", rows, columns, values, "update ratio"))
    cells = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "cell"]
    assert len(cells) == 8
    # Placed by row (top down) and column (left to right); the colour follows the logarithm's rank from the
    # scale's pale end (the smallest value) to its dark end (the largest drawn).
    by_value = sorted(cells, key=lambda r: float(r.find(f"{SVG}title").text.rsplit(": ", 1)[1]))
    assert [(float(r.get("y")), float(r.get("x"))) for r in by_value] == sorted(
        (float(r.get("y")), float(r.get("x"))) for r in cells
    )
    assert by_value[0].get("fill") == "#{:02x}{:02x}{:02x}".format(*HEAT[0])
    assert by_value[-1].get("fill") == "#{:02x}{:02x}{:02x}".format(*HEAT[-1])
    darkness = [sum(int(r.get("fill")[i : i + 2], 16) for i in (1, 3, 5)) for r in by_value]
    assert darkness[0] > darkness[-1]
    assert "embedding" in texts(root) and "29" in texts(root)
