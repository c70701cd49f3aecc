"""The timeline panel (key `t`): one line per request, one column per engine step, the newest step at the
right edge; replay's seek keys and `n` move it with the playhead. A pure function of the snapshot's lanes
(kvtui/tui/lanes.py says what each mark means)."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvtui.tui.draw import LEAK_STYLE, RED, color
from kvtui.tui.snapshot import Snapshot

LABEL = 6  # "r012  "
STYLES = {"!": LEAK_STYLE, "*": f"bold {RED}", "x": "bold reverse", "T": "bold underline", "h": "bold",
          "·": "dim", "|": "dim"}
LEGEND = ("· queued  P prefill  = decode  h prefix hit  T tier restore", "x preempted  ! fault acted  * finding  | end")


def _axis(first: int, span: int) -> Text:
    """Step numbers every 10 steps over `span` columns starting at step `first`."""
    line = [" "] * span
    for col in range(span):
        step = first + col
        if step % 10 == 0:
            label = str(step)
            if col + len(label) <= span:
                line[col:col + len(label)] = label
    return Text(" " * LABEL + "".join(line), style="dim")


def timelines(snap: Snapshot, width: int, height: int) -> Group | Text:
    """The lanes of the requests seen in the last `width - LABEL` steps (the latest arrivals where they are
    more than the height holds), under a step axis, over a legend."""
    if snap.server is not None:
        return Text("timelines show kvtui's own engine steps (a target server's are not visible)", style="dim")
    if not snap.lanes or snap.step < 0:
        return Text("no steps yet", style="dim")
    span = max(width - LABEL, 1)
    first = max(snap.step - span + 1, 0)
    one = "  ".join(LEGEND)
    legend = [Text(one, style="dim")] if len(one) <= width else [Text(part[:width], style="dim") for part in LEGEND]
    lanes = [lane for lane in snap.lanes if lane.marks and lane.marks[-1][0] >= first]
    lanes = lanes[-max(height - 1 - len(legend), 1):]
    lines = [_axis(first, span)]
    for lane in lanes:
        line = Text(f"{lane.request_id:<{LABEL - 1}} ", style=f"bold {color(lane.color)}")
        marks = dict(lane.marks)
        for step in range(first, first + span):
            char = marks.get(step)
            if char is None:
                line.append(" ")
            else:
                line.append(char, style=STYLES.get(char, color(lane.color)))
        line.truncate(width)
        lines.append(line)
    return Group(*lines, *legend)
