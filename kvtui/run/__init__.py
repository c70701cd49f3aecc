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

What the local Session (kvtui/session.py, the loop) drives, each module its own part:

- `clock.RunClock`: the virtual, paced or wall clock: pause, resume, the paced clock's hold to the wall;
- `engine_setup`: the EngineConfig, step-cost model, Engine and LoRA adapters a run starts with;
- `timeline.Timeline`: the scenario's timeline events, applied as the engine clock reaches them;
- `controls.Controls`: fault switches, arrival-rate changes and bursts (the dashboard's keys, the timeline);
- `step_events`: the events of one engine step and of a finished request.

Nothing here imports the dashboard, the server or the CLI; only `intake`, `engine_setup` and `timeline`
import the engine (the local Session's doorways to it, imported by it only).
"""
