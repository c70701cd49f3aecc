"""Planning: a scenario + a tokenizer -> the list of requests a run submits, fixed by the seed.

Every random choice draws from its own stream, seeded by `derive_seed(scenario.seed, label)`, so
changing one part of a scenario (the prompt kind, the engine) leaves the others as they were: the
two scenarios of a bucketing on/off pair get the same arrivals, prompts and lengths.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, replace

from kvtui.faults import acts_on
from kvtui.model_kinds import ModelKind
from kvtui.models.registry import kind_of
from kvtui.request import (
    NO_FACTS,
    AudioClip,
    Canary,
    EmbedsPrompt,
    ImagePrompt,
    InputSpec,
    PlannedRequest,
    PromptFacts,
    SessionTurn,
    TokenPrompt,
)
from kvtui.scenario.arrivals import Arrival, arrivals
from kvtui.scenario.base import MAX_PLANNED
from kvtui.scenario.lora import LoraPlan
from kvtui.scenario.prompts import (
    AUDIO_KINDS,
    IMAGE_KINDS,
    AudioPrompts,
    FilePrompts,
    ImagePassphrasePrompts,
    MultiTurnPrompts,
    PassphrasePrompts,
    SpokenPassphrasePrompts,
    SyntheticPrompts,
    SystemPromptPrompts,
    TracePassphrasePrompts,
    chat_ids,
    encode_text,
    passphrases,
    random_ids,
    to_id_list,
    user_chat,
)
from kvtui.scenario.request_ids import assign_ids
from kvtui.scenario.sampling import asked_min_tokens, pick_entry, request_fields
from kvtui.scenario.schema import Scenario
from kvtui.scenario.tenants import TenantPlan
from kvtui.scenario.trace import MOONCAKE_BLOCK_TOKENS
from kvtui.scenario.trace_prompts import CanaryText, encode_piece


@dataclass(frozen=True)
class MadePrompt:
    """One prompt as PromptMaker makes it: the PlannedRequest fields a `prompts` section decides.

    Attributes:
        input: its InputSpec (kvtui/request.py); text: its text (None: ids only); canary: its
            passphrase canary or None; facts: what the plan knows of it for reports.
    """

    input: InputSpec
    text: str | None = None
    canary: Canary | None = None
    facts: PromptFacts = NO_FACTS


def embeds_mask(tokenizer, ids: list[int], phrase: str | None) -> tuple[bool, ...]:
    """prompt_is_token_ids for a prompt sent as embedding rows: all False (phrase None), or False at the
    tokens that spell `phrase` (found by decoding the prompt token by token) and True elsewhere.

    Raises:
        ValueError: `phrase` is not in the decoded prompt."""
    if phrase is None:
        return (False,) * len(ids)
    ends = [len(tokenizer.decode(ids[: i + 1], skip_special_tokens=False)) for i in range(len(ids))]
    start = tokenizer.decode(ids, skip_special_tokens=False).find(phrase)
    if start < 0:
        raise ValueError(f"passphrase {phrase!r} is not in the decoded prompt")
    end = start + len(phrase)
    return tuple(not (b > start and a < end) for a, b in zip([0, *ends[:-1]], ends))


def derive_seed(seed: int, label: str) -> int:
    """A 63-bit seed for the stream `label`, from the scenario seed (sha256, stable everywhere)."""
    digest = hashlib.sha256(f"kvtui:{seed}:{label}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class PromptMaker:
    """Makes each request's prompt (a MadePrompt: input, text, canary, facts) from the `prompts` section."""

    def __init__(self, scenario: Scenario, tokenizer):
        self.spec, self.tok, seed = scenario.prompts, tokenizer, scenario.seed
        self.rng = random.Random(derive_seed(seed, "prompts"))
        self.length_rng = random.Random(derive_seed(seed, "prompt_tokens"))
        self.phrases = passphrases(random.Random(derive_seed(seed, "passphrases")))
        self.pictures: dict[int, tuple] = {}  # image_passphrase: picture index -> (word, hash, pixels)
        self.count = 0
        self.prefix: list[int] = []
        if isinstance(self.spec, SyntheticPrompts) and self.spec.shared_prefix_tokens:
            prefix_rng = random.Random(derive_seed(seed, "prefix"))
            self.prefix = random_ids(prefix_rng, self.spec.shared_prefix_tokens, tokenizer)
        self.file_prompts = self.spec.prompts if isinstance(self.spec, FilePrompts) else []
        self.shared = SharedPrompts(self.spec, seed, tokenizer)
        self.canary_text: CanaryText | None = None
        if isinstance(self.spec, TracePassphrasePrompts):
            block = getattr(scenario.arrivals, "hash_block_size", MOONCAKE_BLOCK_TOKENS)
            self.canary_text = CanaryText(tokenizer, lambda h: derive_seed(seed, f"hash_block:{h}"), block)

    def image(self, spec: ImagePassphrasePrompts, index: int, facts: PromptFacts) -> MadePrompt:
        """An image request: canary picture `index mod pictures` at the template's <image> (one position, its
        placeholder id), the picture's word as its passphrase (an ImagePrompt with the ImagePart)."""
        from kvtui.engine.inputs import ImagePart
        from kvtui.models.dinov2 import image_hash, image_tensor
        from kvtui.models.projector import CANARY_WORDS, canary_image, prompt_with_image
        from kvtui.models.vision import CANARY_SEED, IMAGE_TOKENS

        k = index % spec.pictures
        if k not in self.pictures:
            word = CANARY_WORDS[k]
            picture = canary_image(word, CANARY_SEED, k)
            self.pictures[k] = (word, image_hash(picture), image_tensor(picture))
        word, digest, pixels = self.pictures[k]
        ids, positions = prompt_with_image(self.tok, spec.template, IMAGE_TOKENS)
        part = ImagePart(positions[0], IMAGE_TOKENS, digest, pixels, uuid="image-0" if spec.uuids == "reused" else None,
                         label=f"{word}.png")
        text = spec.template.replace("<image>", f"[picture of {word}]")
        return MadePrompt(ImagePrompt(tuple(ids), (part,)), text, Canary(word.upper()), facts)

    def mask_pair_second(self, facts: PromptFacts) -> MadePrompt:
        """`embeds: mask_pairs`: the previous request's ids with its rows' positions as the placeholder id,
        the same tensor, every position a token id. No passphrase of its own (it does not say one)."""
        from kvtui.engine.inputs import PLACEHOLDER_ID

        ids, mask, text = self.last_embedded
        second = [t if keep else PLACEHOLDER_ID for t, keep in zip(ids, mask)]
        return MadePrompt(EmbedsPrompt(tuple(second), (True,) * len(ids), rows_of=tuple(ids)), text, facts=facts)

    def text_ids(self, text: str, chat: bool) -> list[int]:
        return chat_ids(self.tok, user_chat(text)) if chat else encode_text(self.tok, text)

    def make(self, arrival: Arrival) -> MadePrompt:
        spec, index = self.spec, self.count
        self.count += 1
        drawn = spec.prompt_tokens.sample(self.length_rng) if isinstance(spec, SyntheticPrompts) else 0
        facts = PromptFacts(trace_prompt_tokens=arrival.prompt_tokens or None)
        if arrival.prompt is not None:
            return MadePrompt(TokenPrompt(tuple(self.text_ids(arrival.prompt, arrival.chat))), arrival.prompt)
        if isinstance(spec, PassphrasePrompts):
            if spec.embeds == "mask_pairs" and index % 2:
                return self.mask_pair_second(facts)
            phrase = next(self.phrases)
            text = spec.text(index, phrase)
            facts = replace(facts, opening=index % len(spec.openings)) if spec.openings else facts
            ids = tuple(chat_ids(self.tok, user_chat(text)))
            prompt: InputSpec = TokenPrompt(ids)
            if spec.embeds != "none":
                mask = embeds_mask(self.tok, list(ids), None if spec.embeds == "all" else phrase)
                prompt = EmbedsPrompt(ids, mask)
                self.last_embedded = (list(ids), mask, text)
            return MadePrompt(prompt, text, Canary(phrase), facts)
        if isinstance(spec, SyntheticPrompts):
            n = arrival.prompt_tokens or drawn
            ids = self.prefix + random_ids(self.rng, n, self.tok)
            return MadePrompt(TokenPrompt(tuple(ids)),
                              facts=PromptFacts(prompt_tokens=len(ids), shared_prefix_tokens=len(self.prefix)))
        if isinstance(spec, FilePrompts):
            k = index % len(self.file_prompts)
            item = self.file_prompts[k]
            facts = replace(facts, prompt_index=k)
            if isinstance(item, list):
                text = next((m["content"] for m in reversed(item) if m["role"] == "user"), item[-1]["content"])
                return MadePrompt(TokenPrompt(tuple(chat_ids(self.tok, item))), text, facts=facts)
            return MadePrompt(TokenPrompt(tuple(self.text_ids(item, spec.chat))), item, facts=facts)
        if isinstance(spec, (SystemPromptPrompts, MultiTurnPrompts)):
            ids, facts = self.shared.make(index, self.rng, self.length_rng)
            return MadePrompt(TokenPrompt(tuple(ids)), facts=facts)
        if isinstance(spec, (SpokenPassphrasePrompts, AudioPrompts)):
            return self.audio(spec, index, facts)
        if isinstance(spec, ImagePassphrasePrompts):
            return self.image(spec, index, facts)
        if isinstance(spec, TracePassphrasePrompts):
            return self.trace_passphrase(spec, arrival)
        raise TypeError(f"unknown prompt spec {type(spec).__name__}")

    def trace_passphrase(self, spec: TracePassphrasePrompts, arrival: Arrival) -> MadePrompt:
        """A trace row's prompt: its hash ids' canary blocks, words of its own, its passphrase last; the
        trace's prompt length (or one drawn from `prompt_tokens`), token ids without a chat template."""
        phrase = next(self.phrases)
        tail = encode_piece(self.tok, spec.template.replace("{passphrase}", phrase))
        length = arrival.prompt_tokens or spec.prompt_tokens.sample(self.length_rng)
        ids = self.canary_text.prompt(arrival.hash_ids, length, tail, self.rng)
        facts = PromptFacts(prompt_tokens=len(ids), trace_prompt_tokens=arrival.prompt_tokens or None,
                            hash_ids=arrival.hash_ids)
        return MadePrompt(TokenPrompt(tuple(ids)), None, Canary(phrase), facts)

    def audio(self, spec, index: int, facts: PromptFacts) -> MadePrompt:
        """A speech request: its clip (in turn) with the decoder prompt [<|startoftranscript|>,
        <|notimestamps|>], its text "[audio <clip name>]"; a spoken passphrase's canary is the clip's
        name (the passphrase is in the audio)."""
        files = spec.files
        clip = files[index % len(files)]
        canary = Canary(clip.stem.upper(), spoken=True) if isinstance(spec, SpokenPassphrasePrompts) else None
        clip_input = AudioClip(str(clip), tuple(decoder_prompt(self.tok, spec.initial_prompt)))
        return MadePrompt(clip_input, f"[audio {clip.name}]", canary, facts)


