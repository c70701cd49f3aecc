"""Engine: submit requests, step the batch, get a StepEvent. schedule -> run -> postprocess.

Clocks: with clock="wall" timestamps are measured seconds since the engine started. With
clock="virtual" time advances only by a modeled step duration (StepCostModel), so a given
scenario and seed yield the same timestamps, batches and tokens on any machine; the measured wall
time of each step is still reported beside it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from kvtui.config import EngineConfig
from kvtui.engine.attention import StepInterrupted
from kvtui.engine.batching import BatchStats, build_batch
from kvtui.engine.encoder import CrossAttentionInputs, EncoderDecoderRunner
from kvtui.engine.encoder_side import EncoderSide, TokenInputs
from kvtui.engine.fault_acts import FaultActs, plan_acts, step_acts
from kvtui.engine.fault_acts import merge as merge_acts
from kvtui.engine.faults import MASK_FAULTS, racy_forward
from kvtui.engine.hybrid import HybridRunner
from kvtui.engine.image_side import ImageInputs
from kvtui.engine.inputs import RequestInput
from kvtui.engine.kv_cache import KVCache, KVPlace
from kvtui.engine.kv_pool import KVPool, PagedKVPool
from kvtui.engine.lora import LoraBatch, lora_problem
from kvtui.engine.observe import PAD_WRITTEN, attention_flow, key_writers, nonfinite_reads, slot_taint
from kvtui.engine.output import OutputProcessor, gaps_and_finite
from kvtui.engine.paged import PagedCache
from kvtui.engine.parallel import Families, child_id, child_sampling
from kvtui.engine.report import FinishedRequestReport, RunningEntry, StepEvent
from kvtui.engine.request import FinishCode, FinishReason, RequestState, RequestStatus, SamplingParams
from kvtui.engine.row_state import NOT_SAMPLED
from kvtui.engine.runner import ModelRunner, batch_invariant_problem, model_geometry
from kvtui.engine.scheduler import Scheduler, StepPlan
from kvtui.engine.slot_cache import SlotCache
from kvtui.engine.state_side import NoState, StateSide, make_state_side
from kvtui.faults import FAULTS, FaultName, acts_on, check_fault_names
from kvtui.model_kinds import ModelKind, model_kind
from kvtui.models.compat import check_model

NAME_MEMORY = 65_536  # request names kept for writer tags (a pool rarely holds more writers)


@dataclass(frozen=True)
class ForwardOutcome:
    """What one forward produced: logits [V] float32 per sampling chunk index, the batch's figures,
    the in-engine detectors' reports, and (chunk index, error text) for chunks a fault broke."""

    logits: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)  # chunk index -> (top-1 minus top-2 logit, all finite)
    stats: BatchStats = BatchStats()
    taint: tuple = ()
    flow: tuple = ()
    nonfinite: tuple = ()
    errors: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class StepCostModel:
    """Modeled step duration for the virtual clock, in seconds:
    base_s + per_row_s * rows + per_token_s * query positions (pads included) + per_key_s * key positions read.

    The defaults are `kvtui calibrate`'s fit for SmolLM2-135M in float32 on a 2-core x86_64 machine
    (torch 2.13 with 2 threads; 12 step shapes, R^2 0.997); `kvtui calibrate` fits them to another
    machine or model. They set pacing only, never token values.
    """

    base_s: float = 0.0492
    per_row_s: float = 0.000253
    per_token_s: float = 0.00128
    per_key_s: float = 0.00000897

    def duration(self, rows: int, tokens: int, key_positions: int) -> float:
        return self.base_s + self.per_row_s * rows + self.per_token_s * tokens + self.per_key_s * key_positions


