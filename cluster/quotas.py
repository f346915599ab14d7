"""Token-rate quotas per tenant at the ingress: a token bucket per API key (or per adapter), refilled at
tokens_per_s up to burst; a request the bucket cannot pay for is a QuotaExceededError (HTTP 429, Retry-After).

A request reserves its worst case before it is sent (request_cost: the prompt tokens the ingress can estimate
plus n * max_tokens) and settles what it really used once it ends, so a tenant's burst of concurrent requests
cannot all pass on one balance, as they would if tokens were charged only after the fact; a short answer gives
the rest back. A request costing more than burst is admitted at a full bucket (rather than never) and leaves it
in debt, which the tenant waits out. The fair share of the engine's capacity between tenants is the engines'
scheduling_policy "fair" (replicas/fairness.py); this caps what a tenant may take at all.

Buckets live in the ingress replica: with k ingress replicas a tenant may take up to k times its rate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.errors import QuotaExceededError

TENANT_KEYS = ("api_key", "adapter")
DEFAULT_BURST_S = 60.0  # a burst of one minute's tokens, as a per-minute (TPM) limit allows
CHARS_PER_TOKEN = 4  # a prompt's estimate before the replica tokenizes it; settle() corrects it
_MAX_IDLE_BUCKETS = 4096  # past this many, full buckets are dropped: a fresh one is the same


@dataclass(frozen=True)
class TokenRate:
    tokens_per_s: float
    burst: float | None = None  # the most a bucket holds; None: DEFAULT_BURST_S of tokens_per_s

    def __post_init__(self) -> None:
        if not _positive(self.tokens_per_s):
            raise ValueError(f"tokens_per_s must be a number > 0, got {self.tokens_per_s!r}")
        if self.burst is None:
            object.__setattr__(self, "burst", float(self.tokens_per_s) * DEFAULT_BURST_S)
        elif not _positive(self.burst):
            raise ValueError(f"burst must be a number of tokens > 0, got {self.burst!r}")

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> TokenRate:
        if not isinstance(raw, Mapping) or set(raw) - {"tokens_per_s", "burst"} or "tokens_per_s" not in raw:
            raise ValueError(f"{where} must be {{tokens_per_s: <number>, burst: <number, optional>}}, got {raw!r}")
        try:
            return cls(**raw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class QuotaConfig:
    """ServerConfig's quotas: which key names a tenant, the limit of every tenant without its own, and the
    tenants' own limits. No default and no tenants: no quotas."""

    by: str = "api_key"  # or "adapter": the request's model name
    default: TokenRate | None = None  # None: tenants without an entry are unlimited
    tenants: Mapping[str, TokenRate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.by not in TENANT_KEYS:
            raise ValueError(f"quotas.by must be one of {TENANT_KEYS}, got {self.by!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> QuotaConfig:
        """From the deployment's YAML: {by: api_key, default: {tokens_per_s: 2000, burst: 100000},
        tenants: {<key or adapter>: {tokens_per_s: ...}}}; a bad entry raises ValueError (the start fails)."""
        raw = raw or {}
        unknown = set(raw) - {"by", "default", "tenants"}
        if unknown:
            raise ValueError(f"quotas: unknown settings {sorted(unknown)} (by, default, tenants)")
        tenants = raw.get("tenants") or {}
        if not isinstance(tenants, Mapping) or not all(isinstance(k, str) and k for k in tenants):
            raise ValueError("quotas.tenants must map API keys or adapter names to {tokens_per_s, burst}")
        default = raw.get("default")
        # a tenant's name is not echoed: with by: api_key it is a secret
        return cls(by=raw.get("by", "api_key"),
                   default=None if default is None else TokenRate.from_dict(default, "quotas.default"),
                   tenants={k: TokenRate.from_dict(v, "a quotas.tenants entry") for k, v in tenants.items()})

    @property
    def enabled(self) -> bool:
        return self.default is not None or bool(self.tenants)


def request_cost(prompt_chars: int, max_tokens: int, n: int = 1, prompt_tokens: int = 0) -> int:
    """A request's reservation: its prompt (token ids as given, else text at CHARS_PER_TOKEN) and every token it
    may generate."""
    return prompt_tokens + math.ceil(prompt_chars / CHARS_PER_TOKEN) + n * max_tokens


class _Bucket:
    __slots__ = ("level", "stamp")

    def __init__(self, level: float, stamp: float) -> None:
        self.level, self.stamp = level, stamp


class TokenQuotas:
    """The ingress's buckets. clock: seconds, monotonic (injected by tests)."""

    def __init__(self, config: QuotaConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._drop_at = _MAX_IDLE_BUCKETS

    def tenant(self, api_key: str | None, model: str) -> str:
        """The tenant a request counts against: its API key ("" without one) or its model (adapter) name."""
        return (api_key or "") if self.config.by == "api_key" else model

    def rate(self, tenant: str) -> TokenRate | None:
        return self.config.tenants.get(tenant, self.config.default)

    def reserve(self, tenant: str, tokens: int) -> Reservation:
        """Take tokens from the tenant's bucket for a request about to run, or raise QuotaExceededError with the
        seconds until the bucket holds them (or burst, for a larger request). Settle the reservation when the
        request ends."""
        if tokens < 0:
            raise ValueError(f"a reservation is of tokens >= 0, got {tokens}")
        rate = self.rate(tenant)
        if rate is not None:
            bucket = self._refilled(tenant, rate)
            need = min(tokens, rate.burst)
            if bucket.level < need:
                wait = (need - bucket.level) / rate.tokens_per_s
                who = "this API key" if self.config.by == "api_key" else f"adapter {tenant!r}"
                raise QuotaExceededError(f"{who} is over its token quota ({rate.tokens_per_s:g} tokens/s, burst "
                                         f"{rate.burst:g}): retry after {math.ceil(wait)} s", wait)
            bucket.level -= tokens
        return Reservation(self, tenant, tokens)

    def available(self, tenant: str) -> float:
        """Tokens the tenant's bucket holds now (inf without a quota); negative in debt."""
        rate = self.rate(tenant)
        return math.inf if rate is None else self._refilled(tenant, rate).level

    def _settle(self, tenant: str, reserved: int, used: int) -> None:
        rate = self.rate(tenant)
        if rate is not None:
            bucket = self._refilled(tenant, rate)
            bucket.level = min(rate.burst, bucket.level + reserved - used)

    def _refilled(self, tenant: str, rate: TokenRate) -> _Bucket:
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) >= self._drop_at:
                self._drop_full(now)
                # the next pass once the survivors have doubled: many busy tenants cost no pass per newcomer
                self._drop_at = max(_MAX_IDLE_BUCKETS, 2 * len(self._buckets))
            bucket = self._buckets[tenant] = _Bucket(rate.burst, now)
        else:
            bucket.level = min(rate.burst, bucket.level + (now - bucket.stamp) * rate.tokens_per_s)
            bucket.stamp = now
        return bucket

    def _drop_full(self, now: float) -> None:
        for tenant, bucket in list(self._buckets.items()):
            rate = self.rate(tenant)
            if rate is None or bucket.level + (now - bucket.stamp) * rate.tokens_per_s >= rate.burst:
                del self._buckets[tenant]


@dataclass
class Reservation:
    """One request's reserved tokens; settle(used) once it ends, with the tokens it really took (prompt + output;
    0 if it failed before running). Settling again changes nothing."""

    quotas: TokenQuotas
    tenant: str
    tokens: int
    settled: bool = False

    def settle(self, used: int) -> None:
        if not self.settled:
            self.settled = True
            self.quotas._settle(self.tenant, self.tokens, used)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