def decoder_prompt(tokenizer, initial_prompt: str = "") -> list[int]:
    """Whisper's decoder prompt [<|startoftranscript|>, <|notimestamps|>] in `tokenizer`'s ids; with an
    `initial_prompt`, [<|startofprev|>, its text's ids] first (as Whisper's prompt conditioning; a
    tokenizer without <|startofprev|>, tiny-whisper's, gets the text's ids alone).

    Raises:
        ValueError: the tokenizer is not a Whisper one (no such tokens).
    """
    if not hasattr(tokenizer, "convert_tokens_to_ids"):
        raise ValueError("not a Whisper tokenizer")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|startoftranscript|>", "<|notimestamps|>")]
    unk = getattr(tokenizer, "unk_token_id", None)
    if any(i is None or i == unk for i in ids):
        raise ValueError("not a Whisper tokenizer")
    if not initial_prompt:
        return ids
    prev = tokenizer.convert_tokens_to_ids("<|startofprev|>")
    text = to_id_list(tokenizer.encode(" " + initial_prompt.strip(), add_special_tokens=False))
    return ([prev] if prev is not None and prev != unk else []) + text + ids


def audio_mismatch(scenario: Scenario, tokenizer, model: str) -> str:
    """One line when the prompts and the model do not go together (audio prompts need a speech model, a
    speech model needs audio prompts); "" when they do."""
    try:
        decoder_prompt(tokenizer)
        speech = True
    except (ValueError, AttributeError, KeyError, TypeError):
        speech = False
    audio = scenario.prompts.kind in AUDIO_KINDS
    if audio and not speech:
        return (f"prompts kind {scenario.prompts.kind} is audio, and model {model} is not a speech model; "
                "use --model whisper-tiny.en (or tiny-whisper)")
    if speech and not audio:
        return (f"model {model} is a speech model (Whisper) and takes audio; use prompts kind spoken_passphrase "
                "or audio (see scenarios/transcribe.yaml)")
    images = scenario.prompts.kind in IMAGE_KINDS
    image_model = kind_of(model) is ModelKind.IMAGE_TEXT
    if images and not image_model:
        return (f"prompts kind {scenario.prompts.kind} shows images, and model {model} has no image encoder; "
                "use --model dinov2-smollm2 (or tiny-vision)")
    kind = (ModelKind.ENCODER_DECODER if speech else ModelKind.IMAGE_TEXT if image_model
            else ModelKind.HYBRID if kind_of(model) is ModelKind.HYBRID else ModelKind.DECODER_ONLY)
    named = [*scenario.engine.faults, *(e.fault_switch[0] for e in scenario.timeline if e.fault_switch)]
    wrong = next((n for n in named if not acts_on(n, kind)), None)
    if wrong:
        return f"fault {wrong} does not act on {kind} models like {model}; drop it (`kvtui faults` lists them)"
    return ""


