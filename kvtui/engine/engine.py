"""Engine: submit requests, step the batch, get a StepReport. schedule -> run -> postprocess.

Clocks: with clock="wall" timestamps are measured seconds since the engine started. With
clock="virtual" time advances only by a modeled step duration (StepCostModel), so a given
scenario and seed yield the same timestamps, batches and tokens on any machine; the measured wall
time of each step is still reported beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvtui.config import EngineConfig
from kvtui.engine.batching import build_batch
from kvtui.engine.kv_pool import KVPool
from kvtui.engine.report import FinishedRequestReport, RunningRequestReport, StepReport
from kvtui.engine.request import FinishReason, RequestState, RequestStatus, SamplingParams
from kvtui.engine.runner import ModelRunner, model_geometry
from kvtui.engine.sampling import make_generator, sample_token
from kvtui.engine.scheduler import Scheduler, StepPlan


@dataclass(frozen=True)
class StepCostModel:
    """Modeled step duration for the virtual clock, in seconds:
    base_s + per_row_s * rows + per_token_s * real tokens + per_key_s * key positions read.

    Defaults are rough fits for SmolLM2-135M fp32 on 2 CPU cores (DESIGN.md section 7: batch-1
    decode ~25 tokens/s, batch-8 ~134 tokens/s); they set pacing only, never token values.
    """

    base_s: float = 0.035
    per_row_s: float = 0.001
    per_token_s: float = 0.004
    per_key_s: float = 0.000002

    def duration(self, rows: int, tokens: int, key_positions: int) -> float:
        return self.base_s + self.per_row_s * rows + self.per_token_s * tokens + self.per_key_s * key_positions


class Engine:
    """A continuous-batching engine over one model and one KV pool.

    Args:
        model: transformers causal LM (eval mode; its dtype is the KV pool dtype).
        config: EngineConfig.
        eos_token_ids: tokens that end a request (finish reason "stop") unless ignore_eos.
        tokenizer: optional, needed only for stop strings.
        clock: "wall" or "virtual" (see module docstring); cost_model: for the virtual clock.
    """

    def __init__(self, model, config: EngineConfig, *, eos_token_ids=(), tokenizer=None,
                 clock: str = "wall", cost_model: StepCostModel | None = None, pad_token_id: int = 0) -> None:
        if clock not in ("wall", "virtual"):
            raise ValueError(f"{clock = } must be 'wall' or 'virtual'")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.pad_token_id = pad_token_id
        layers, _, kv_heads, head_dim = model_geometry(model)
        dtype = next(model.parameters()).dtype
        self.pool = KVPool(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, num_slots=config.num_slots,
                           max_len=config.max_len, dtype=dtype, device=config.device,
                           kv_budget_bytes=config.kv_budget_bytes)
        self.runner = ModelRunner(model, self.pool)
        self.scheduler = Scheduler(max_batch_size=config.max_batch_size, max_tokens_per_step=config.max_tokens_per_step,
                                   bucketing=config.bucketing, bucket_tolerance=config.bucket_tolerance)
        self.clock = clock
        self.cost_model = cost_model or StepCostModel()
        self._t0 = time.perf_counter()
        self._virtual_now = 0.0
        self.step_index = 0
        self.requests: dict[str, RequestState] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._pending_finished: list[RequestState] = []
        self.measure_flow = False

    # -- time ---------------------------------------------------------------------------------
    def now(self) -> float:
        """Engine clock in seconds (virtual or wall since start)."""
        if self.clock == "virtual":
            return self._virtual_now
        return time.perf_counter() - self._t0

    def advance_to(self, t: float) -> None:
        """Virtual clock only: jump forward to `t` seconds (e.g. the next arrival while idle)."""
        if self.clock == "virtual" and t > self._virtual_now:
            self._virtual_now = t

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams | None = None, *,
               arrival_s: float | None = None, metadata: dict | None = None) -> RequestState:
        """Queue a request. A request that cannot fit is rejected (or capped, per config.on_too_long);
        a rejected request is reported in the next StepReport's `finished`, never raised.

        Raises:
            ValueError: request_id already used.
        """
        if request_id in self.requests:
            raise ValueError(f"duplicate {request_id = }")
        sampling = sampling or SamplingParams()
        request = RequestState(request_id=request_id, prompt_ids=[int(t) for t in prompt_ids], sampling=sampling,
                               arrival_s=self.now() if arrival_s is None else arrival_s, metadata=dict(metadata or {}))
        self.requests[request_id] = request
        reason = self._admission_problem(request)
        if reason:
            self._finish(request, FinishReason.REJECTED, reason)
            return request
        self._generators[request_id] = make_generator(request.sampling)
        self.scheduler.add(request)
        return request

    def _admission_problem(self, request: RequestState) -> str:
        max_len, need = self.pool.max_len, request.prompt_len + request.sampling.max_new_tokens
        if request.prompt_len == 0:
            return "empty prompt"
        if request.prompt_len >= max_len:
            return f"prompt of {request.prompt_len} tokens does not fit max_len={max_len}"
        if need > max_len:
            if self.config.on_too_long == "reject":
                return (f"prompt {request.prompt_len} + max_new_tokens {request.sampling.max_new_tokens} "
                        f"> max_len={max_len}")
            capped = max_len - request.prompt_len
            request.sampling = SamplingParams(**{**request.sampling.__dict__, "max_new_tokens": capped})
            request.finish_detail = f"max_new_tokens capped to {capped} to fit max_len={max_len}"
        limit = self.config.max_waiting
        # requests that a free slot will take at the next step do not count as queued
        if limit is not None and len(self.scheduler.waiting) - self.pool.num_free >= limit:
            return f"waiting queue full ({limit} requests)"
        return ""

    def abort(self, request_id: str) -> None:
        """Cancel a waiting or running request; it frees its slot and finishes with reason "abort"."""
        request = self.requests[request_id]
        if not request.is_done:
            self.scheduler.remove(request)
            self._finish(request, FinishReason.ABORT, "aborted by caller")

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending_finished)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- stepping -----------------------------------------------------------------------------
    def step(self) -> StepReport:
        """Admit, schedule, run one forward, sample, retire finished requests; report the step."""
        start_s = self.now()
        wall_start = time.perf_counter()
        admitted = self.scheduler.admit(self.pool.num_free)
        for request in admitted:
            request.slot = self.pool.allocate(request.request_id, fresh=self.config.slot_reuse == "reallocate")
            request.cache_len = 0
            request.scheduled_s = start_s
        plan = self.scheduler.plan(admitted)
        running_reports, batch = [], None
        if not plan.empty:
            batch = build_batch(plan, layout=self.config.layout, padding_side=self.config.padding_side,
                                pad_token_id=self.pad_token_id)
            logits, _ = self.runner.forward(batch, measure_flow=self.measure_flow)
            sampled = {chunk_index: row for row, chunk_index in enumerate(batch.sample_chunk)}
            end_s = self._end_time(start_s, plan, batch, wall_start)
            for index, chunk in enumerate(plan.chunks):
                running_reports.append(self._postprocess(chunk, logits[sampled[index]] if index in sampled else None,
                                                         end_s))
        wall_s = time.perf_counter() - wall_start
        finished = tuple(self._finished_report(r) for r in self._pending_finished)
        self._pending_finished.clear()
        report = self._report(start_s, wall_s, plan, batch, tuple(running_reports), finished)
        self.step_index += 1
        return report

    def _end_time(self, start_s: float, plan: StepPlan, batch, wall_start: float) -> float:
        if self.clock == "virtual":
            tokens = sum(c.num_tokens for c in plan.chunks)
            keys = int(batch.key_slot.numel())
            self._virtual_now = start_s + self.cost_model.duration(batch.rows, tokens, keys)
        return self.now()

    def _postprocess(self, chunk, logits, end_s: float) -> RunningRequestReport:
        request = chunk.request
        request.cache_len = chunk.end_pos
        if chunk.phase == "prefill":
            request.prefill_done += chunk.num_tokens
        token = None
        if logits is not None:
            token = sample_token(logits, request.sampling, self._generators.get(request.request_id))
            request.generated_ids.append(token)
            request.token_times_s.append(end_s)
            if request.first_token_s is None:
                request.first_token_s = end_s
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason, "")
        return RunningRequestReport(request.request_id, chunk.slot, chunk.end_pos, chunk.num_tokens, token,
                                    chunk.phase)

    def _stop_reason(self, request: RequestState, token: int) -> FinishReason | None:
        params = request.sampling
        if token in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(request.generated_ids, skip_special_tokens=True)
            if any(s in text for s in params.stop):
                return FinishReason.STOP
        if len(request.generated_ids) >= params.max_new_tokens:
            return FinishReason.LENGTH
        if request.cache_len + 1 > self.pool.max_len:  # the last token would not fit its slot
            return FinishReason.LENGTH
        return None

    def _finish(self, request: RequestState, reason: FinishReason, detail: str) -> None:
        if request.status == RequestStatus.RUNNING:
            self.scheduler.remove(request)
        if request.slot is not None and self.pool.owner[request.slot] == request.request_id:
            self.pool.free(request.slot)  # a finished request frees its slot at once
        request.status = RequestStatus.ABORTED if reason == FinishReason.ABORT else RequestStatus.FINISHED
        request.finish_reason = reason
        if detail:
            request.finish_detail = detail
        request.finish_s = self.now()
        self._generators.pop(request.request_id, None)
        self._pending_finished.append(request)

    @staticmethod
    def _finished_report(r: RequestState) -> FinishedRequestReport:
        return FinishedRequestReport(
            r.request_id, r.finish_reason.value if r.finish_reason else "", r.finish_detail, tuple(r.prompt_ids),
            tuple(r.generated_ids), r.slot, r.arrival_s, r.scheduled_s, r.first_token_s, r.finish_s,
            tuple(r.token_times_s), dict(r.metadata))

    def _report(self, start_s, wall_s, plan: StepPlan, batch, running, finished) -> StepReport:
        prefill = sum(c.num_tokens for c in plan.chunks if c.phase == "prefill")
        decode = sum(c.num_tokens for c in plan.chunks if c.phase == "decode")
        real = prefill + decode
        if batch is not None:
            query_positions, padded = batch.query_positions, batch.padded_positions
            key_positions = real * batch.key_slot.shape[1]
            key_padded = batch.key_padded_positions
        else:
            query_positions = padded = key_positions = key_padded = 0
        kv_tokens = sum(r.cache_len for r in self.scheduler.running)
        pool = self.pool
        return StepReport(
            step=self.step_index, start_s=start_s, end_s=self.now(), wall_s=wall_s, layout=self.config.layout,
            rows=batch.rows if batch is not None else 0, prefill_tokens=prefill, decode_tokens=decode,
            query_positions=query_positions, padded_positions=padded,
            padding_ratio=padded / query_positions if query_positions else 0.0,
            key_positions=key_positions, key_padded_positions=key_padded,
            key_padding_ratio=key_padded / key_positions if key_positions else 0.0,
            slots_used=pool.num_used, num_slots=pool.num_slots, slot_occupancy=pool.num_used / pool.num_slots,
            kv_tokens=kv_tokens, kv_capacity_tokens=pool.capacity_tokens,
            kv_usage=kv_tokens / pool.capacity_tokens, running=running, finished=finished,
            num_waiting=len(self.scheduler.waiting),
        )

    def run_until_done(self, max_steps: int = 100_000) -> list[StepReport]:
        """Step until no request is left (tests and solo runs). Raises RuntimeError past max_steps."""
        reports = []
        while self.has_unfinished():
            if len(reports) >= max_steps:
                raise RuntimeError(f"engine did not finish within {max_steps = }")
            reports.append(self.step())
        return reports
