"""`kvtui faults`: the isolation fault catalogue as a table."""

from __future__ import annotations

from kvtui.cli.console import out
from kvtui.faults import DEFAULT_ISOLATION_OFF, FAULTS


def faults() -> None:
    """List the isolation faults, what each breaks, and the layouts and KV modes (slots, paged) it acts in."""
    from rich.table import Table

    table = Table(title="isolation faults (--fault NAME, timeline {fault: NAME, on: true}, dashboard key f)",
                  title_justify="left")
    for column in ("fault", "what it breaks", "layouts", "kv", "caught by"):
        table.add_column(column)
    for f in FAULTS.values():
        name = f.name + (" *" if f.name in DEFAULT_ISOLATION_OFF else "") + (" †" if f.scope == "server" else "")
        table.add_row(name, f.breaks, ", ".join(f.layouts), ", ".join(f.kv), ", ".join(f.caught_by))
    table.caption = ("* in the default set of --isolation off and the dashboard's i key; † acts in kvtui serve's "
                     "HTTP layer, not the engine: `kvtui serve --fault NAME`, caught by a --target run with request_ids")
    out.print(table)
