"""LoRA adapters in the fused forward: each row of a step may run under its own adapter, or none.

An adapter is a peft LoRA folder (adapter_config.json + adapter_model.safetensors), read with peft's own
`LoraConfig.from_pretrained` and `load_peft_weights`. `load_adapter` turns it into a `LoraAdapter`: per
decoder layer and fused linear layer (qkv, o, gate_up, down: kvtui/engine/fused.py), the column range
each target module writes and its A [r, in] and B [out, r] in the model's dtype, plus a digest of the
weights. A request carries its adapter on its RequestInput (`RequestInput.lora`), so the reference
detector's clean replay runs it under the same weights.

In a step, `LoraBatch.of` groups the batch's query tokens by adapter; after each fused multiply
`LoraBatch.apply` adds, for the tokens of adapter a, (x @ A^T) @ B^T * scaling to the base output,
in peft's order (peft's lora.Linear: base(x) + lora_B(lora_A(dropout(x))) * scaling, dropout off
in eval). Rows without an adapter are left as the base model computed them.

The prefix cache: the adapter's name, version and weight digest join the request's cache_salt as the
first block's extra key (`prefix_salt`), so blocks computed under one adapter are never handed to a
request under another, nor to one under a reloaded version of it; the content key the prefix_provenance
detector compares carries the weight digest (`true_items`). The faults `lora_unkeyed_prefix` (no
adapter in the key) and `lora_reload_stale` (the name without the version) change only the lookup key.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kvtui.config import lora_mode_problem
from kvtui.engine.lora_files import TARGETS, check_files, check_weights, delta_overflows, read_config
from kvtui.faults import FaultName

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One loaded LoRA adapter.

    Attributes:
        name: the name requests select it by; version: 1 when first loaded, +1 at each reload.
        digest: 16 hex digits of sha256 over its weights (float32 bytes, sorted by key) and scaling.
        path: the folder it was read from; rank: r; scaling: lora_alpha / r (/ sqrt(r) with rslora).
        weights: (layer index, fused layer name) -> ((start, stop, A [r, in], B [stop - start, r]), ...),
            the column range of the fused output each target module writes, in the model's dtype.
    """

    name: str
    version: int
    digest: str
    path: str
    rank: int
    scaling: float
    weights: dict = field(repr=False, default_factory=dict)

    @property
    def identity(self) -> tuple[str, int, str]:
        """(name, version, digest): equal identities compute equally."""
        return self.name, self.version, self.digest

    @property
    def label(self) -> str:
        """name@version, for reports."""
        return f"{self.name}@{self.version}"


def lora_problem(model, *, enforce_eager: bool = False, batch_invariant: bool = False) -> str | None:
    """Why an engine over `model` cannot run LoRA adapters (one line with the fix), or None: they run in
    kvtui's fused forward, so on Llama-family causal LMs, not with enforce_eager nor batch_invariant
    (lora_mode_problem)."""
    from kvtui.engine import fused

    if not fused.supports(model):
        return (f"LoRA adapters run on Llama-family models (kvtui's fused forward), not "
                f"{getattr(model.config, 'model_type', '?')!r}: drop the adapter or choose such a model")
    problem = lora_mode_problem(enforce_eager=enforce_eager, batch_invariant=batch_invariant)
    return problem and f"{problem}: drop {'--enforce-eager' if enforce_eager else '--batch-invariant'}"


