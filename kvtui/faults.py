"""The isolation fault catalogue: one owner for every fact about a fault (torch-free).

Each fault is a named switch that the real code path consults: the batch really is built, masked,
positioned or cached wrongly; nothing is simulated. The engine, the scenario schema, the CLI, the
dashboard and the docs all read this table.

| fault | where it acts |
|---|---|
| shared_cache | batching: every request reads and writes slot 0, one global cache region |
| racy_threads | runner: one Python thread per request, all sharing one cache-state variable |
| no_request_mask | batching, packed: plain causal mask over the concatenation, no block-diagonal part |
| unmasked_cache_padding | batching, padded: cache padding columns left visible |
| shared_position_offset | batching: position ids from a batch-wide counter (the longest cache) |
| stale_slot | admission: a reused slot keeps its previous owner's length and contents, taken for the |
|  | new prompt's cached prefix, so the new request continues the old conversation |
| causal_offset | batching: causal mask built square (key <= query index), ignoring the cache offset |
| fp16_cache | attention and cache: float16 with a -1e9 mask constant (-inf in float16); padded rows |
|  | cached whole, so a fully masked pad row's NaN lands in the cache |
| unsalted_prefix | paged prefix cache: the block key leaves out the cache_salt, so tenants share blocks |
| block_refcount | paged blocks: a finished request's blocks are freed outright while others still hold them |
| shared_partial_block | paged prefix cache: a prompt's partial last block is shared without copy-on-write |
| prefix_key_no_parent | paged prefix cache: the block key leaves out the parent key, so equal blocks collide |
| cow_missing | paged blocks: a forked sequence (n > 1) writes into the partial block it shares in place |
| stale_bitmask | structured output: a plain row's bitmask row is not reset, so the last grammar there restricts it |
| row_state_misalign | sampling rows: the per-row sampler/penalty/bias arrays are not moved when a row leaves |
| shared_rng | sampling: one generator for all requests, reseeded by each request's seed when it joins |
| penalty_shared_history | sampling: penalties count every row's tokens, not the request's own |
| stale_cross_kv | encoder-decoder, slots: the cross-K/V table is indexed by slot and kept when a slot is reused |
| cross_row_misalign | encoder-decoder: the cross-K/V table is indexed by batch row and not compacted when a row leaves |
| encoder_cache_unkeyed | encoder-decoder: the encoder cache is keyed by the decoder prompt, not the audio |
| cross_kv_prefix_cached | encoder-decoder, paged prefix cache: block keys leave out the audio's hash |
| embeds_unkeyed | paged prefix cache: positions filled by supplied embedding rows are keyed by their placeholder ids |
| embeds_mask_unkeyed | paged prefix cache: supplied rows keyed by the tensor's digest, not by which positions are embeddings |
| mm_hash_missing | image models, paged prefix cache: block keys of image positions leave out the image's hash |
| mm_uuid_trusted | image models: the image encoder cache is keyed by the client's uuid for the image, not its content |
| stale_image_embedding | image models: one embedding buffer, filled by the last image encoded, read by every later image |
| lora_unkeyed_prefix | paged prefix cache: block keys leave out the request's LoRA adapter |
| lora_reload_stale | paged prefix cache: block keys name the LoRA adapter but not its version |
| state_slot_not_reset | hybrid state pool: a reused state slot is not zeroed, so a request starts from its previous owner's state |
| state_published_before_write | hybrid checkpoints: published when their chunk is scheduled, written a step later |
| tier_drops_recurrent_state | hybrid offload tier: stores a block's K/V but not its state checkpoint; a restore gets another's |
| state_index_units | hybrid prefix hit: the checkpoint's block index computed with a block size in the wrong units |
| request_id_keyed | `kvtui serve` only (serve/bridge.py): answers routed to clients by the client's x-request-id |

Every fault but the last acts in the engine (`scope: engine`); request_id_keyed acts in `kvtui serve`'s
HTTP layer (`scope: server`), after the engine: the engine's answers are right and reach the wrong client,
so only a client-side audit (`kvtui run --target` with a scenario's `request_ids`) sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

from kvtui.model_kinds import ModelKind


class FaultName(str, Enum):
    """The fault names, typed: use these members at the code paths a fault changes (`FaultName.STALE_SLOT
    in faults`). Each member is its string (`FaultName.STALE_SLOT == "stale_slot"`, `f"{name}"` its value),
    so the names in scenarios, recordings and `--fault` flags stay as they are. A `(str, Enum)`: Python 3.10
    has no enum.StrEnum."""

    SHARED_CACHE = "shared_cache"
    RACY_THREADS = "racy_threads"
    NO_REQUEST_MASK = "no_request_mask"
    UNMASKED_CACHE_PADDING = "unmasked_cache_padding"
    SHARED_POSITION_OFFSET = "shared_position_offset"
    STALE_SLOT = "stale_slot"
    CAUSAL_OFFSET = "causal_offset"
    FP16_CACHE = "fp16_cache"
    UNSALTED_PREFIX = "unsalted_prefix"
    BLOCK_REFCOUNT = "block_refcount"
    SHARED_PARTIAL_BLOCK = "shared_partial_block"
    PREFIX_KEY_NO_PARENT = "prefix_key_no_parent"
    COW_MISSING = "cow_missing"
    STALE_BITMASK = "stale_bitmask"
    # -- per-row sampling state (engine/row_state.py) --
    ROW_STATE_MISALIGN = "row_state_misalign"
    SHARED_RNG = "shared_rng"
    PENALTY_SHARED_HISTORY = "penalty_shared_history"
    STALE_CROSS_KV = "stale_cross_kv"
    CROSS_ROW_MISALIGN = "cross_row_misalign"
    ENCODER_CACHE_UNKEYED = "encoder_cache_unkeyed"
    CROSS_KV_PREFIX_CACHED = "cross_kv_prefix_cached"
    # -- inputs beyond token ids (engine/inputs.py) --
    EMBEDS_UNKEYED = "embeds_unkeyed"
    EMBEDS_MASK_UNKEYED = "embeds_mask_unkeyed"
    MM_HASH_MISSING = "mm_hash_missing"
    MM_UUID_TRUSTED = "mm_uuid_trusted"
    STALE_IMAGE_EMBEDDING = "stale_image_embedding"
    # -- LoRA adapters (engine/lora.py) --
    LORA_UNKEYED_PREFIX = "lora_unkeyed_prefix"
    LORA_RELOAD_STALE = "lora_reload_stale"
    # -- the KV offload tier (engine/offload.py) --
    TIER_KEY_DROPS_PARTITION = "tier_key_drops_partition"
    TIER_LAYOUT_MISMATCH = "tier_layout_mismatch"
    TIER_PARTIAL_LOAD = "tier_partial_load"
    # -- a hybrid's recurrent state (engine/state_pool.py, state_side.py, paged.py, offload.py) --
    STATE_SLOT_NOT_RESET = "state_slot_not_reset"
    STATE_PUBLISHED_BEFORE_WRITE = "state_published_before_write"
    TIER_DROPS_RECURRENT_STATE = "tier_drops_recurrent_state"
    STATE_INDEX_UNITS = "state_index_units"
    # -- kvtui serve's HTTP layer (serve/bridge.py), not the engine --
    REQUEST_ID_KEYED = "request_id_keyed"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# numeric: a near tie flipped by numerical batch variance; unknown: a target server's output differed from
# its solo run and the server gave no logprobs to tell which (neither counts toward the exit code).
# The request-id audit of a target server (kvtui/remote/request_ids.py) adds: hung (no whole answer within
# the wait), lost (the server dropped the request: a 5xx, an error in the stream, a stream cut short) and
# stopped_serving (requests with fresh ids, or /health, failed after the load)
ContaminationKind = Literal["cross_request", "cross_tenant", "corruption", "numeric", "unknown", "hung", "lost",
                            "stopped_serving"]
REQUEST_ID_KINDS = ("hung", "lost", "stopped_serving")
KV_MODES = ("slots", "paged")


@dataclass(frozen=True)
class Fault:
    """One isolation fault.

    Attributes:
        name: the switch's name (`--fault NAME`, `engine.faults`, timeline `{fault: NAME}`).
        breaks: what it breaks, one line.
        acts_in: where in the code path it acts, one line.
        user_sees: the symptom a user sees.
        layouts: the layouts it acts in ("padded", "packed").
        caught_by: the detectors expected to catch it ("engine": the step fails under the fault).
        kind: the kind of the findings it causes: cross_request when the damage needs another request
            (alone, with the same fault, the request gives its clean tokens), corruption when it does not;
            cross_tenant when another tenant's cached KV is served (paged KV prefix caching).
        kv: the KV modes it acts in ("slots", "paged"); an engine refuses a fault outside its mode.
        needs: engine settings its scenario needs besides kv (e.g. "prefix_caching").
        models: the ModelKinds it acts on: DECODER_ONLY, ENCODER_DECODER (cross-attention faults), IMAGE_TEXT
            (image faults; a fault that acts on decoder-only models acts on image-text ones too), HYBRID (the
            recurrent-state faults: they act on a hybrid only, and the other faults do not act on it); () for a
            server fault, which acts on no model.
        scope: "engine" (it acts in the engine, in a local run and in `kvtui serve` alike) or "server" (it acts
            in `kvtui serve`'s HTTP layer only: `kvtui serve --fault NAME`; a local run refuses it).
    """

    name: str
    breaks: str
    acts_in: str
    user_sees: str
    layouts: tuple[str, ...]
    caught_by: tuple[str, ...]
    kind: ContaminationKind
    kv: tuple[str, ...] = ("slots",)
    needs: tuple[str, ...] = ()
    models: tuple[ModelKind, ...] = (ModelKind.DECODER_ONLY, ModelKind.ENCODER_DECODER)
    scope: Literal["engine", "server"] = "engine"


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("shared_cache", "all requests read and write one cache region (a global past_key_values)",
          "batching: every request's keys and values go to and come from slot 0",
          "answers cross: B's content shows up in A's answer",
          ("padded", "packed"), ("slot_taint", "attention_flow", "reference", "canary"), "cross_request"),
    Fault("racy_threads", "one thread per request over a shared cache variable: state races, shape errors",
          "runner: a Python thread per request, all through one cache-state variable",
          "outputs differ from run to run; shape errors",
          ("padded", "packed"), ("reference",), "cross_request", KV_MODES, models=(ModelKind.DECODER_ONLY,)),
    Fault("no_request_mask", "packed batch without the block-diagonal mask: queries see other requests' keys",
          "batching (packed): a plain causal mask over the concatenated requests",
          "A drifts toward B; passphrases leak",
          ("packed",), ("attention_flow", "slot_taint", "reference"), "cross_request", KV_MODES),
    Fault("unmasked_cache_padding", "mask hides input pads but not the padding inside cached K/V",
          "batching (padded): cache-padding key columns are left visible",
          "repetition and garbage on shorter rows",
          ("padded",), ("slot_taint", "attention_flow", "reference"), "cross_request", KV_MODES),
    Fault("shared_position_offset", "position ids from a batch-wide counter: shorter rows get wrong RoPE offsets",
          "batching: every row's position ids start at the longest cache in the batch",
          "drift on the shorter rows of a batch",
          ("padded", "packed"), ("reference",), "cross_request", KV_MODES),
    Fault("stale_slot", "a reused slot keeps its old length and contents: the new request continues the old one",
          "admission: the slot's old length and contents are taken for the new prompt's cached prefix",
          "a new request continues the previous occupant's conversation",
          ("padded", "packed"), ("slot_taint", "attention_flow", "canary", "reference"), "cross_request"),
    Fault("causal_offset", "causal mask built square, ignoring the cache offset: decode sees only the first keys",
          "batching: the causal part compares key index with query index, not with its position",
          "garbage after the first decode step",
          ("padded", "packed"), ("reference",), "corruption", KV_MODES),
    Fault("fp16_cache", "float16 cache and attention with a -1e9 mask (= -inf): pad rows turn NaN and poison",
          "attention and cache: float16 with the -1e9 constant; pad rows cached whole",
          "NaN logits, garbled text (float32 or bfloat16 avoids it)",
          ("padded",), ("reference",), "cross_request"),
    Fault("unsalted_prefix", "the prefix-cache key leaves out the tenant's cache_salt: tenants share cached blocks",
          "block_manager: lookup and registration keys are computed without the salt",
          "answers stay right, but one tenant's prompt is served from another's cache: a cache hit (shorter "
          "TTFT) tells an attacker a guessed prompt prefix was sent by someone else",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "attention_flow"), "cross_tenant", ("paged",),
          ("prefix_caching",)),
    Fault("block_refcount", "a finished request frees its blocks outright, even while another request still holds them",
          "block_manager: free sets a block's reference count to 0 instead of decrementing it",
          "a new request is given a block a running request still reads, overwrites it, and the reader "
          "attends to foreign K/V: its answer drifts",
          ("padded", "packed"), ("slot_taint", "attention_flow", "reference"), "cross_request", ("paged",),
          ("prefix_caching",)),
    Fault("shared_partial_block", "a prompt's partially filled last block is shared without copy-on-write",
          "block_manager: the partial last block of a prompt is cached and handed to an identical prompt as is",
          "two requests with the same prompt decode into the same block: each one's new tokens overwrite the "
          "other's, and their answers drift",
          ("padded", "packed"), ("slot_taint", "attention_flow", "reference"), "cross_request", ("paged",),
          ("prefix_caching",)),
    Fault("prefix_key_no_parent", "the prefix-cache key leaves out the parent block's key: equal blocks collide",
          "block_manager: a block's key is its tokens and its partition (cache_salt, adapter) alone, not chained "
          "to its prefix",
          "a block of tokens seen before under another prefix is reused with K/V computed in that other "
          "context: the answer drifts",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "attention_flow", "reference"), "cross_request",
          ("paged",), ("prefix_caching",)),
    Fault("cow_missing", "parallel sampling (n > 1) without copy-on-write: forked sequences write into the block "
          "they share",
          "block_manager: ensure writes into the partial last prompt block a fork still shares, in place",
          "the n answers of one request overwrite each other's newest K/V: each sequence reads a sibling's "
          "tokens at its own positions and drifts from its solo run",
          ("padded", "packed"), ("slot_taint", "attention_flow", "reference"), "cross_request", ("paged",),
          models=(ModelKind.DECODER_ONLY,)),
    Fault("stale_bitmask", "structured output's bitmask row is not reset for a plain request: it keeps the last "
          "grammar that used the row",
          "engine/grammar.py: GrammarStage.apply leaves a plain row's bitmask row as its previous owner filled it",
          "a plain request that shares a step with a constrained one is restricted to what another request's "
          "grammar allowed: its answer turns into digits, JSON or one of the other's choices",
          ("padded", "packed"), ("constraint", "reference"), "cross_request", KV_MODES,
          models=(ModelKind.DECODER_ONLY,)),
    # -- per-row sampling state: they act on requests with penalties, bias, bans or sampling --
    Fault("row_state_misalign", "per-row sampling state not moved when a row leaves: a row uses its neighbour's",
          "row_state: on a departure the ids move up but the state arrays are cut at the end",
          "a request gets another's penalties, bias, banned words, temperature or generator: banned words "
          "appear, a plain request avoids words it never banned, a seeded answer changes",
          ("padded", "packed"), ("constraint", "sampling_provenance", "reference"), "cross_request", KV_MODES,
          models=(ModelKind.DECODER_ONLY,)),
    Fault("shared_rng", "one generator for all requests: a seeded request's draws depend on its neighbours",
          "row_state: every sampled row draws from one generator, reseeded when a request joins",
          "the same seed gives a different answer under load than alone",
          ("padded", "packed"), ("sampling_provenance", "reference"), "cross_request", KV_MODES,
          models=(ModelKind.DECODER_ONLY,)),
    Fault("penalty_shared_history", "penalties count the whole batch's tokens, not the request's own",
          "row_state: repetition, frequency and presence penalties read every row's prompt and output",
          "a penalized request avoids words its neighbours used: its answer drifts under load",
          ("padded", "packed"), ("sampling_provenance", "reference"), "cross_request", KV_MODES,
          models=(ModelKind.DECODER_ONLY,)),
    Fault("stale_cross_kv", "Whisper: the cross-attention K/V table is indexed by slot and not refreshed when a slot is reused",
          "encoder: a request admitted into a reused slot reads the cross K/V its previous owner's audio left there",
          "a new request transcribes the previous occupant's audio: its passphrase shows up in the wrong transcript",
          ("padded", "packed"), ("slot_taint", "canary", "reference"), "cross_request", ("slots",),
          models=(ModelKind.ENCODER_DECODER,)),
    Fault("cross_row_misalign", "Whisper: cross K/V indexed by batch row, not compacted when a row leaves the batch",
          "encoder: row i reads the i-th entry of a table built in admission order that keeps finished requests",
          "after a request finishes, its neighbours read the wrong audio: transcripts swap mid-sentence",
          ("padded", "packed"), ("slot_taint", "canary", "reference"), "cross_request", KV_MODES,
          models=(ModelKind.ENCODER_DECODER,)),
    Fault("encoder_cache_unkeyed", "Whisper: the encoder cache is keyed by the decoder prompt instead of the audio's content",
          "encoder cache: every request with the same decoder prompt hits the first one's encoder output",
          "every transcript repeats the first audio's words",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "canary", "reference"), "cross_request", KV_MODES,
          models=(ModelKind.ENCODER_DECODER,)),
    Fault("cross_kv_prefix_cached", "Whisper: decoder prefix-cache keys leave out the audio's hash",
          "block_manager (via the engine): self-attention blocks of the same decoder prompt are shared across audio",
          "self-attention K/V computed against another audio is reused: the transcript drifts toward that audio",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "attention_flow", "reference"), "cross_request",
          ("paged",), ("prefix_caching",), models=(ModelKind.ENCODER_DECODER,)),
    Fault("embeds_unkeyed", "prefix-cache keys cover placeholder ids only, not the supplied embedding rows",
          "block_manager (via RequestState.cache_keys): a supplied row's position is keyed by its placeholder id",
          "two prompts given as embeddings of the same length share KV: B answers with A's prompt",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "attention_flow", "reference", "canary"),
          "cross_request", ("paged",), ("prefix_caching",), models=(ModelKind.DECODER_ONLY,)),
    Fault("embeds_mask_unkeyed", "prefix-cache keys cover the ids and the embeddings tensor, not the mask saying "
          "which positions are embeddings (vLLM #56655)",
          "block_manager (via RequestState.cache_keys): a position is keyed by (id, the tensor's row there)",
          "a prompt whose mask differs from a cached one's, with equal ids and tensor, reuses its KV",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "attention_flow", "reference"),
          "cross_request", ("paged",), ("prefix_caching",), models=(ModelKind.DECODER_ONLY,)),
    Fault("mm_hash_missing", "image models: prefix-cache keys of image positions leave out the image's hash",
          "engine/inputs.py RequestInput.position_keys: an image position is keyed by its placeholder id",
          "a request showing another picture with the same text reuses the first picture's KV and answers it",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "attention_flow", "reference", "canary"),
          "cross_request", ("paged",), ("prefix_caching",), models=(ModelKind.IMAGE_TEXT,)),
    Fault("mm_uuid_trusted", "image models: the image encoder cache is keyed by the client's uuid, not the picture",
          "engine/image_side.py ImageInputs.key_of: a request's uuid for its image is the cache key",
          "a client that reuses an image uuid gets another picture's features: the answer names that picture",
          ("padded", "packed"), ("slot_taint", "reference", "canary"), "cross_request", KV_MODES,
          models=(ModelKind.IMAGE_TEXT,)),
    Fault("stale_image_embedding", "image models: one image embedding buffer, filled by the last image encoded, "
          "read by every later image (llama-cpp-python #90)",
          "engine/image_side.py ImageInputs._entry: every image reads the buffer the last encode filled",
          "requests whose picture was encoded earlier, or cached, answer about the last encoded picture",
          ("padded", "packed"), ("slot_taint", "reference", "canary"), "cross_request", KV_MODES,
          models=(ModelKind.IMAGE_TEXT,)),
    # -- LoRA adapters (engine/lora.py): the prefix-cache key and the adapter a request runs under --
    Fault("lora_unkeyed_prefix", "the prefix-cache key leaves out the request's LoRA adapter: requests under "
          "different adapters (or none) share cached blocks",
          "engine/lora.py prefix_salt (via engine/paged.py): the first block's extra key holds no adapter",
          "a request under adapter B is served K/V computed under adapter A or the base model: its answer "
          "drifts toward what the other adapter would say",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "attention_flow", "reference"), "cross_request",
          ("paged",), ("prefix_caching",), models=(ModelKind.DECODER_ONLY,)),
    Fault("lora_reload_stale", "the prefix-cache key names the LoRA adapter but not its version: after a reload "
          "requests reuse blocks the old weights computed (vLLM #42125, fixed by #48352)",
          "engine/lora.py prefix_salt (via engine/paged.py): the first block's extra key is the adapter's name only",
          "after an adapter is reloaded with new weights, requests with a cached prefix answer partly with the "
          "old weights' K/V",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "attention_flow", "reference"), "cross_request",
          ("paged",), ("prefix_caching",), models=(ModelKind.DECODER_ONLY,)),
    # -- the KV offload tier (engine/offload.py): evicted blocks stored in host memory, restored on a hit --
    Fault("tier_key_drops_partition", "the offload tier keys blocks by their token ids alone: no cache_salt, and "
          "image or embedding positions by their placeholder ids",
          "engine/offload.py tier_keys: the tier's key of a block leaves out the partition the pool's key carries",
          "once a block is evicted to the tier, another tenant with the same prefix (or another picture or "
          "embedding at the same placeholders) gets it back: a shorter TTFT, or an answer about the other input",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "attention_flow"), "cross_tenant", ("paged",),
          ("prefix_caching", "kv_offload")),
    Fault("tier_layout_mismatch", "the offload tier restores blocks in another layout: token-major data read as "
          "head-major, well-formed and wrong",
          "engine/offload.py restore: the stored [tokens, heads, dim] block is reshaped, not transposed, back",
          "a request whose prefix comes back from the tier attends to scrambled K/V: its answer drifts",
          ("padded", "packed"), ("prefix_provenance", "reference"), "cross_request", ("paged",),
          ("prefix_caching", "kv_offload")),
    Fault("tier_partial_load", "the offload tier promises k blocks and delivers k - 1; the missing block is not "
          "recomputed",
          "engine/paged.py _apply_tier: an admission's last restore is counted as cached but never copied",
          "the request reads whatever the block's previous owner left in it: another request's K/V in its prefix",
          ("padded", "packed"), ("prefix_provenance", "slot_taint", "attention_flow", "reference"), "cross_request",
          ("paged",), ("prefix_caching", "kv_offload")),
    # -- a hybrid's recurrent state: the state pool, its checkpoints and the offload tier that carries them --
    Fault("state_slot_not_reset", "a reused recurrent-state slot is not zeroed: a request starts from the state its "
          "slot's previous owner left (llama.cpp #29092)",
          "engine/state_pool.py StatePool.allocate: the zeroing of the handed-out slot is skipped, so the linear "
          "layers read what the slot holds as the new request's initial state",
          "a request admitted into a slot another request used answers as if it continued that request's text",
          ("padded", "packed"), ("state_provenance", "reference"), "cross_request", KV_MODES,
          models=(ModelKind.HYBRID,)),
    Fault("state_published_before_write", "a block's state checkpoint is published when its chunk is scheduled "
          "and written a step later: a request that ends first leaves it unwritten (vLLM PR #56525)",
          "engine/paged.py PagedCache.ensure publishes what the block's state memory holds; keep_checkpoint writes "
          "the real one at the request's next step, and finish drops it",
          "a client aborts right after its prefill; an immediate retry of the same prompt hits its blocks and "
          "starts from the state another request left in that block's memory: its answer changes",
          ("padded", "packed"), ("state_provenance", "reference"), "cross_request", ("paged",),
          ("prefix_caching",), models=(ModelKind.HYBRID,)),
    Fault("tier_drops_recurrent_state", "the offload tier stores a hybrid block's K/V but not its state "
          "checkpoint: one host state buffer, overwritten by every store, is what a restore hands back (sglang "
          "#39830)",
          "engine/offload.py store and restore: the checkpoint goes to HostTier.state_buffer, not the entry",
          "a prefix evicted to the tier and restored answers with the state of the last block the tier stored, "
          "another request's prefix: its answer changes",
          ("padded", "packed"), ("state_provenance", "reference"), "cross_request", ("paged",),
          ("prefix_caching", "kv_offload"), models=(ModelKind.HYBRID,)),
    Fault("state_index_units", "a prefix hit's state checkpoint is looked up at a block index computed in the "
          "wrong units: hit tokens over a quarter of the block size (vLLM #55600, PR #55601)",
          "engine/block_manager.py BlockManager.state_at: the index is (hit tokens - 1) // (block_size // 4), "
          "and the block there gives what its state memory holds",
          "a short prefix hit silently restores the state another request left in an unrelated block",
          ("padded", "packed"), ("state_provenance", "reference"), "cross_request", ("paged",),
          ("prefix_caching",), models=(ModelKind.HYBRID,)),
    # -- kvtui serve's HTTP layer: the engine's answers are right, they reach the wrong client --
    Fault("request_id_keyed", "kvtui serve keys its map of waiting clients by the client's x-request-id: a second "
          "request with the same id takes the first's entry",
          "serve/bridge.py: a request's output goes to the client registered last under its x-request-id",
          "of two overlapping requests with one x-request-id, the second client gets the first's answer and the "
          "first client never gets one",
          ("padded", "packed"), ("request_id", "canary"), "cross_request", KV_MODES, models=(), scope="server"),
)}

FAULT_NAMES: tuple[str, ...] = tuple(FAULTS)

# Why a fault that was on acted 0 times, one clause per fault: what it needs and the run never gave it (the
# line `kvtui run` prints when nothing was caught and the fault never acted: inert_line).
INERT_REASONS: dict[str, str] = {
    "shared_cache": "every step ran requests in slot 0 only, so no request was moved to another's slot",
    "racy_threads": "no step ran more than one request, so no two threads shared the cache variable",
    "no_request_mask": "no packed step held more than one request",
    "unmasked_cache_padding": "no padded step held rows of different cache lengths, so no cache padding was left",
    "shared_position_offset": "no step held rows whose cached lengths differed, so every position id was right",
    "stale_slot": "no request was admitted into a slot another request had left",
    "causal_offset": "no step fed a row with tokens already cached, so the square mask was the right one",
    "fp16_cache": "no padded step had a padded row, so no pad cell was cached",
    "unsalted_prefix": "no prefix-cache hit took a block another cache_salt had computed",
    "block_refcount": "no request finished while another still held one of its blocks",
    "shared_partial_block": "no prompt found an identical prompt's partial last block cached",
    "prefix_key_no_parent": "no prefix-cache hit took a block computed under another prefix",
    "cow_missing": "no forked sequence wrote into a block it still shared",
    "stale_bitmask": "no plain request sampled through a bitmask row a grammar had filled",
    "row_state_misalign": "no request sampled with another row's sampling state",
    "shared_rng": "no seeded draw came from a generator another request had drawn from",
    "penalty_shared_history": "no penalty counted another request's tokens",
    "stale_cross_kv": "no request read cross K/V its slot's previous owner left",
    "cross_row_misalign": "no batch row read another request's cross K/V",
    "encoder_cache_unkeyed": "no encoder-cache hit gave a request another audio's output",
    "cross_kv_prefix_cached": "no prefix-cache hit took a block computed against another audio",
    "embeds_unkeyed": "no prefix-cache hit took a block whose embedding rows differed from the reader's",
    "embeds_mask_unkeyed": "no prefix-cache hit took a block whose embedding mask differed from the reader's",
    "mm_hash_missing": "no cached block held an image position of another picture when a request looked it up",
    "mm_uuid_trusted": "no request was given another picture's features under its uuid",
    "stale_image_embedding": "every picture was read right after its own encode, so the buffer held its own rows",
    "lora_unkeyed_prefix": "no prefix-cache hit took a block computed under another adapter",
    "lora_reload_stale": "no prefix-cache hit took a block computed under an adapter's older weights",
    "tier_key_drops_partition": "no offload-tier restore gave a request a block of another partition",
    "tier_layout_mismatch": "no block was restored from the offload tier",
    "tier_partial_load": "no admission restored blocks from the offload tier",
    "state_slot_not_reset": "no request took a state slot another request had left",
    "state_published_before_write": "no checkpoint was published before its state was written",
    "tier_drops_recurrent_state": "no block with a state checkpoint was restored from the offload tier",
    "state_index_units": "no prefix hit looked its checkpoint up at another block than its own",
    "request_id_keyed": "it acts in kvtui serve's HTTP layer, where a local run has no clients",
}
assert tuple(INERT_REASONS) == FAULT_NAMES, "every fault needs its inert reason, in catalogue order"


def inert_line(name: str) -> str:
    """The line for fault `name` on in a run where it acted 0 times, e.g. "mm_hash_missing acted 0 times:
    no cached block held an image position of another picture when a request looked it up"."""
    return f"{name} acted 0 times: {INERT_REASONS[name]}"
assert FAULT_NAMES == tuple(FaultName), "FaultName and FAULTS must list the same faults, in the same order"

# `--isolation off` and the dashboard's `i` key: the faults a talk shows first (the passphrase leaks).
DEFAULT_ISOLATION_OFF: tuple[str, ...] = ("stale_slot",)


def default_isolation_off(kv: str = "slots", prefix_caching: bool = False) -> tuple[str, ...]:
    """The default fault set for an engine's KV mode: stale_slot with slots; with paged KV block_refcount
    (a shared block freed while still read) when prefix caching is on, else shared_position_offset."""
    if kv != "paged":
        return DEFAULT_ISOLATION_OFF
    return ("block_refcount",) if prefix_caching else ("shared_position_offset",)


def server_faults(names) -> tuple[str, ...]:
    """The names among `names` whose fault acts in `kvtui serve`'s HTTP layer (scope "server"), in order
    (unknown names are left out: check_fault_names refuses them)."""
    return tuple(n for n in names if n in FAULTS and FAULTS[n].scope == "server")


def acts_on(name: str, kind: ModelKind | str) -> bool:
    """Whether fault `name` acts on a model of `kind` (a ModelKind, or its string as a recording holds it; a
    decoder-only fault acts on image-text models too; a server fault on none: it acts outside the engine)."""
    models = FAULTS[name].models
    return kind in models or (kind == ModelKind.IMAGE_TEXT and ModelKind.DECODER_ONLY in models)


def kind_refusal(faults, kind: ModelKind | str | None, model: str) -> str | None:
    """The one line refusing the first of `faults` that does not act on a model of `kind` (named `model`),
    or None when all act (or the kind is not known yet). A hybrid is decoder-only too, so the attention-only
    kind is named as such: "it acts on decoder-only models" read as if the hybrid were one of them."""
    wrong = next((f for f in faults if kind is not None and not acts_on(f, kind)), None)
    if wrong is None:
        return None
    words = {ModelKind.DECODER_ONLY: "attention-only decoder"}
    kinds = " or ".join(words.get(k, f"{k}") for k in FAULTS[wrong].models)
    return f"--fault {wrong} does not act on {kind} models like {model}; it acts on {kinds} models " \
           "(`kvtui faults` lists them)"


def faults_for(kv: str = "slots", model: ModelKind | str = ModelKind.DECODER_ONLY) -> tuple[str, ...]:
    """The faults that act in KV mode `kv` on a `model` kind (a ModelKind or its string), in catalogue
    order."""
    return tuple(name for name, fault in FAULTS.items() if kv in fault.kv and acts_on(name, model))


def fault_misfit(name: str, layout: str, kv: str = "slots", prefix_caching: bool = False,
                 kv_offload: bool = False) -> str:
    """Why fault `name` cannot act in an engine with this layout and KV mode, naming what it needs, e.g.
    "fault no_request_mask acts in the packed layout only, not padded"; "" when it can act there. A run
    with such a fault on would test nothing: the fault never fires, so nothing can be detected."""
    fault = FAULTS[name]
    if fault.scope == "server":
        return f"fault {name} acts in kvtui serve's HTTP layer, not in the engine"
    if kv not in fault.kv:
        return f"fault {name} acts with kv: {' or '.join(fault.kv)} only, not {kv}"
    if "prefix_caching" in fault.needs and not prefix_caching:
        return f"fault {name} acts in the prefix cache, which is off"
    if "kv_offload" in fault.needs and not kv_offload:
        return f"fault {name} acts in the KV offload tier, which is off"
    if layout not in fault.layouts:
        return f"fault {name} acts in the {' or '.join(fault.layouts)} layout only, not {layout}"
    return ""


FP16_MASK_CONSTANT = -1e9  # the classic hand-written mask constant; float16 rounds it to -inf


def check_fault_names(names) -> frozenset[str]:
    """Validate fault names.

    Returns:
        the names as a frozenset.
    Raises:
        ValueError: naming the first unknown fault and the known list.
    """
    from kvtui.names import did_you_mean

    names = frozenset(names)
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}{did_you_mean(unknown[0], FAULT_NAMES)}; known: "
                         f"{', '.join(FAULT_NAMES)} (see `kvtui faults`)")
    return names


def isolation_fault_set(engine_faults, timeline, kv: str = "slots", prefix_caching: bool = False) -> tuple[str, ...]:
    """The faults the dashboard's `i` key switches on: those a scenario starts with (`engine_faults`) or
    names in its timeline (`timeline`: normalized entries `{"set": {"fault": NAME}}`), in that order;
    default_isolation_off(kv, prefix_caching) when it names none."""
    names: list[str] = []
    for name in engine_faults or ():
        if name not in names:
            names.append(name)
    for entry in timeline or ():
        name = (entry.get("set") or {}).get("fault") if isinstance(entry, dict) else None
        if isinstance(name, str) and name not in names:
            names.append(name)
    return tuple(names) or default_isolation_off(kv, prefix_caching)