class Engine:
    """A continuous-batching engine over one model and one KV pool.

    Args:
        model: transformers causal LM (eval mode; its dtype is the KV pool dtype).
        config: EngineConfig.
        eos_token_ids: tokens that end a request (finish reason "stop") unless ignore_eos.
        tokenizer: optional, needed for stop strings and structured output.
        grammar_tokenizer: the tokenizer structured output compiles grammars with, when it should not
            also check stop strings (default: tokenizer).
        clock: "wall" or "virtual" (see module docstring); cost_model: for the virtual clock.
        encoder_cache_entries: the entries the encoder cache keeps (Whisper's cross-K/V, or images' rows;
            default encoder_capacity(config)).
        image_encoder: a kvtui.models.vision.ImageEncoder (LoadedModel.image_encoder) for requests with images.

    Raises:
        ValueError: a model or max_len the engine cannot serve (kvtui.models.compat.check_model), or a KV
            pool that does not fit in memory (KVPool); one line each.
    """

    def __init__(self, model, config: EngineConfig, *, eos_token_ids=(), tokenizer=None,
                 clock: str = "wall", cost_model: StepCostModel | None = None, pad_token_id: int = 0,
                 grammar_tokenizer=None, encoder_cache_entries: int | None = None, image_encoder=None) -> None:
        if clock not in ("wall", "virtual"):
            raise ValueError(f"{clock = } must be 'wall' or 'virtual'")
        self.config = config
        self.model = model
        self.vocab_size = model.get_input_embeddings().num_embeddings  # token ids a prompt may hold: [0, vocab_size)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.pad_token_id = pad_token_id
        self._serial: dict[str, int] = {}
        self._names: dict[int, str] = {}  # request serial -> id, for naming the writers of pool positions
        check_model(model.config, config.max_len)  # ValueError: length-dependent RoPE, max_len past learned positions
        # what requests keep besides K/V: a hybrid's recurrent state (engine/state_side.py); the scheduler owns it
        state = make_state_side(model, config)
        self.kv = _make_kv(model, config, self._serial.__getitem__, self._names.get, state)  # the scheduler owns it
        self.pool = self.kv.pool
        # what requests feed the model besides token ids (engine/encoder_side.py); the scheduler owns it
        self.runner, encoder = make_encoder_side(model, self.pool, capacity=encoder_cache_entries or
                                                 encoder_capacity(config), enforce_eager=config.enforce_eager,
                                                 image_encoder=image_encoder, batch_invariant=config.batch_invariant,
                                                 state=state, compile=config.compile)
        self.scheduler = Scheduler(self.kv, config, encoder, state)
        self.acts = encoder.acts = getattr(self.kv, "acts", None) or FaultActs()  # where faults act: fault_acts.py
        self.clock, self.cost_model = clock, cost_model or StepCostModel()
        self._t0, self._paused_at, self._virtual_now = time.perf_counter(), None, 0.0
        self.step_index = 0
        self.requests: dict[str, RequestState] = {}
        # the output side: row states, structured output, sampling, stop checks (engine/output.py)
        self.output = OutputProcessor(self.vocab_size, self.eos_token_ids, tokenizer, grammar_tokenizer,
                                      adjust_logits=encoder.adjust_logits)
        self._pending_finished: list[RequestState] = []
        self.families = Families()  # parallel sampling (n > 1)
        self.measure_flow = False  # attention_flow detector: accumulate attention per step
        self.detect_taint = False  # slot_taint detector: check every allowed key's writer
        self._faults: frozenset[str] = frozenset()
        self.set_faults(config.faults)  # switched between steps
        self._next_serial = 0

    @classmethod
    def from_loaded(cls, loaded, config: EngineConfig, **options) -> Engine:
        """The engine over a kvtui.models.LoadedModel: its model, eos_token_ids, tokenizer, pad token id (the
        tokenizer's, else 0) and image_encoder, each unless `options` gives it; `options`: the constructor's
        keywords (clock, cost_model, grammar_tokenizer, ...). A bare model in place of `loaded` brings none of
        the four (the constructor's defaults). Raises as the constructor (TypeError: an unknown keyword)."""
        if not hasattr(loaded, "eos_token_ids"):  # a bare model
            return cls(loaded, config, **options)
        tok = loaded.tokenizer
        parts = dict(eos_token_ids=loaded.eos_token_ids, tokenizer=tok, image_encoder=loaded.image_encoder,
                     pad_token_id=getattr(tok, "pad_token_id", None) or 0)
        return cls(loaded.model, config, **{**parts, **options})

    @property
    def encoder(self) -> EncoderSide:
        """The encoder side (engine/encoder_side.py), owned by the scheduler."""
        return self.scheduler.encoder

    @property
    def state(self) -> StateSide:
        """The state side (engine/state_side.py: a hybrid's recurrent state, or nothing), owned by the scheduler."""
        return self.scheduler.state

    @property
    def model_kind(self) -> ModelKind:
        """The loaded model's ModelKind (DECODER_ONLY, ENCODER_DECODER or IMAGE_TEXT), as its encoder side says."""
        return self.scheduler.encoder.model_kind

    def token_embeddings(self, token_ids) -> torch.Tensor:
        """The model's own input embedding rows of `token_ids`: [T, hidden] float32 on the CPU (a prompt
        given as embeddings that equal its tokens)."""
        return self.runner.token_embeddings(token_ids)

    # -- time ---------------------------------------------------------------------------------
    def now(self) -> float:
        """Engine clock in seconds (virtual, or wall since start minus paused time)."""
        if self.clock == "virtual":
            return self._virtual_now
        return (self._paused_at if self._paused_at is not None else time.perf_counter()) - self._t0

    def pause_clock(self) -> None:
        """Wall clock: freeze now() (a paused dashboard), so paused time never counts as latency. A step
        taken while paused runs with the clock going and advances it by the step's own duration."""
        if self.clock == "wall" and self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume_clock(self) -> None:
        """Wall clock: let now() go on from where pause_clock() froze it (monotonic: never back)."""
        if self._paused_at is not None:
            self._t0 += time.perf_counter() - self._paused_at
            self._paused_at = None

    @property
    def clock_paused(self) -> bool:
        return self._paused_at is not None

    def advance_to(self, t: float) -> None:
        """Jump the clock forward to `t` seconds (never back): the virtual clock to the next arrival
        while idle, or a paused wall clock when a single step is asked for and nothing runs yet."""
        if self.clock == "virtual":
            self._virtual_now = max(self._virtual_now, t)
        elif t > self.now():
            self._t0 -= t - self.now()
            while self.now() < t:  # float rounding at perf_counter's magnitude: make now() >= t for sure
                self._t0 = math.nextafter(self._t0, -math.inf)

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: RequestInput | list[int], sampling: SamplingParams | None = None, *,
               arrival_s: float | None = None, tenant: str | None = None, cache_salt: str | None = None,
               forced: tuple[int, ...] | None = None) -> RequestState:
        """Queue a request. A request that cannot run is rejected with a FinishCode: an empty prompt, a
        token id outside [0, vocab_size), a prompt or prompt + max_new_tokens above max_len (or capped,
        per config.on_too_long), a full waiting queue; a rejected request is reported in the next
        StepEvent's `finished`, never raised, so one request's bad input never reaches the batch.
        `tenant` and `cache_salt` matter to paged KV's prefix cache (the salt keys its first block).
        `prompt`: a RequestInput (kvtui/engine/inputs.py: token ids, supplied embedding rows under a mask,
        images, an encoder-decoder's audio), or a list of token ids for a text prompt. An input this
        model cannot take (audio to a decoder-only model, no audio to Whisper, embedding rows of the
        wrong width) is rejected.

        With sampling.n > 1 the request runs as n sequences `f"{i}_{request_id}"` (kvtui.engine.parallel):
        sequence 0 prefills the prompt and the others fork from it when its prefill samples; each
        draws with seed + i and is reported as a request of its own. `sequence_ids(request_id)` names
        them, `abort(request_id)` aborts them all. Returns sequence 0's state (the request's for n = 1).
        `forced`: teacher forcing, n = 1 only (RequestState.forced, OutputProcessor.sample).

        Raises:
            ValueError: request_id (or one of its sequence ids) already used; `forced` empty or with n > 1.
        """
        sampling = sampling or SamplingParams()
        prompt = RequestInput.of(prompt)
        kw = dict(arrival_s=self.now() if arrival_s is None else arrival_s, tenant=tenant, cache_salt=cache_salt)
        if forced is not None and (not forced or sampling.n != 1):
            raise ValueError(f"forced tokens need n = 1 and at least one token, got n = {sampling.n}")
        if sampling.n == 1:
            return self._submit_one(request_id, prompt, sampling, forced=forced, **kw)
        ids = [child_id(request_id, i) for i in range(sampling.n)]
        if request_id in self.families.members or any(i in self.requests for i in ids):
            raise ValueError(f"duplicate {request_id = }")
        lead = self._submit_one(ids[0], prompt, child_sampling(sampling, 0), parent_id=request_id, **kw)
        siblings = [self._submit_one(i, prompt, replace(lead.sampling, seed=sampling.seed + k), parent_id=request_id,
                                     index=k, queue=False, **kw) for k, i in enumerate(ids[1:], start=1)]
        self.families.add(request_id, lead, siblings)
        if lead.is_done:  # rejected: every sequence shares the reason
            self._release_forks(lead)
        return lead

    def sequence_ids(self, request_id: str) -> tuple[str, ...]:
        """The ids a submitted request runs under: its n sequences' for n > 1 (until they are reported
        finished), else (request_id,)."""
        return self.families.ids(request_id)

    def _submit_one(self, request_id: str, prompt: RequestInput, sampling: SamplingParams, *, arrival_s: float,
                    tenant, cache_salt, parent_id: str | None = None, index: int = 0,
                    queue: bool = True, forced: tuple[int, ...] | None = None) -> RequestState:
        """Register one sequence; check it and queue it (queue=False: a sibling held to fork later)."""
        if request_id in self.requests:
            raise ValueError(f"duplicate {request_id = }")
        request = RequestState(request_id=request_id, prompt_ids=list(prompt.prompt_ids), sampling=sampling, input=prompt,
                               arrival_s=arrival_s, tenant=tenant,
                               cache_salt=cache_salt, parent_id=parent_id, index=index,
                               forced=None if forced is None else tuple(int(t) for t in forced))
        self.requests[request_id] = request
        self._serial[request_id] = self._next_serial
        self._names[self._next_serial] = request_id
        self._next_serial += 1
        if len(self._names) > NAME_MEMORY:  # names of long-gone writers: the oldest go first
            del self._names[next(iter(self._names))]
        problem = None if not queue else (self._input_problem(request) or self._prompt_problem(request)
                                           or self._admission_problem(request))
        problem = problem or self.output.grammar_problem(request)
        if problem and queue:
            self._finish(request, FinishReason.REJECTED, problem[1], problem[0])
            return request
        self.encoder.submit(request)
        self.output.track(request)
        if queue:
            self.scheduler.add(request)
        return request  # a held sibling whose grammar fails is rejected with its lead (_release_forks)

    def _input_problem(self, request: RequestState) -> tuple[FinishCode, str] | None:
        """(code, detail) when the request's input does not fit the model (unsupported_input) or its LoRA
        adapter cannot run in this engine (adapter_unsupported); see Engine.submit."""
        problem = self.encoder.problem(request.input)
        if problem:
            return FinishCode.UNSUPPORTED_INPUT, problem
        if request.input.lora is not None:  # adapters run on the fused forward only
            problem = lora_problem(self.model, enforce_eager=self.runner.fused is None,
                                   batch_invariant=self.runner.tiles is not None)
            return (FinishCode.ADAPTER_UNSUPPORTED, problem) if problem else None
        return None

    def _prompt_problem(self, request: RequestState) -> tuple[FinishCode, str] | None:
        """(code, detail) when the prompt itself cannot run: empty, a token id the model's embedding
        has no row for (it would raise inside the batched forward and take every request down), or
        longer than a slot."""
        if request.prompt_len == 0:
            return FinishCode.EMPTY, "empty prompt"
        spliced = request.input.spliced_positions
        bad = next((t for p, t in enumerate(request.prompt_ids) if not 0 <= t < self.vocab_size and p not in spliced),
                   None)
        if bad is not None:
            return FinishCode.OUT_OF_VOCABULARY, (f"Token id {bad} is out of vocabulary: the model has "
                                                  f"{self.vocab_size} tokens (ids 0 to {self.vocab_size - 1})")
        max_len = self.pool.max_len
        if request.prompt_len >= max_len:
            return FinishCode.TOO_LONG, f"prompt of {request.prompt_len} tokens does not fit max_len={max_len}"
        return self._params_problem(request.sampling)

    def _params_problem(self, params: SamplingParams) -> tuple[FinishCode, str] | None:
        """(code, detail) when a logit_bias or bad_words token id is outside the vocabulary (indexing the
        logits with it would fail the request at its first sample)."""
        vocab = self.vocab_size
        bad = next((t for t, _ in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            return FinishCode.INVALID_LOGIT_BIAS, (f"logit_bias token id {bad} is out of vocabulary: the model has "
                                                   f"{vocab} tokens (ids 0 to {vocab - 1})")
        bad = next((t for seq in params.bad_words_ids for t in seq if not 0 <= t < vocab), None)
        if bad is not None:
            return FinishCode.INVALID_BAD_WORDS, (f"bad_words token id {bad} is out of vocabulary: the model has "
                                                 f"{vocab} tokens (ids 0 to {vocab - 1})")
        return None

    def _admission_problem(self, request: RequestState) -> tuple[FinishCode, str] | None:
        """(code, detail) when the request cannot be queued: prompt + max_new_tokens past max_len (unless
        capped), past the paged pool, or a full waiting queue."""
        max_len, need = self.pool.max_len, request.prompt_len + request.sampling.max_new_tokens
        if need > max_len:
            if self.config.on_too_long == "reject":
                return FinishCode.TOO_LONG, (f"prompt {request.prompt_len} + max_new_tokens "
                                             f"{request.sampling.max_new_tokens} > max_len={max_len}")
            capped = max_len - request.prompt_len
            request.sampling = SamplingParams(**{**request.sampling.__dict__, "max_new_tokens": capped,
                                                 "min_tokens": min(request.sampling.min_tokens, capped)})
            request.finish_detail = f"max_new_tokens capped to {capped} to fit max_len={max_len}"
        rejection = self.kv.rejection(request)
        if rejection:
            return FinishCode.TOO_LONG, rejection
        limit = self.config.max_waiting
        # requests that the next admission takes for sure (a free slot) do not count as queued
        if limit is not None and len(self.scheduler.waiting) - self.kv.free_seats() >= limit:
            return FinishCode.QUEUE_FULL, f"waiting queue full ({limit} requests)"
        return None

    def reconfigure(self, **changes) -> None:
        """Change engine knobs between steps (timeline, dashboard): the EngineConfig fields in
        kvtui.config.RUNTIME_FIELDS (max_batch_size, max_tokens_per_step, layout, padding_side,
        bucketing, bucket_tolerance, slot_reuse, on_too_long, max_waiting).

        Raises:
            ValueError: another EngineConfig field (the pool's size and place: num_slots, max_len, kv,
                block_size, ...; faults change through set_faults) or a bad value.
            TypeError: a name that is no EngineConfig field.
        """
        self.config = self.config.reconfigured(**changes)
        self.scheduler.configure(self.config)
        self.kv.configure(self.config, self._faults)

    def abort(self, request_id: str) -> None:
        """Cancel a waiting or running request; it frees its slot and finishes with reason "abort".
        Aborting a request that already finished (not yet reported) does nothing.

        Raises:
            KeyError: no such request in the engine (never submitted, or finished and reported).
        """
        if request_id in self.families.members:  # parallel sampling: every sequence
            for sequence_id in self.families.ids(request_id):
                self.abort(sequence_id)
            return
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"cannot abort {request_id!r}: no such request in the engine (never submitted, "
                           "or already finished and reported)")
        if not request.is_done:
            self._finish(request, FinishReason.ABORT, "aborted by caller")

    @property
    def faults(self) -> frozenset[str]:
        """The isolation faults active from the next step."""
        return self._faults

    def set_faults(self, names) -> None:
        """Switch exactly `names` on from the next step.

        Raises:
            ValueError: an unknown fault name (see kvtui.faults), or a fault that does not act with this
                engine's KV mode (`kv`, e.g. stale_slot with paged KV).
        """
        faults = check_fault_names(names)
        wrong = sorted(n for n in faults if self.config.kv not in FAULTS[n].kv)
        kind = self.model_kind
        misfit = sorted(n for n in faults if not acts_on(n, kind))
        if misfit:
            raise ValueError(f"fault {misfit[0]!r} does not act on {kind} models like this engine's")
        if wrong:
            raise ValueError(f"fault {wrong[0]!r} acts with kv: {' or '.join(FAULTS[wrong[0]].kv)} only; this engine "
                             f"runs kv: {self.config.kv}")
        self._faults = faults
        self.kv.configure(self.config, faults)
        self.encoder.configure(faults)
        self.state.configure(faults)
        self.output.faults = faults

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending_finished)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- stepping -----------------------------------------------------------------------------
    def step(self) -> StepEvent:
        """One engine step: admit waiting requests into free slots, plan the batch, run one forward,
        sample and retire finished requests, report (schedule -> run -> postprocess). While the clock is
        paused, the step runs with it going (and it stops again after)."""
        paused = self._paused_at is not None
        self.resume_clock()
        try:
            return self._step()
        except StepInterrupted:
            self.runner.cache.interrupt.clear()  # one interrupt stops one step
            raise
        finally:
            if paused:
                self.pause_clock()

    def interrupt(self) -> None:
        """Any thread: stop the step in progress at its next layer (or the next step's forward at its first
        layer); that step() raises StepInterrupted and reports nothing. Meant for stopping: a long prefill
        step (seconds on a loaded CPU) need not finish before its requests are aborted. The requests keep
        the state they had before the step, with their admission and the step's K/V writes partly done;
        abort them before stepping again."""
        self.runner.cache.interrupt.set()

    def _step(self) -> StepEvent:
        start_s, wall_start = self.now(), time.perf_counter()
        faults = self._faults
        self.scheduler.admit(start_s)  # and the encoder side's work for what it admits
        plan = self.scheduler.plan()  # with each chunk's encoder inputs bound
        outcome = self._forward(plan, faults)
        end_s = self._advance_clock(start_s, outcome.stats, self.scheduler.encoder_cost_s)
        running = self._postprocess(plan, outcome, end_s)
        report = self._report(start_s, time.perf_counter() - wall_start, plan, outcome, running)
        if faults:
            notes = self.acts.take() + plan_acts(plan.chunks, self.config.layout, faults) + step_acts(report, faults)
            report = report.model_copy(update={"acted": merge_acts(notes, report.t, report.step)})
        self.step_index += 1
        return report

    def _forward(self, plan: StepPlan, faults: frozenset) -> ForwardOutcome:
        """Run the model on the plan's batch. Under a fault an exception anywhere in the faulty path is a
        symptom (every chunk of the step is reported as corrupted), never a crash; with isolation
        intact it is a bug and propagates."""
        if plan.empty:
            return ForwardOutcome()
        try:
            if FaultName.RACY_THREADS in faults:
                racy = racy_forward(self.runner, plan, layout=self.config.layout, pad_token_id=self.pad_token_id,
                                    faults=faults, max_len=self.pool.max_len, tag_writes=self._tag_writes,
                                    block_size=self.kv.block_size)
                return ForwardOutcome(racy.logits, gaps_and_finite(racy.logits), racy.stats, errors=racy.errors)
            return self._forward_batch(plan, faults)
        except StepInterrupted:
            raise
        except Exception as e:
            if not faults:
                raise
            return ForwardOutcome(stats=BatchStats(rows=len(plan.chunks)),
                                  errors=tuple((i, f"{type(e).__name__}: {e}") for i in range(len(plan.chunks))))

    def _forward_batch(self, plan: StepPlan, faults: frozenset) -> ForwardOutcome:
        batch = build_batch(plan, layout=self.config.layout, padding_side=self.config.padding_side,
                            pad_token_id=self.pad_token_id, faults=faults, max_len=self.pool.max_len,
                            block_size=self.kv.block_size)
        writers = self._tag_writes(batch, plan.chunks)
        own, ids = self._serials(plan.chunks), [c.request.request_id for c in plan.chunks]
        expected = self.kv.expected_writers(batch, plan.chunks, own)
        taint = tuple(slot_taint(batch, writers, own, self._names, ids, expected)) if self.detect_taint else ()
        if self.detect_taint:  # a chunk that read another input's encoder output (cross K/V, spliced rows)
            taint = _merge_taint(taint, plan.taint)
        logits, state = self.runner.forward(batch, measure_flow=self.measure_flow, fp16=FaultName.FP16_CACHE in faults,
                                            own_range=not faults & MASK_FAULTS,
                                            lora=LoraBatch.of(batch, plan.chunks, self.runner.device))
        flow = ()
        if self.measure_flow and state.attn_sum is not None:
            flow = tuple(attention_flow(batch, state.attn_sum, state.flow_terms, writers, own, self._names, ids,
                                        expected))
        by_chunk = {chunk: logits[row] for row, chunk in enumerate(batch.sample_chunk)}
        facts = gaps_and_finite(by_chunk, logits, batch.sample_chunk)
        broken = [c for c, (_, finite) in facts.items() if not finite]
        nonfinite = ()
        if broken and (self.detect_taint or self.measure_flow):
            nonfinite = tuple(nonfinite_reads(batch, self.pool, writers, broken, self._names, ids))
        return ForwardOutcome(by_chunk, facts, batch.stats, taint, flow, nonfinite)

    def _serials(self, chunks) -> list[int]:
        return [self._serial[c.request.request_id] for c in chunks]

    def _tag_writes(self, batch, chunks) -> torch.Tensor:
        """Tag the pool positions this step writes with their request's serial; return the [R, K]
        writer serials of the batch's keys."""
        chunk_of_write = batch.query_owner[batch.write_row, batch.write_col]
        serials = torch.tensor(self._serials(chunks), dtype=torch.long)[chunk_of_write]
        self.pool.writer[batch.write_slot.cpu(), batch.write_pos.cpu()] = serials
        if batch.pad_write_row is not None:
            self.pool.writer[batch.pad_write_slot, batch.pad_write_pos] = PAD_WRITTEN
        return key_writers(self.pool.writer, batch)

    def _advance_clock(self, start_s: float, stats: BatchStats, encoder_s: float = 0.0) -> float:
        """End of the step: virtual clock += modeled duration (padded positions cost time too), plus the
        encoder side's modeled seconds for what it encoded at admission."""
        if self.clock == "virtual" and stats.rows:
            self._virtual_now = start_s + self.cost_model.duration(stats.rows, stats.query_positions,
                                                                   stats.key_cells) + encoder_s
        return self.now()

    def _postprocess(self, plan: StepPlan, outcome: ForwardOutcome, end_s: float) -> tuple[RunningEntry, ...]:
        """Advance every chunk's request (Scheduler.update_from_output); sample where the chunk samples;
        finish what stops."""
        failed = dict(outcome.errors)
        self.scheduler.update_from_output(plan, failed)
        self._sync_rows()
        running = []
        self.output.apply_grammar([(i, c.request.request_id) for i, c in enumerate(plan.chunks)
                                   if i in outcome.logits], outcome.logits)  # structured output: one per-row stage
        for index, chunk in enumerate(plan.chunks):
            if index in failed:
                self._finish(chunk.request, FinishReason.ABORT, f"corrupted by a faulty step: {failed[index]}")
            else:
                running += self._advance(chunk, outcome.logits.get(index), outcome.facts.get(index), end_s)
        return tuple(running)

    def _sync_rows(self) -> None:
        """The row table follows the running requests (engine/row_state.py), under this step's faults."""
        self.output.sync([r.request_id for r in self.scheduler.running])

    def _advance(self, chunk, logits, facts, end_s: float) -> list[RunningEntry]:
        """Commit the chunk's written tokens (its progress is the scheduler's); where it samples, fork the
        request's waiting siblings (parallel sampling) from its prefill first, then sample them all."""
        request = chunk.request
        request.faults_seen = request.faults_seen | self._faults
        self.kv.commit(request)
        forked = self._fork(request) if logits is not None else []
        entries = [self._entry(request, KVPlace(chunk.slot, chunk.blocks), chunk.num_tokens, chunk.phase, logits,
                               facts, end_s)]
        return entries + [self._entry(s, place, 0, "prefill", logits, facts, end_s) for s, place in forked]

    def _entry(self, request: RequestState, place: KVPlace, query_tokens: int, phase: str, logits, facts,
               end_s: float) -> RunningEntry:
        """Sample `request`'s token from `logits` [V] (None: nothing to sample) and report its share."""
        token, gap, nonfinite, logprobs, tags = None, None, False, None, NOT_SAMPLED
        if logits is not None:
            gap, finite = facts
            nonfinite = not finite
            try:
                token, logprobs, tags, reason = self.output.sample(request, logits, gap if finite else math.nan, end_s,
                                                                   self.pool.max_len)
            except Exception as e:  # this request's own step failed: it alone ends, the batch goes on
                self._finish(request, FinishReason.ERROR, f"sampling failed: {type(e).__name__}: {e}",
                             FinishCode.INTERNAL_ERROR)
            else:
                if reason is not None:
                    self._finish(request, reason, "")
        first = token is not None and len(request.generated_ids) == 1
        return RunningEntry(request_id=request.request_id, slot=place.slot, cache_len=request.cache_len,
                            query_tokens=query_tokens, token_id=token, phase=phase, top2_gap=gap, nonfinite=nonfinite,
                            ttft_s=request.ttft_s if first else None, blocks=place.blocks, logprobs=logprobs,
                            sampled_with=tags.row_state, penalized_with=tags.history, drawn_with=tags.generator)

    def _fork(self, lead: RequestState) -> list[tuple[RequestState, KVPlace]]:
        """Parallel sampling: the lead's prefill is done; its waiting siblings fork from its KV, or queue to
        prefill the prompt themselves (Scheduler.fork). The forked (sibling, KVPlace)."""
        forked = self.scheduler.fork(lead, self.families.pending.pop(lead.request_id, ()))
        for sibling, _ in forked:
            sibling.faults_seen = lead.faults_seen
        if forked:  # the forked sequences take their rows (their own sampling state) before they sample
            self._sync_rows()
        return forked

    def _release_forks(self, lead: RequestState) -> None:
        """The lead ended before its prefill sampled: a rejected lead's siblings share its rejection;
        otherwise they queue at the front and prefill the prompt themselves."""
        siblings = self.families.pending.pop(lead.request_id, [])
        if lead.finish_reason != FinishReason.REJECTED:
            self.scheduler.requeue(siblings)
            return
        code = FinishCode(lead.finish_code) if lead.finish_code else None
        for sibling in siblings:
            self._finish(sibling, FinishReason.REJECTED, lead.finish_detail, code)

    def _finish(self, request: RequestState, reason: FinishReason, detail: str,
                code: FinishCode | None = None) -> None:
        self.scheduler.finish(request)  # its KV and its hold on encoder outputs go back at once
        request.status = RequestStatus.ABORTED if reason == FinishReason.ABORT else RequestStatus.FINISHED
        request.finish_reason = reason
        if detail:
            request.finish_detail = detail
        request.finish_code = code.value if code else ""
        request.finish_s = self.now()
        self.output.drop(request.request_id)
        self._pending_finished.append(request)
        if request.request_id in self.families.pending:
            self._release_forks(request)

    def _retire(self, r: RequestState) -> FinishedRequestReport:
        """The finished report of `r`; the engine forgets `r` (bounded memory over long runs)."""
        self.requests.pop(r.request_id, None)
        self._serial.pop(r.request_id, None)
        self.families.retire(r)
        return FinishedRequestReport(
            r.request_id, r.finish_reason.value if r.finish_reason else "", r.finish_detail, tuple(r.prompt_ids),
            tuple(r.generated_ids), r.slot, r.arrival_s, r.scheduled_s, r.first_token_s, r.finish_s,
            tuple(r.token_times_s), r.stop_str, r.text_end, tuple(r.top2_gaps), r.sampling,
            r.faults_seen, r.tenant, r.finish_code, tuple(r.draws), r.input)

    def _pool_fields(self) -> dict:
        """Occupancy and KV fields of a StepEvent: running requests (of max_batch_size), and from the KV
        cache slots, or with paged KV blocks (see SlotCache / PagedCache.report_fields)."""
        running = self.scheduler.running
        return dict(num_running=len(running), max_batch_size=self.config.max_batch_size,
                    **self.kv.report_fields(running), **self.encoder.report(), **self.state.report())

    def _report(self, start_s: float, wall_s: float, plan: StepPlan, outcome: ForwardOutcome,
                running: tuple[RunningEntry, ...]) -> StepEvent:
        stats = outcome.stats
        finished = tuple(self._retire(r) for r in self._pending_finished)
        self._pending_finished.clear()
        return StepEvent(
            step=self.step_index, start_s=start_s, t=self.now(), wall_s=wall_s, layout=self.config.layout,
            rows=stats.rows, prefill_tokens=sum(c.num_tokens for c in plan.chunks if c.phase == "prefill"),
            decode_tokens=sum(c.num_tokens for c in plan.chunks if c.phase == "decode"),
            query_positions=stats.query_positions, padded_positions=stats.padded_positions,
            padding_ratio=_ratio(stats.padded_positions, stats.query_positions),
            key_positions=stats.key_positions, key_padded_positions=stats.key_padded_positions,
            key_padding_ratio=_ratio(stats.key_padded_positions, stats.key_positions), **self._pool_fields(),
            running=running, finished=finished, num_waiting=len(self.scheduler.waiting),
            faults=tuple(sorted(self._faults)), taint=outcome.taint, flow=outcome.flow, nonfinite=outcome.nonfinite,
            stale_masks=tuple(dict.fromkeys((s.victim, s.source, s.row) for s in self.output.grammar.take_stale())),
            errors=tuple((plan.chunks[i].request.request_id, text) for i, text in outcome.errors),
        )

    def run_until_done(self, max_steps: int = 100_000) -> list[StepEvent]:
        """Step until no request is left (tests and solo runs). Raises RuntimeError past max_steps."""
        reports = []
        while self.has_unfinished():
            if len(reports) >= max_steps:
                raise RuntimeError(f"engine did not finish within {max_steps = }")
            reports.append(self.step())
        return reports


