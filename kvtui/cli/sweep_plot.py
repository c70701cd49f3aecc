"""The pictures of `kvtui sweep`: throughput vs latency and goodput vs rate, drawn in the terminal
(plotext) and written to a file (matplotlib: SVG with its text kept as text, or PNG). Both libraries are
the optional extra `kvtui[plot]`."""

from __future__ import annotations

from pathlib import Path

PLOT_EXTRA = "pip install 'kvtui[plot]'"
LATENCY_TITLE = "Throughput vs latency"
GOODPUT_TITLE = "Goodput vs rate"
THROUGHPUT_AXIS = "throughput (output tok/s)"
LATENCY_AXIS = "TTFT (ms)"
RATE_AXIS = "rate asked (req/s)"
GOODPUT_AXIS = "req/s"
FILE_SUFFIXES = (".svg", ".png")


def missing(module: str) -> bool:
    """`module` cannot be imported (the plot extra is not installed)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        return True
    return False


def _ms(value: float | None) -> float:
    return value * 1000 if value is not None else float("nan")


def _series(points):
    ordered = sorted(points, key=lambda p: p.rate)
    return (ordered, [p.output_tok_s for p in ordered], [_ms(p.ttft_p50_s) for p in ordered],
            [_ms(p.ttft_p99_s) for p in ordered], [p.rate for p in ordered], [p.goodput for p in ordered],
            [p.achieved if p.achieved is not None else float("nan") for p in ordered])


def terminal_plot(points, knee, *, width: int = 100, height: int = 18, color: bool = True) -> str:
    """The two panels as terminal text (plotext 6): TTFT p50 / p99 (ms) against throughput (output tok/s),
    each point a rate; goodput and the achieved rate (req/s) against the rate asked, the knee a vertical
    line. `color` False: no ANSI codes (a pipe or a file)."""
    import plotext

    ordered, tput, p50, p99, rates, goodput, achieved = _series(points)
    fig = plotext.figure
    fig.clear()
    fig.plot_size(width, height)
    fig.subplots(1, 2)
    panels = ((fig.subplot(1, 1), LATENCY_TITLE, THROUGHPUT_AXIS, "ms",
               ((tput, p50, "TTFT p50"), (tput, p99, "TTFT p99"))),
              (fig.subplot(1, 2), GOODPUT_TITLE, RATE_AXIS, GOODPUT_AXIS,
               ((rates, goodput, "goodput"), (rates, achieved, "achieved"))))
    for panel, title, x_axis, y_axis, series in panels:
        panel.title(title)
        panel.label(x_axis, "x")
        panel.label(y_axis, "y")
        for xs, ys, name in series:
            kept = [(x, y) for x, y in zip(xs, ys) if y == y]  # NaN: no value at that rate
            if kept:
                panel.draw(panel.signal([x for x, _ in kept], [y for _, y in kept]).label(name).lines())
    if knee is not None and len(rates) > 1:
        fig.subplot(1, 2).line(knee.rate, "v")
    text = fig.build().string(colorless=not color)
    fig.clear()
    return text


def write_plot(points, knee, path: Path, *, title: str = "") -> None:
    """The two panels as an SVG (text kept as <text> elements) or PNG file at `path`, by its suffix.

    Raises:
        ValueError: a suffix other than .svg or .png. OSError: the file cannot be written.
    """
    if path.suffix.lower() not in FILE_SUFFIXES:
        raise ValueError(f"--plot {path}: give a .svg or .png file")
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot

    ordered, tput, p50, p99, rates, goodput, achieved = _series(points)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvtui"}):
        fig, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4.2))
        try:
            left.plot(tput, p50, "o-", label="TTFT p50")
            left.plot(tput, p99, "s--", label="TTFT p99")
            for p, x, y in zip(ordered, tput, p99):
                left.annotate(f"{p.rate:g}/s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            left.set_title(LATENCY_TITLE)
            left.set_xlabel(THROUGHPUT_AXIS)
            left.set_ylabel(LATENCY_AXIS)
            left.legend()
            right.plot(rates, goodput, "o-", label="goodput (within the SLO)")
            right.plot(rates, achieved, "s--", label="achieved rate")
            right.plot(rates, rates, ":", color="grey", label="rate asked")
            if knee is not None:
                right.axvline(knee.rate, color="red", linestyle="-.", label=f"knee {knee.rate:g} req/s")
            if len(rates) > 1 and rates[-1] >= 4 * rates[0]:  # doubling rates: evenly spaced on a log axis
                right.set_xscale("log", base=2)
            right.set_title(GOODPUT_TITLE)
            right.set_xlabel(RATE_AXIS)
            right.set_ylabel(GOODPUT_AXIS)
            right.legend()
            if title:
                fig.suptitle(title)
            fig.tight_layout()
            fig.savefig(path, format=path.suffix.lower().lstrip("."), metadata={"Date": None} if
                        path.suffix.lower() == ".svg" else None)
        finally:
            pyplot.close(fig)