def _column_ranges(config) -> dict[str, tuple[str, int, int, int]]:
    """Target module -> (fused layer, start, stop) of its columns in the fused output, and its input width."""
    from kvtui.engine.fused import layer_shapes

    (_, qkv), _, (_, gate_up), _ = layer_shapes(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, inter, hidden = config.num_attention_heads * head_dim, gate_up // 2, config.hidden_size
    kv = (qkv - q) // 2
    return {"q_proj": ("qkv", 0, q, hidden), "k_proj": ("qkv", q, q + kv, hidden),
            "v_proj": ("qkv", q + kv, qkv, hidden), "o_proj": ("o", 0, hidden, q),
            "gate_proj": ("gate_up", 0, inter, hidden), "up_proj": ("gate_up", inter, 2 * inter, hidden),
            "down_proj": ("down", 0, hidden, inter)}


def _check_config(config, path) -> float:
    """The scaling of a peft LoraConfig kvtui can run (its values checked by lora_files.read_config);
    ValueError (one line) for one using a peft feature kvtui does not run."""
    if str(getattr(config, "peft_type", "")).split(".")[-1].upper() != "LORA":
        raise ValueError(f"{path}: not a LoRA adapter (peft_type {config.peft_type})")
    if config.use_dora or config.rank_pattern or config.alpha_pattern or config.modules_to_save \
            or config.bias != "none" or config.fan_in_fan_out:
        raise ValueError(f"{path}: kvtui runs plain LoRA adapters (no DoRA, rank/alpha patterns, bias, "
                         "modules_to_save or fan_in_fan_out)")
    return config.lora_alpha / (config.r ** 0.5 if config.use_rslora else config.r)


def load_adapter(model, name: str, path, version: int = 1) -> LoraAdapter:
    """Read the peft LoRA folder `path` for `model` (a Llama-family causal LM) as adapter `name`.

    Returns a LoraAdapter with A and B in the model's dtype on its device.
    Raises:
        ValueError (one line naming the file and the field or tensor): a missing adapter_config.json or
            weights file, a bad config value (lora_files.check_config), a folder peft cannot read, an
            adapter kvtui cannot run (see _check_config), a target module other than
            q/k/v/o/gate/up/down_proj, weights whose shapes or rank do not fit the model and config, a
            weight that is NaN or infinite, or a weight delta not finite in the model's dtype.
    """
    from peft import LoraConfig
    from peft.utils import load_peft_weights

    folder = Path(path)
    weights_file = check_files(folder)
    read_config(folder)
    try:
        config = LoraConfig.from_pretrained(str(folder))
        state = load_peft_weights(str(folder), device="cpu")
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, safetensors' SafetensorError, ...: one line
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot read LoRA adapter {name!r} from {path}: {reason}") from None
    scaling = _check_config(config, path)
    check_weights(state, weights_file)
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in state.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in TARGETS:
            raise ValueError(f"{path}: weight {key} is not a LoRA A/B of q/k/v/o/gate/up/down_proj")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = (key, tensor)
    digest = hashlib.sha256(f"kvtui:lora:{scaling!r}".encode())
    for key in sorted(state):
        digest.update(key.encode() + state[key].to(torch.float32).contiguous().numpy().astype("<f4").tobytes())
    weights = _place(model, pairs, weights_file, int(config.r), scaling)
    return LoraAdapter(name, version, digest.hexdigest()[:16], str(path), int(config.r), float(scaling), weights)


def _place(model, pairs: dict, file: Path, rank: int, scaling: float) -> dict:
    """(layer, fused layer) -> ((start, stop, A, B), ...) from {(layer, module): {"A": (key, A), "B": ..}},
    A and B cast to the model's dtype. ValueError (one line naming `file`'s tensor) for shapes that do not
    fit the model, a rank other than the config's r, or a weight or delta not finite in the model's dtype."""
    ranges, emb = _column_ranges(model.config), model.get_input_embeddings().weight
    out: dict = {}
    for (layer, module), ab in sorted(pairs.items()):
        group, start, stop, width = ranges[module]
        (a_key, a), (b_key, b) = ab.get("A", (None, None)), ab.get("B", (None, None))
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or b.shape[0] != stop - start \
                or a.shape[0] != b.shape[1] or a.shape[1] != width or layer >= model.config.num_hidden_layers:
            raise ValueError(f"{file.parent}: layer {layer} {module} does not fit this model")
        if a.shape[0] != rank:
            raise ValueError(f"{file}: {a_key} has rank {a.shape[0]}, adapter_config.json's r is {rank}")
        cast_a, cast_b = a.to(emb.device, emb.dtype), b.to(emb.device, emb.dtype)
        dtype = str(emb.dtype).removeprefix("torch.")
        for key, cast in ((a_key, cast_a), (b_key, cast_b)):
            if not bool(torch.isfinite(cast).all()):
                raise ValueError(f"{file}: {key} does not fit {dtype} (the model's dtype): a value overflows it")
        if delta_overflows(a, b, scaling, emb.dtype):
            raise ValueError(f"{file}: layer {layer} {module}: lora_B @ lora_A x scaling (the weight delta peft's "
                             f"merge adds) overflows {dtype}, the model's dtype: the adapter's weights are too large")
        out.setdefault((layer, group), []).append((start, stop, cast_a, cast_b))
    return {k: tuple(v) for k, v in out.items()}


class LoraBatch:
    """A step's query tokens grouped by adapter: [(adapter, flat token indices [T] int64), ...] over the
    batch's [R * Q] query cells (padded or packed layout). Pad cells and rows without an adapter are in
    no group."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor]]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, batch, chunks, device) -> "LoraBatch | None":
        """The groups of a BatchTensors' segments (chunk i: chunks[i].request); None when no chunk has an
        adapter."""
        width = batch.input_ids.shape[1]
        cells: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for seg, chunk in zip(batch.segments, chunks):
            adapter = chunk.request.input.lora
            if adapter is not None:
                first = seg.row * width + seg.q_start
                cells.setdefault(id(adapter), (adapter, []))[1].extend(range(first, first + seg.num_tokens))
        if not cells:
            return None
        return cls([(a, torch.tensor(idx, dtype=torch.long, device=device)) for a, idx in cells.values()])

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add each group's LoRA delta to `out` [..., N] (the fused layer `group`'s base output on
        x [..., in], same leading shape), in place; returns `out`."""
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for adapter, index in self.groups:
            parts = adapter.weights.get((layer, group), ())
            if not parts:
                continue
            rows = flat_x.index_select(0, index)
            for start, stop, a, b in parts:
                delta = F.linear(F.linear(rows, a), b) * adapter.scaling
                flat_out[:, start:stop].index_add_(0, index, delta)
        return out


class AdapterGone(ValueError):
    """A request names an adapter no longer loaded (unloaded after its request was accepted)."""


def prefix_salt(cache_salt: str | None, adapter: LoraAdapter | None,
                faults: frozenset = frozenset()) -> str | tuple | None:
    """The first block's extra keys: the tenant's cache_salt and the adapter's name, version and weight
    digest, as two keys (block_manager.partition_keys). lora_unkeyed_prefix leaves the adapter out,
    lora_reload_stale keeps its name only."""
    if adapter is None or FaultName.LORA_UNKEYED_PREFIX in faults:
        return cache_salt
    tag = f"lora:{adapter.name}" if FaultName.LORA_RELOAD_STALE in faults else \
        f"lora:{adapter.name}@{adapter.version}:{adapter.digest}"
    return (cache_salt, tag)  # two extra keys: no salt string can spell a salt and an adapter


def true_items(items: list, adapter: LoraAdapter | None) -> list:
    """Content key items (RequestState.cache_keys without faults) with the adapter's weight digest joined
    to position 0's item, so the content key of every block (chained to block 0) names the weights its
    K/V were computed under. Unchanged without an adapter."""
    if adapter is None or not items:
        return items
    return [f"lora:{adapter.digest}|{items[0]}"] + list(items[1:])


class AdapterRegistry:
    """The adapters an engine's requests may name: name -> the current LoraAdapter. Loading a name again
    (a reload) makes a new version; requests already submitted keep the version they were given. Versions
    of a name only go up, across unloads too, so name@version names one set of weights for the run.

    Args:
        model: the engine's model (Llama family); model_id: its name, which local adapters are made for.
    """

    def __init__(self, model, model_id: str) -> None:
        self.model, self.model_id = model, model_id
        self.adapters: dict[str, LoraAdapter] = {}
        self._versions: dict[str, int] = {}  # name -> the last version it was given

    def load(self, name: str, path=None, seed: int | None = None) -> LoraAdapter:
        """Load adapter `name` from `path` (a peft LoRA folder), or the local adapter made with `seed` (or
        the built-in name's seed: kvtui.models.lora); version 1, or the loaded version + 1.

        Raises:
            ValueError: the model cannot run adapters, or the adapter cannot be read (one line).
        """
        from kvtui.models.lora import resolve_adapter

        problem = lora_problem(self.model)
        if problem:
            raise ValueError(problem)
        folder = resolve_adapter(self.model_id, self.model.config, name, path, seed)
        return self.add(load_adapter(self.model, name, folder))

    def add(self, adapter: LoraAdapter) -> LoraAdapter:
        """Install `adapter` (read by load_adapter, e.g. in another thread) as the next version of its name;
        returns it with that version. Call between engine steps."""
        adapter = replace(adapter, version=self._versions.get(adapter.name, 0) + 1)
        self._versions[adapter.name] = adapter.version
        self.adapters[adapter.name] = adapter
        return adapter

    def remove(self, name: str) -> LoraAdapter | None:
        """Unload adapter `name` (requests already submitted keep it); the removed adapter, or None."""
        return self.adapters.pop(name, None)

    def get(self, name: str) -> LoraAdapter | None:
        """The current version of adapter `name`, or None when none is loaded under that name."""
        return self.adapters.get(name)
