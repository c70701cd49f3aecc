"""Drawing helpers the panels share: the request palette, sparklines, bars, milliseconds, text made safe
for one cell per character. Pure functions on plain values, no snapshot and no Textual; both panel
modules (panels.py for kvtui's engine, server_panels.py for a target server) import them from here."""

from __future__ import annotations

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2",
           "#ff9da7", "#9c755f", "#8cd17d", "#a0cbe8", "#d4a6c8", "#86bcb6")
SPARKS = "▁▂▃▄▅▆▇█"
EIGHTHS = " ▏▎▍▌▋▊▉█"
# Reds bright enough to stay readable when NO_COLOR turns the screen to greys by luminance.
RED = "#ff6060"
LEAK_STYLE = "bold #ffffff on #c00000"
_CONTROL = {c: "·" for c in (*range(32), 127) if c != 10}


def color(index: int) -> str:
    """The palette colour of a request's colour index (grey for -1)."""
    return PALETTE[index % len(PALETTE)] if index >= 0 else "grey50"


def clean(text: str) -> str:
    """Text safe for one terminal cell per character: control characters as ·, newlines as ⏎."""
    return text.translate(_CONTROL).replace("\n", "⏎")


def sparkline(values, width: int, top: float | None = None) -> str:
    """The last `width` values as ▁..█ blocks scaled to `top` (default: their maximum); '' for none."""
    values = list(values)[-width:] if width > 0 else []
    if not values:
        return ""
    top = top if top is not None else max(values)
    if top <= 0:
        return SPARKS[0] * len(values)
    return "".join(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))] if v > 0 else " "
                   for v in values)


def bar(fraction: float, width: int) -> str:
    """A horizontal bar `width` cells wide filled to `fraction` (0..1) with eighth blocks."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (EIGHTHS[part] if part else "")).ljust(width)[:width]


def ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds ("42 ms"), "-" for None."""
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
