"""The run spine: what every run of a scenario shares, whichever engine answers it.

A local run (kvtui/session.py: kvtui's own engine) and a target run (kvtui/remote/session.py: a remote
OpenAI-compatible server) differ in how requests are answered, not in what a run is made of:

- `base.RunBase`: the half of a session both kinds share over the sink (its properties, `emit`, the
  header then the watched recording, reference.status, the one closing path);
- `sink.RunSink`: where every event goes (the findings join, the recording, the metrics, listeners);
- `build`: the Header, Arrive, Finish and ReferenceStatus events, filled the same way for both;
- `outcome.RunOutcome`: what a finished run tells (its findings, fault history, whether its faults are
  known, its summary), and `outcome.verdict`, the exit code the scenario's `expect` gives it;
- `noninterference`: the noninterference audit over either kind of run;
- the requests all of them take are kvtui.request.PlannedRequest (a room of its own below the scenario,
  which builds them);
- `intake`: where a PlannedRequest becomes a request of kvtui's own engine (local runs and serve only).

Nothing here imports the engine, the dashboard, the server or the CLI, but `intake` (the engine's
doorway, imported by the local Session only).
"""
