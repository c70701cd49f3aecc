"""The only module that calls the model and moves device tensors.

ModelRunner switches a transformers causal LM (Llama family, GPT-2, ...) to the "kvtui" attention,
gives it a PooledCache over the KV pool, and runs one forward per step on a BatchTensors, returning
float32 logits for the positions that sample.
"""

from __future__ import annotations

import threading
from dataclasses import fields, replace

import torch

from kvtui.engine import fused as fused_forward
from kvtui.engine.attention import PooledCache, StepInterrupted, StepState, register_attention
from kvtui.engine.batching import BatchTensors
from kvtui.engine.compiled import bound_step, compile_problem, compiled_decode, decode_only
from kvtui.engine.cpu_kernels import choose_for
from kvtui.engine.kv_pool import KVPool
from kvtui.faults import FP16_MASK_CONSTANT


def model_geometry(model) -> tuple[int, int, int, int]:
    """(num_layers, num_heads, num_kv_heads, head_dim) from a transformers config (Llama or GPT-2 names;
    an encoder-decoder's decoder: Whisper's decoder_layers, decoder_attention_heads)."""
    cfg = model.config
    layers = getattr(cfg, "decoder_layers", None) or getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    heads = getattr(cfg, "decoder_attention_heads", None) or getattr(cfg, "num_attention_heads", None) or cfg.n_head
    kv_heads = heads if getattr(cfg, "decoder_attention_heads", None) else getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return layers, heads, kv_heads, head_dim


def batch_invariant_problem(model, enforce_eager: bool = False) -> str | None:
    """Why the batch-invariant mode cannot run `model` (a transformers model), or None: it runs on kvtui's
    fused forward, so Llama-family causal LMs only, and not with enforce_eager."""
    if enforce_eager:
        return "batch_invariant runs Llama-family models on kvtui's own forward: drop --enforce-eager"
    if not fused_forward.supports(model):
        return (f"batch_invariant runs Llama-family models on kvtui's own forward, not {model.config.model_type!r}: "
                "drop it (--batch-invariant, engine.batch_invariant) or choose such a model")
    return None


class _Turnstile:
    """Runs actions from several threads in ticket order (0, 1, 2, ...): `turnstile(ticket, action)` waits
    for the ticket's turn, runs the action, and passes the turn on even when the action raises."""

    def __init__(self) -> None:
        self._next = 0
        self._changed = threading.Condition()

    def __call__(self, ticket: int, action) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._next == ticket, timeout=60)
            try:
                action()
            finally:
                self._next += 1
                self._changed.notify_all()