class SharedPrompts:
    """Prompts that share prefixes: system_prompt (one of N system prompts + instruction + own part) and
    multi_turn (each turn extends its session's previous prompt). Random ids, each kind of choice on
    its own seeded stream."""

    def __init__(self, spec, seed: int, tokenizer) -> None:
        self.spec, self.tok = spec, tokenizer
        rng = random.Random(derive_seed(seed, "system_prompts"))
        self.choice_rng = random.Random(derive_seed(seed, "system_prompt_choice"))
        count = getattr(spec, "count", 1)
        self.systems = [random_ids(rng, getattr(spec, "system_tokens", 0), tokenizer) for _ in range(count)]
        self.instruction = random_ids(rng, getattr(spec, "instruction_tokens", 0), tokenizer)
        self.sessions: dict[int, tuple[int, int, list[int]]] = {}  # place -> (session, turn, prompt so far)
        self.next_session = 0

    def make(self, index: int, rng: random.Random, length_rng: random.Random) -> tuple[list[int], PromptFacts]:
        spec = self.spec
        if isinstance(spec, SystemPromptPrompts):
            k = self.choice_rng.randrange(spec.count) if spec.choice == "random" else index % spec.count
            own = random_ids(rng, spec.user_tokens.sample(length_rng), self.tok)
            return self.systems[k] + self.instruction + own, PromptFacts(system_prompt=k)
        place = index % spec.sessions
        session, turn, prompt = self.sessions.get(place, (None, spec.turns, []))
        if turn >= spec.turns:  # a new session takes this place
            session, turn, prompt = self.next_session, 0, list(self.systems[0])
            self.next_session += 1
        else:
            prompt = prompt + random_ids(rng, spec.reply_tokens.sample(length_rng), self.tok)
        prompt = prompt + random_ids(rng, spec.user_tokens.sample(length_rng), self.tok)
        self.sessions[place] = (session, turn + 1, prompt)
        return list(prompt), PromptFacts(session=session, turn=turn)


