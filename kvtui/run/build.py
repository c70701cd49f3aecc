"""The events every run writes about itself and its requests, built one way for a local and a target run.

A field both kinds of run know (the tenant, the passphrase and whether the answer echoed it, the
reference skips by reason) is filled here, so the two cannot drift apart.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Mapping

import kvtui
from kvtui.events import Arrive, Finish, Header, Marker, ModelInfo, ReferenceStatus


def run_header(scenario, *, model: ModelInfo, engine: dict, clock: str, detectors: tuple[str, ...],
               measured: tuple[str, ...], modeled: tuple[str, ...] = (), cost_model: dict | None = None,
               target: str | None = None, reference_tolerance: dict | None = None) -> Header:
    """The recording's first line: the versions that made it, the scenario (normalized, its hash and
    seed) and what the caller says of the model, the engine (or the server's options) and the clock."""
    import torch  # here: a target run loads no model, and its CLI should not wait for torch before it must
    import transformers

    return Header(
        kvtui_version=kvtui.__version__, created_unix_s=time.time(), python=platform.python_version(),
        torch=torch.__version__, transformers=transformers.__version__, scenario=scenario.normalized(),
        scenario_hash=scenario.content_hash(), seed=scenario.seed, model=model, engine=engine, clock=clock,
        detectors=tuple(detectors), measured=measured, modeled=modeled, cost_model=cost_model, target=target,
        reference_tolerance=reference_tolerance)


def arrive_event(planned, *, max_new_tokens: int | None = None, parent: str | None = None,
                 lora_version: int | None = None) -> Arrive:
    """The request.arrive event of a planned request (kvtui.request.PlannedRequest) at its arrival_s.

    Args:
        max_new_tokens: the limit the request runs under when it is not the plan's (a local engine
            may cap it, `on_too_long: cap`); None: the plan's.
        parent: parallel sampling (n > 1): the planned request this sequence is one of.
        lora_version: the version of its LoRA adapter it runs under (None: the base model, or not known)."""
    return Arrive(t=planned.arrival_s, request_id=planned.request_id, prompt_len=len(planned.prompt_ids),
                  max_new_tokens=planned.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens,
                  passphrase=planned.passphrase, tenant=planned.tenant, parent=parent,
                  sampling=tuple(getattr(planned.sampling, "state_tags", ())), audio=planned.audio_label,
                  image=planned.image_label, client_id=planned.client_id.value if planned.client_id is not None else None,
                  lora=planned.adapter, lora_version=lora_version)


def finish_event(request, *, text: str = "", passphrase: bool = True, **fields) -> Finish:
    """The request.finish event of `request` (a kvtui.request.PlannedRequest, or anything with a
    request_id and a tenant: a request the run knows no plan of has no canary) whose answer is `text`;
    the passphrase comes from its canary and `passphrase_echoed` says whether the answer holds it.

    Args:
        passphrase: False leaves the passphrase out (a request refused before it ran is no canary).
        fields: the other Finish fields (t, finish_reason, times, token ids, ...).
    """
    canary = getattr(request, "canary", None) if passphrase else None
    phrase = canary.passphrase if canary is not None else None
    return Finish(request_id=request.request_id, tenant=request.tenant, output_text=text, passphrase=phrase,
                  passphrase_echoed=_echoed(phrase, text, canary.spoken) if phrase else None, **fields)


def _echoed(phrase: str, text: str, spoken: bool) -> bool:
    """Whether the answer holds its own passphrase, in any case (an image's word comes back as written,
    "copper"), or for a spoken one (a transcript) every word and the number (kvtui.detect.spoken.match_spoken)."""
    if spoken:
        from kvtui.detect.spoken import match_spoken

        return match_spoken(phrase, text).complete
    return phrase.upper() in text.upper()


def reference_status(t: float, *, checked: int, skipped_by_reason: Mapping[str, int], pending: int,
                     cached: int | None = None, uncached_verified: int | None = None) -> ReferenceStatus:
    """A reference.status event: requests checked, left unchecked by reason (kvtui.events.SkipReason,
    recorded as its string; reasons counted 0 are left out), still waiting; `cached`/`uncached_verified`
    for a target run."""
    skips = {str(reason): n for reason, n in sorted(skipped_by_reason.items()) if n}
    return ReferenceStatus(t=t, checked=checked, skipped=sum(skips.values()), pending=pending,
                           skipped_by_reason=skips, cached=cached, uncached_verified=uncached_verified)


SESSIONS_LOCAL = ("sessions: a local run sends each session's first turn only; its later turns carry the server's "
                  "real answers and need `kvtui run --target` (docs/loadgen.md)")


def sessions_markers(scenario) -> list[Marker]:
    """A local run's note at its start when the scenario has `sessions` (SESSIONS_LOCAL), else none."""
    return [Marker(t=0.0, text=SESSIONS_LOCAL)] if getattr(scenario, "sessions", None) is not None else []
