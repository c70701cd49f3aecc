"""The block map's memory: what a cell of KV (a paged block, a slot, a hybrid's state slot) shows beyond the
last step's own fields. Plain Python, no Textual: DashboardState feeds it events, snapshot_build reads it.

For each cell it keeps when its contents began (its age: a slot's owner took it, a block was allocated for
what it holds), the step a prefix-cache hit last handed it over (its last reuse), its owner before that, and the marks of the last fault that acted on it (fault.acted events: by the
blocks, slots or state slots they name, else the cells of the requests they name) and of the last
detector that fired on it (contamination events: the blocks or slots their evidence names, and the
victim's cells). Marks stay until another request takes the cell, so a freed cell still shows what
happened there, and a block a prefix hit hands over keeps them with its contents.
"""

from __future__ import annotations

from kvtui.events import Contamination, FaultActed, ProvenanceEvidence, StepEvent, TaintEvidence
from kvtui.tui.snapshot import KVMapView, MapCell

Cell = tuple[str, int]  # ("kv", block or slot) or ("state", state slot)
BANDS = {"block": "kv", "slot": "kv", "state_slot": "state"}  # FaultActed.where -> band


class KVMapTrack:
    """Ages, reuses and marks per cell, fed by DashboardState (see the module docstring)."""

    def __init__(self) -> None:
        self.since: dict[Cell, int] = {}  # cell -> the step its current contents began (its owner took it)
        self.reused: dict[int, int] = {}  # block -> step of the last prefix hit that handed it over
        self.fault: dict[Cell, str] = {}
        self.detector: dict[Cell, str] = {}
        self.owners: dict[Cell, str] = {}  # cell -> owner after the last step
        self.last_owner: dict[Cell, str] = {}  # cell -> its last owner (kept while it is free)
        self.previous: dict[Cell, str] = {}  # cell -> the owner before its current contents began
        self._free: dict[tuple[int, bool], MapCell] = {}  # free_cell's cache

    def on_step(self, e: StepEvent, owners: dict[Cell, str]) -> None:
        """A step: `owners`, each held cell's owner after it. A cell whose contents are new starts its age at
        this step and drops its marks: a slot or state slot with another owner, a block taken while free
        (or from a request that left) other than by a prefix hit (a hit hands over the same contents)."""
        hits = {block.block for hit in e.prefix_hits for block in hit.blocks}
        for block in hits:
            self.reused[block] = e.step
        holders = set(owners.values())
        for cell, owner in owners.items():
            before = self.owners.get(cell)
            if cell[0] == "kv" and e.kv == "paged":  # a shared block's first holder may change: same contents
                fresh = cell[1] not in hits and (before is None or before not in holders)
            else:
                fresh = before != owner
            if fresh:
                last = self.last_owner.get(cell)
                if last is not None and last != owner:
                    self.previous[cell] = last
                self.since[cell] = e.step
                self.fault.pop(cell, None)
                self.detector.pop(cell, None)
            self.last_owner[cell] = owner
        self.owners = owners

    def cells_of(self, request_id: str | None) -> list[Cell]:
        """The cells `request_id` held after the last step."""
        return [cell for cell, owner in self.owners.items() if owner == request_id]

    def on_acted(self, e: FaultActed) -> None:
        """Mark where a fault acted: the cells it names, else those of the requests it acted on."""
        band = BANDS.get(e.where)
        cells = [(band, i) for i in e.ids] if band else []
        for rid in () if cells else e.request_ids:
            cells += self.cells_of(rid)
        for cell in cells:
            self.fault[cell] = e.fault

    def on_contamination(self, e: Contamination) -> None:
        """Mark where a detector fired: the blocks or slots its evidence names and the victim's cells."""
        cells = self.cells_of(e.victim)
        evidence = e.evidence
        if isinstance(evidence, TaintEvidence):
            cells += [("kv", x.block if x.block is not None else x.slot) for x in evidence.examples
                      if x.block is not None or x.slot is not None]
        elif isinstance(evidence, ProvenanceEvidence):
            cells += [("kv", b) for b in evidence.blocks]
        for cell in cells:
            if cell[1] is not None and cell[1] >= 0:
                self.detector[cell] = e.detector

    @property
    def marked(self) -> set[Cell]:
        """The cells with a fault or detector mark."""
        return self.fault.keys() | self.detector.keys()

    def free_cell(self, index: int, cached: bool) -> MapCell:
        """A free, unmarked block's cell (reused from snapshot to snapshot: a large pool is mostly these)."""
        key = (index, cached)
        if key not in self._free:
            self._free[key] = MapCell(index, None, cached=cached, previous=self.previous.get(("kv", index)))
        cell = self._free[key]
        if cell.previous != self.previous.get(("kv", index)):  # it changed hands since: draw it anew
            cell = self._free[key] = MapCell(index, None, cached=cached, previous=self.previous.get(("kv", index)))
        return cell

    def cell(self, band: str, index: int, step: int, owner: str | None, **fields) -> MapCell:
        """The MapCell of (band, index) at `step`, its owner given (with its tenant, adapter, color, cached,
        shared in `fields`)."""
        since = self.since.get((band, index))
        age = step - since if owner is not None and since is not None else None
        reused = step - self.reused[index] if band == "kv" and index in self.reused else None
        return MapCell(index, owner, age=age, reused=reused, fault=self.fault.get((band, index)),
                       detector=self.detector.get((band, index)), previous=self.previous.get((band, index)),
                       **fields)


