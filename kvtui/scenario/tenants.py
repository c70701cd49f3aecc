"""Tenants: who sends each request, and the cache_salt that keeps tenants' prefix-cache blocks apart.

YAML `tenants: {count: 3, assign: random, cache_salt: per_tenant}`. Tenants are named t0, t1, ...;
a scripted request may name its own (`tenant: alice`). With one tenant (the default) requests carry
no tenant and no salt. With paged KV and prefix caching, a request's cache_salt is part of the key
of its first block (and through the hash chain of every later one), so a tenant's request can only
hit blocks its own tenant computed (vLLM's per-request `cache_salt`, the mitigation of the
prefix-cache timing side channel CVE-2025-46570).
"""

from __future__ import annotations

import hashlib
import random
from typing import Annotated, Literal

from pydantic import Field

from kvtui.scenario.base import Strict


class Tenants(Strict):
    """Who sends the requests. Each request belongs to one tenant, named t0, t1, ..., drawn by the seed
    (`assign: random`) or in turn; for `prompts: {kind: multi_turn}` a whole session belongs to one
    tenant. With paged KV and prefix caching, `cache_salt: per_tenant` gives each tenant a secret salt
    in its blocks' keys, so one tenant's requests never reuse blocks another tenant computed; `none`
    lets every tenant share every cached block. One tenant (the default): no tenant, no salt."""

    count: Annotated[int, Field(ge=1, le=10_000)] = Field(1, description="number of tenants")
    assign: Literal["random", "round_robin"] = Field(
        "random", description="`random`: each request's (or session's) tenant drawn by the seed; `round_robin`: "
                              "t0, t1, ... in turn")
    cache_salt: Literal["per_tenant", "none"] = Field(
        "per_tenant", description="`per_tenant`: each tenant's requests carry its own salt; `none`: no salt")


class TenantPlan:
    """Tenant names and salts of a run, fixed by the seed (its own random stream: other choices stay put).

    Args:
        spec: the `tenants` section; seed: the scenario seed; derive: kvtui.scenario.plan.derive_seed.
    """

    def __init__(self, spec: Tenants, seed: int, derive) -> None:
        self.spec, self.seed, self.derive = spec, seed, derive
        self.rng = random.Random(derive(seed, "tenants"))
        self.drawn: dict[int, str] = {}

    def name(self, unit: int) -> str | None:
        """The tenant of `unit` (a request index, or a session number); None with one tenant."""
        if self.spec.count == 1:
            return None
        if unit not in self.drawn:
            k = self.rng.randrange(self.spec.count) if self.spec.assign == "random" else unit % self.spec.count
            self.drawn[unit] = f"t{k}"
        return self.drawn[unit]

    def salt(self, tenant: str | None) -> str | None:
        """The tenant's cache_salt: a secret string from the seed and its name; None without a tenant or
        with `cache_salt: none`."""
        if tenant is None or self.spec.cache_salt == "none":
            return None
        digest = hashlib.sha256(f"{self.derive(self.seed, 'cache_salt:' + tenant)}".encode()).hexdigest()
        return f"{tenant}:{digest[:24]}"