class ModelRunner:
    """Runs forwards of `model` over `pool` (see module docstring).

    Args:
        model: a transformers PreTrainedModel for causal LM, in eval mode.
        pool: the KV pool (its dtype is the model's, its device the model's).
        enforce_eager: run the model's own transformers modules; False (the default) runs kvtui's
            fused forward (kvtui/engine/fused.py) where the model supports it, the modules elsewhere.
        batch_invariant: the batch-invariant mode (kvtui/engine/invariant.py): fixed row tiles chosen
            on this CPU, attention per query position.
        compile: the compiled decode step (kvtui/engine/compiled.py): True where it can run, None too
            unless $KVTUI_COMPILE=0, False never (EngineConfig.compile); `compile_note` says which and why.

    Raises:
        ValueError: batch_invariant on a model the fused forward does not run, or with enforce_eager.
    """

    def __init__(self, model, pool: KVPool, *, enforce_eager: bool = False, batch_invariant: bool = False,
                 compile: bool | None = False) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.dtype = pool.dtype
        model.set_attn_implementation(register_attention())
        self.cache = PooledCache(pool)
        self.body = model.base_model
        self.fused = None if enforce_eager or not fused_forward.supports(model) else fused_forward.fused_for(model)
        self.tiles = self.tile_figures = None
        if batch_invariant:
            problem = batch_invariant_problem(model, enforce_eager)
            if problem:
                raise ValueError(problem)
            self.tiles, self.tile_figures = self.fused.invariant_tiles()
        # the compiled decode step (kvtui/engine/compiled.py): compile True takes it where it can run, None
        # too unless $KVTUI_COMPILE=0, False never; compile_note says which and why
        self.compiled = None
        problem = compile_problem(model, compile=compile, enforce_eager=enforce_eager, batch_invariant=batch_invariant)
        if problem is None:
            self.compiled = compiled_decode(self.fused)
            self._attention_modules = [layer.attn for layer in self.fused.layers]
        self.compile_note = "compiled decode step (inductor)" if problem is None else f"eager: {problem}"
        # decode attention on kvtui's C++ kernel where it runs and measures faster (engine/cpu_kernels.py)
        self.decode_kernel, self.attention_note = choose_for(model, pool.dtype, pool.device,
                                                             paged=not isinstance(pool, KVPool))

    @property
    def head(self):
        """The model's LM head module, looked up on each use: the fused forward may replace it (a
        prepacked untied head), and a reference held here would keep the old weight alive."""
        return self.model.get_output_embeddings()

    @property
    def forward_path(self) -> str:
        """"fused" (kvtui's fused forward) or "modules" (transformers' own modules)."""
        return "modules" if self.fused is None else "fused"

    def _to_device(self, batch: BatchTensors) -> BatchTensors:
        if self.device.type == "cpu":
            return batch
        moved = {f.name: getattr(batch, f.name).to(self.device) for f in fields(batch)
                 if isinstance(getattr(batch, f.name), torch.Tensor)}
        return replace(batch, **moved)

    def _run_body(self, batch: BatchTensors, state: StepState, *, bind: bool = True, lora=None) -> torch.Tensor:
        """Forward the model body on `batch` with the cache bound to `state` (bind=False: to whatever is
        bound already, the racy_threads fault) and each row's LoRA adapter (`lora`, fused forward only);
        returns [S, V] float32 logits."""
        masked = FP16_MASK_CONSTANT if state.fp16 else None
        if bind:
            self.cache.state = state
        embeds = self.input_embeds(batch)
        if self.tiles is not None:
            hidden = self.fused.invariant(embeds, batch.position_ids, self.cache, state, self.tiles)
            return self.fused.invariant_logits(hidden[batch.sample_row, batch.sample_col], self.tiles).float().cpu()
        if self.fused is not None:
            mask = None if state.own_range else batch.additive_mask(self.dtype, masked).to(self.device)
            if self.compiled is not None and lora is None and bind and decode_only(batch):
                cos, sin = self.fused.rotary(embeds, position_ids=batch.position_ids)
                with bound_step(self.cache, self._attention_modules, mask):
                    logits = self.compiled(embeds, cos, sin, batch.sample_row, batch.sample_col,
                                           self.pool.keys, self.pool.values)
                return logits.float().cpu()
            hidden = self.fused(embeds, batch.position_ids, self.cache, state, mask, lora)
        else:
            hidden = self.body(
                inputs_embeds=embeds,
                attention_mask=batch.additive_mask(self.dtype, masked).to(self.device),
                position_ids=batch.position_ids,
                cache=self.cache,
                use_cache=True,
            ).last_hidden_state
        hidden = hidden[batch.sample_row, batch.sample_col]  # [S, hidden]
        logits = self.head(hidden) if self.fused is None else self.fused.logits(hidden)
        return logits.float().cpu()

    @torch.inference_mode()
    def token_embeddings(self, token_ids) -> torch.Tensor:
        """The embedding table's rows of `token_ids`: [T, hidden] float32 on the CPU."""
        ids = torch.tensor([int(t) for t in token_ids], dtype=torch.long, device=self.device)
        return self.model.get_input_embeddings()(ids).float().cpu().clone()

    def input_embeds(self, batch: BatchTensors) -> torch.Tensor:
        """[R, Q, hidden] input embeddings of the batch: the embedding table's row of each token id, and
        at the spliced cells (batch.splice_row/col) the supplied rows, cast to the model dtype. The
        same as the model's own embedding of input_ids where nothing is spliced."""
        embeds = self.model.get_input_embeddings()(batch.input_ids)
        if batch.splice_values is not None:
            embeds[batch.splice_row, batch.splice_col] = batch.splice_values.to(embeds.device, embeds.dtype)
        return embeds

    @torch.inference_mode()
    def forward(self, batch: BatchTensors, *, measure_flow: bool = False, fp16: bool = False,
                own_range: bool = True, lora=None) -> tuple[torch.Tensor, StepState]:
        """One forward over the step's batch.

        Args:
            lora: the rows' LoRA adapters (engine/lora.py LoraBatch) or None; the fused forward only
                (Engine.submit rejects an adapter where lora.lora_problem says so).
            measure_flow: accumulate attention probabilities for the attention_flow detector.
            fp16: the fp16_cache fault (see kvtui/faults.py).
            own_range: the own-range attention path; False: the mask path (see attention.py).
        Returns:
            logits: [S, V] float32 on the CPU, one row per sampling chunk (batch.sample_chunk order).
            state: the StepState (attention sums when measure_flow).
        """
        batch = self._to_device(batch)
        state = StepState(batch=batch, own_range=own_range and not fp16, measure_flow=measure_flow, fp16=fp16,
                          invariant=self.tiles is not None, pool=self.pool, decode_kernel=self.decode_kernel)
        try:
            logits = self._run_body(batch, state, **({} if lora is None else {"lora": lora}))
            state.settle_flow()
        finally:
            self.cache.state = None
        return logits, state

    def forward_racy(self, batches: list[BatchTensors], *, fp16: bool = False, own_range: bool = True,
                     loras: list | None = None) -> list[tuple[torch.Tensor | None, str]]:
        """The racy_threads fault: one Python thread per request, each running its own batch-of-one
        forward, all through this runner's single cache-state variable (like a global past_key_values).

        The interleaving is fixed, so a run stays reproducible: every thread binds the shared state in
        turn (thread 0 first), then the threads run their forwards one after another on whatever is bound,
        the last thread's state, so every other thread's layers write and read that request's cache. A
        free-running race does the same on most steps, and on the others varies from run to run.
        `loras`: per batch its request's LoRA adapter (engine/lora.py LoraBatch) or None.
        Returns, per batch, (logits [S, V] or None, error text, e.g. a shape mismatch, or "")."""
        results: list[tuple[torch.Tensor | None, str]] = [(None, "not run")] * len(batches)
        in_turn = _Turnstile()

        def work(index: int, batch: BatchTensors) -> None:
            batch = self._to_device(batch)
            state = StepState(batch=batch, own_range=own_range and not fp16, fp16=fp16, invariant=self.tiles is not None,
                              pool=self.pool, decode_kernel=self.decode_kernel)

            def forward() -> None:
                try:
                    with torch.inference_mode():
                        lora = loras[index] if loras else None
                        results[index] = (self._run_body(batch, state, bind=False, lora=lora), "")
                except Exception as e:  # the race's own failures, e.g. mismatched tensor sizes
                    results[index] = (None, f"{type(e).__name__}: {e}")

            in_turn(index, lambda: setattr(self.cache, "state", state))
            in_turn(len(batches) + index, forward)

        threads = [threading.Thread(target=work, args=(i, b), name=f"racy-{i}") for i, b in enumerate(batches)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.cache.state = None
        if self.cache.interrupt.is_set():  # the threads noted it as their error; it is the step's
            raise StepInterrupted("the step was interrupted")
        return results
