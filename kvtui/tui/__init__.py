"""The live dashboard (Textual): `run_dashboard` for a scenario, `replay_dashboard` for a recording.

Modules: state (DashboardState fed by events) -> snapshot (frozen views) -> panels (pure render
functions) -> widgets/app (Textual). sources/live/replay say where events come from.
"""

from kvtui.tui.launch import replay_dashboard, run_dashboard

__all__ = ["replay_dashboard", "run_dashboard"]