def map_view(track: KVMapTrack, state, last: StepEvent | None) -> KVMapView | None:
    """The KVMapView of a DashboardState `state` (its requests, tenants, slots or blocks) after step `last`;
    None before the first step or for a run against a target server."""
    if last is None or state.server is not None:
        return None
    step = state.step

    def fields(owner: str | None) -> dict:
        r = state.requests.get(owner) if owner else None
        if r is None:
            return {}
        return dict(tenant=r.tenant, adapter=r.lora, color=state.tenants.get(r.tenant, r.color) if state.tenants
                    else r.color)

    if state.kv == "paged":
        owners = {i: o for (band, i), o in track.owners.items() if band == "kv"}
        marked = track.marked
        cells = tuple(track.free_cell(i, c == "c") if i not in owners and ("kv", i) not in marked else
                      track.cell("kv", i, step, owners.get(i), cached=c == "c", shared=_refs(c), **fields(owners.get(i)))
                      for i, c in enumerate(state.block_state) if c != "_")
    else:
        cells = tuple(track.cell("kv", i, step, state.slot_owner.get(i), shared=int(i in state.slot_owner),
                                 **fields(state.slot_owner.get(i))) for i in range(state.num_slots))
    states = tuple(track.cell("state", slot, step, owner, **fields(owner))
                   for slot, owner, _ in last.state_slot_map)
    encoder = (last.encoder_entries, last.encoder_capacity or 0, last.encoder_referenced or 0) \
        if last.encoder_entries is not None else None
    tier = (last.kv_offload_blocks or 0, last.kv_offload_capacity) if last.kv_offload_capacity is not None else None
    return KVMapView("block" if state.kv == "paged" else "slot", cells, states, encoder, tier)


def step_owners(state, e: StepEvent) -> dict[Cell, str]:
    """Each held cell's owner after step `e`, from a DashboardState `state` that has applied it: paged, the
    first running request whose block table lists a block; slots, the slot's owner; and the state slots."""
    owners: dict[Cell, str] = {}
    if e.kv == "paged":
        for rid, blocks in state.block_tables.items():
            for b in blocks:
                owners.setdefault(("kv", b), rid)
    else:
        owners.update({("kv", slot): rid for slot, rid in state.slot_owner.items()})
    owners.update({("state", slot): rid for slot, rid, _ in e.state_slot_map if rid is not None})
    return owners


def _refs(char: str) -> int:
    """Holders of a block from its BlockManager.state character."""
    return 0 if char in ".c" else 10 if char == "+" else int(char)
