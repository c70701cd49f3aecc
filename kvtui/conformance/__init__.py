"""`kvtui conformance`: every black-box isolation audit kvtui has, against one server, as one table.

Each check (one class of isolation property) sends its own requests and says pass, fail, or n/a with
the reason, what it sent, the figures and the evidence. CHECKS lists them in the order they run; the
request-id check runs last, because a server that keys its work by the client's x-request-id may stop
serving after it. `run_checks` runs some of them; kvtui/conformance/report.py prints and writes the
table; kvtui/conformance/local.py starts a `kvtui serve` to check kvtui's own engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtui.conformance.adapters import adapters
from kvtui.conformance.api_checks import parallel_sampling, structured_output
from kvtui.conformance.base import CheckResult, Server
from kvtui.conformance.images import images
from kvtui.conformance.load_checks import prompt_cache, prompt_embeds, request_ids, solo_parity
from kvtui.conformance.recurrent import recurrent_state
from kvtui.conformance.salts import tenant_salts


@dataclass(frozen=True)
class Check:
    """One conformance check: `name` (`--check NAME`), `summary` (one line for `--list`), `mutant` (the
    kvtui serve fault that must fail it and only it; None: none), `run`, `model` (kvtui's model the mutants
    need: `kvtui conformance --model MODEL --fault NAME`), `more_mutants` (further faults that must fail it
    and only it). Two of recurrent_state's four fail more: `state_slot_not_reset` (every request starts from
    its slot's last owner's state) also fails solo_parity and prompt_cache, and `state_index_units` (every
    prefix hit restores the wrong checkpoint) prompt_cache, whose answers through the cache then differ too
    (docs/conformance.md)."""

    name: str
    summary: str
    mutant: str | None
    run: Callable[[Server], CheckResult]
    model: str = "default"
    more_mutants: tuple[str, ...] = ()

    @property
    def mutants(self) -> tuple[str, ...]:
        """Every fault that must fail this check and only it."""
        return ((self.mutant,) if self.mutant else ()) + self.more_mutants


CHECKS: dict[str, Check] = {c.name: c for c in (
    Check("tenant_salts", "a tenant with another cache_salt cannot read (or time) another tenant's cached prefix",
          "unsalted_prefix", tenant_salts),
    Check("solo_parity", "greedy answers under concurrent load equal each request's solo run",
          "shared_position_offset", solo_parity),
    Check("parallel_sampling", "the n choices of one request equal n separate requests seeded seed + i",
          "cow_missing", parallel_sampling),
    Check("structured_output", "JSON-schema requests do not restrict the plain requests batched beside them",
          "stale_bitmask", structured_output),
    Check("prompt_embeds", "prompts sent as embedding rows are cached by their rows, not their placeholder ids",
          "embeds_unkeyed", prompt_embeds),
    Check("images", "one text with different pictures: every answer is its own picture's (solo, through the prefix "
          "cache, at once, under one reused image uuid)", "mm_hash_missing", images, model="dinov2-smollm2",
          more_mutants=("mm_uuid_trusted", "stale_image_embedding")),
    Check("prompt_cache", "conversations sharing text after their own passphrase get only their own state "
          "from the prompt cache", "prefix_key_no_parent", prompt_cache),
    Check("recurrent_state", "a request's state (a hybrid's recurrent state, or KV) is its own across turns, a "
          "cancelled prefill and its retry, tier restores and slot reuse", "state_published_before_write",
          recurrent_state, model="tiny-qwen35moe",
          more_mutants=("tier_drops_recurrent_state", "state_slot_not_reset", "state_index_units")),
    Check("adapters", "two LoRA adapters and the base model on one prompt, one at a time through the cache and at "
          "once, each answer its own solo run's (and a reloaded adapter's its new weights')", "lora_unkeyed_prefix",
          adapters, more_mutants=("lora_reload_stale",)),
    Check("request_ids", "two clients sending one x-request-id at once each get their own answer, and the "
          "server keeps serving", "request_id_keyed", request_ids),
)}


def run_checks(server: Server, names: list[str] | None = None,
               on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Run the checks `names` (all when None), in CHECKS' order; returns their results.

    Raises:
        TargetError, httpx.HTTPError: the server cannot be reached or failed a request outright.
    """
    results = []
    for check in CHECKS.values():
        if names is not None and check.name not in names:
            continue
        start = time.perf_counter()
        result = check.run(server)
        result.seconds = round(time.perf_counter() - start, 1)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


__all__ = ["CHECKS", "Check", "CheckResult", "Server", "run_checks"]