def planned_arrivals(scenario: Scenario, *, limit: int | None = None) -> list[Arrival]:
    """The run's arrivals in time order, without prompts (no tokenizer needed).

    Stops at the first of: `max_requests`, an arrival at or after `duration_s` (seconds), `limit`,
    the end of a finite process (trace, scripted, stages), or MAX_PLANNED. Arrival-rate changes in
    the timeline are applied here.
    """
    cap = min(n for n in (scenario.max_requests, limit, MAX_PLANNED) if n is not None)
    changes = [(e.at_s, e.arrival_changes()) for e in scenario.timeline if e.arrival_changes()]
    stream = arrivals(scenario.arrivals, random.Random(derive_seed(scenario.seed, "arrivals")), changes)
    out: list[Arrival] = []
    for arrival in stream:
        if len(out) >= cap or (scenario.duration_s is not None and arrival.at_s >= scenario.duration_s):
            break
        out.append(arrival)
    return out


def _bad_words(params, tokenizer, cache: dict):
    """`params` with its bad words' token ids (vLLM's tokenization, once per word list)."""
    from kvtui.engine.sampling import bad_words_token_ids

    if not params.bad_words:
        return params
    if params.bad_words not in cache:
        cache[params.bad_words] = bad_words_token_ids(tokenizer, params.bad_words)
    return replace(params, bad_words_ids=cache[params.bad_words])