def _merge_taint(taint: tuple, cross: tuple) -> tuple:
    """Self-attention taint and cross-attention taint (engine/encoder.py), one TaintEntry per victim."""
    merged = {t.request_id: t for t in taint}
    for c in cross:
        t = merged.get(c.request_id)
        merged[c.request_id] = c if t is None else t.model_copy(update=dict(
            sources=t.sources + tuple(s for s in c.sources if s not in t.sources), positions=t.positions + c.positions,
            examples=(t.examples + c.examples)[:5]))
    return tuple(merged.values())


ENCODER_CACHE_ENTRIES = 16  # Whisper tiny.en: 16 x 18.4 MB (4 layers x K,V x 6 heads x 1500 x 64 x fp32)


def encoder_capacity(config: EngineConfig) -> int:
    """Encoder-cache entries by default: ENCODER_CACHE_ENTRIES, or twice the requests that may run at once
    (slots, or max_batch_size with paged KV) when that is more, so every running request's audio fits
    and finished ones stay cached for reuse."""
    return max(ENCODER_CACHE_ENTRIES, 2 * (config.num_slots if config.kv == "slots" else config.max_batch_size))


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _make_kv(model, config: EngineConfig, serial_of, name_of=None, state: StateSide | None = None) -> KVCache:
    """The KV cache config.kv asks for, its pool shaped from the model: slots (SlotCache over KVPool), or
    paged blocks (PagedCache over PagedKVPool: num_blocks, else from kv_budget_bytes, else as much memory
    as the slot pool: slots x ceil(max_len / block_size) + 1). `serial_of`: request id -> writer serial,
    `name_of` the reverse. `state`: the state side; a hybrid's pool holds K/V for its attention layers only,
    and its prefix hits need state checkpoints (StateSide.checkpoints).
    The only place that reads the KV mode."""
    state = state or NoState()
    layers, _, kv_heads, head_dim = model_geometry(model)
    layers -= len(state.pool.shape.linear_layers) if state.pool is not None else 0
    common = dict(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, max_len=config.max_len,
                  dtype=next(model.parameters()).dtype, device=config.device, kv_budget_bytes=config.kv_budget_bytes)
    if config.kv == "paged":
        blocks = config.num_blocks or config.num_slots * -(-config.max_len // config.block_size) + 1
        pool = PagedKVPool(num_blocks=blocks, block_size=config.block_size, **common)
        return PagedCache(pool, caching=config.prefix_caching, watermark=config.watermark, serial_of=serial_of,
                          name_of=name_of, offload_blocks=config.kv_offload_blocks, needs_state=state.checkpoints)
    return SlotCache(KVPool(num_slots=config.num_slots, **common), serial_of=serial_of)


def make_encoder_side(model, pool, *, capacity: int, enforce_eager: bool = False, image_encoder=None,
                      batch_invariant: bool = False, state: StateSide | None = None, compile: bool | None = False):
    """(ModelRunner, EncoderSide) for `model`: the one place that reads the model's kind (besides
    state_side.make_state_side, which picks the state side from it).
    An encoder-decoder (Whisper; `config.is_encoder_decoder`): EncoderDecoderRunner and CrossAttentionInputs
    with an encoder cache of `capacity` entries. A hybrid (linear-attention layers beside attention layers):
    HybridRunner over the state side's StatePool (`state`, checkpoints at block boundaries when it keeps
    them) and TokenInputs. Any other causal LM: ModelRunner (`enforce_eager`, `batch_invariant`: see
    ModelRunner; `compile`: its compiled decode step, see EngineConfig.compile) and TokenInputs, or with an `image_encoder` (kvtui.models.vision.ImageEncoder) ImageInputs
    with an image cache of `capacity` entries (one encoder forward per picture when batch_invariant).

    Raises:
        ValueError: batch_invariant where the model or enforce_eager does not allow it (ModelRunner)."""
    kind = model_kind(model.config)
    if kind is ModelKind.ENCODER_DECODER:
        if batch_invariant:
            raise ValueError(batch_invariant_problem(model))
        runner = EncoderDecoderRunner(model, pool)
        return runner, CrossAttentionInputs(runner, capacity)
    hidden = model.get_input_embeddings().embedding_dim
    if kind is ModelKind.HYBRID:
        runner = HybridRunner(model, pool, state.pool, batch_invariant=batch_invariant,
                              checkpoint_every=pool.block_size if state.checkpoints else None)
        return runner, TokenInputs(hidden, kind=kind)
    runner = ModelRunner(model, pool, enforce_eager=enforce_eager, batch_invariant=batch_invariant, compile=compile)
    if image_encoder is not None:
        side = ImageInputs(hidden, image_encoder, capacity)
        side.one_at_a_time = batch_invariant
        return runner, side
    return runner, TokenInputs(hidden)