def plan_requests(scenario: Scenario, tokenizer, *, limit: int | None = None,
                  sessions: bool = False) -> list[PlannedRequest]:
    """The requests of a run, in arrival order, fully determined by the scenario (and its seed): one
    per `planned_arrivals(scenario, limit=limit)`. The timeline's arrival-rate changes are applied there;
    the other timeline knobs are the session's to apply.

    With `sessions` (a --target run) and a `sessions` section, each of those requests opens a session (its
    `turn` set) and every later turn follows, after all first turns: request id "<first>-t<k>", its
    follow-up text, the session's canary, tenant and salt, its think time drawn from the seed's own stream;
    its chat and input are made when it is sent (kvtui/remote/session.py). Without `sessions` the section
    is left alone (a local run sends first turns only).
    """
    planned = _plan_first(scenario, tokenizer, limit=limit)
    if not sessions or scenario.sessions is None:
        return planned
    return with_turns(scenario, planned)


def with_turns(scenario: Scenario, planned: list[PlannedRequest]) -> list[PlannedRequest]:
    """`planned` as the first turns of sessions, followed by their later turns (see plan_requests)."""
    spec = scenario.sessions
    think_rng = random.Random(derive_seed(scenario.seed, "think_time"))
    firsts, later = [], []
    for p in planned:
        firsts.append(replace(p, turn=SessionTurn(p.request_id, 0, spec.turns)))
        for k in range(1, spec.turns):
            rid = f"{p.request_id}-t{k}"
            later.append(replace(
                p, request_id=rid, text=spec.follow_up, turn=SessionTurn(p.request_id, k, spec.turns,
                                                                         spec.think_time_s.sample(think_rng)),
                sampling=replace(p.sampling, seed=derive_seed(scenario.seed, f"sampling:{rid}")),
                facts=replace(p.facts, turn=k), client_id=None, round=None, cancel_after=None))
    return firsts + later


def _plan_first(scenario: Scenario, tokenizer, *, limit: int | None = None) -> list[PlannedRequest]:
    """One request per planned arrival (plan_requests without sessions)."""
    from kvtui.engine.request import SamplingParams

    seed = scenario.seed
    maker = PromptMaker(scenario, tokenizer)
    tenants = TenantPlan(scenario.tenants, seed, derive_seed)
    adapters = LoraPlan(scenario.lora, seed, derive_seed)
    out_rng = random.Random(derive_seed(seed, "output_tokens"))
    s = scenario.sampling
    n_rng = random.Random(derive_seed(seed, "parallel_sampling"))  # its own stream: n leaves the rest of the plan alone
    structured_rng = random.Random(derive_seed(seed, "structured_output"))  # so does structured output
    spec = s.structured.spec() if s.structured is not None else None
    planned: list[tuple[Arrival, MadePrompt, int, str | None, tuple]] = []
    for index, arrival in enumerate(planned_arrivals(scenario, limit=limit)):
        made = maker.make(arrival)
        drawn = scenario.output_tokens.sample(out_rng)
        session = made.facts.session
        tenant = arrival.tenant or tenants.name(session if session is not None else index)
        n = s.n if s.n > 1 and n_rng.random() < s.n_fraction else 1
        constrained = spec if spec is not None and structured_rng.random() < s.structured.fraction else None
        planned.append((arrival, made, arrival.output_tokens or drawn, tenant, (n, constrained)))
    width = max(3, len(str(len(planned) - 1)))
    mix_rng = random.Random(derive_seed(seed, "sampling_mix"))
    entries = [pick_entry(s.mix, mix_rng) if s.mix else None for _ in planned]
    words: dict = {}  # bad words -> token ids, tokenized once
    ids_spec = scenario.request_ids
    client_ids = assign_ids(ids_spec, seed, len(planned)) if ids_spec is not None else [None] * len(planned)
    return [
        PlannedRequest(
            request_id=f"r{i:0{width}d}",
            arrival_s=arrival.at_s,
            input=made.input,
            sampling=_bad_words(SamplingParams(
                **request_fields(s, entry, n_out), seed=derive_seed(seed, f"sampling:{i}"),
                max_new_tokens=n_out, stop=tuple(s.stop), ignore_eos=s.ignore_eos,
                include_stop_str_in_output=s.include_stop_str_in_output, n=extra[0], structured=extra[1]),
                tokenizer, words),
            text=made.text, canary=made.canary, facts=made.facts, tenant=tenant, cache_salt=tenants.salt(tenant),
            round=arrival.round, cancel_after=arrival.cancel_after, client_id=client_id,
            min_tokens_asked=asked_min_tokens(s, entry), adapter=adapters.name(i),
        )
        for i, ((arrival, made, n_out, tenant, extra), entry, client_id)
        in enumerate(zip(planned, entries, client_ids))
    ]
