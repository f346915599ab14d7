"""Fair admission across tenants: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI'24), behind the scheduler's policy "fair". Pure Python.

A tenant is a request's explicit tenant key (Sequence.tenant: an API key's id, say) or else its adapter
(lora_int_id, 0 for the base model). Each tenant has a counter of the weighted tokens the engine served it:
prompt_weight per prompt token it computed at admission, output_weight per output token. Admission takes the
waiting request of the tenant whose counter is smallest (on a tie, the tenant with fewer unfinished requests,
then the one queued first); one tenant's requests keep their queue order. A tenant that becomes active
(nothing waiting, preempted or running before) has its counter lifted to the smallest among active tenants,
or to the counter the last tenant to go idle left with, so idle time banks no credit: the newcomer is served
next, not for as long as the others' lead.
A flood thus takes what the other tenants leave, and a light tenant waits for the next free slot or token
budget instead of behind the whole flood.

Output tokens weigh 2 to a prompt token's 1 by default, the paper's weights (after API prices): a decode
token holds a sequence's slot for a whole step, a prompt token is one of many in a batched prefill.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Sequence as Seq

from replicas.sequence import Sequence

# Counters of idle tenants are dropped past this many, where the lift would replace them anyway (prune()).
_MAX_IDLE_COUNTERS = 4096


def tenant_of(seq: Sequence) -> Hashable:
    """The request's tenant key if it names one, else its adapter id (0: the base model). A key is a string and
    an id an int, so the two never collide."""
    return seq.tenant if seq.tenant is not None else seq.lora_int_id


class VirtualTokenCounter:
    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.counters: dict[Hashable, float] = {}
        self._live: dict[Hashable, int] = {}  # active tenants -> their unfinished sequences
        self._last_left = 0.0  # the counter of the last tenant to go idle: the floor while none is active
        self._prune_at = _MAX_IDLE_COUNTERS

    # -- tenants coming and going (Scheduler.add, Scheduler.finish) --------
    def arrive(self, seq: Sequence) -> None:
        tenant = tenant_of(seq)
        if tenant not in self._live:
            floor = self.floor()
            if len(self.counters) >= self._prune_at:
                self.prune(floor)
                # the next pass once the survivors have doubled: no pass per newcomer when few can go
                self._prune_at = max(_MAX_IDLE_COUNTERS, 2 * len(self.counters))
            self.counters[tenant] = max(self.counters.get(tenant, floor), floor)
        self._live[tenant] = self._live.get(tenant, 0) + 1

    def leave(self, seq: Sequence) -> None:
        tenant = tenant_of(seq)
        left = self._live[tenant] - 1
        if left:
            self._live[tenant] = left
        else:
            del self._live[tenant]
            self._last_left = self.counters[tenant]

    def floor(self) -> float:
        """What a tenant that becomes active now is lifted to. It never falls: counters only grow, a newcomer
        joins at the minimum, and a tenant leaving can only raise it."""
        return min((self.counters[t] for t in self._live), default=self._last_left)

    def prune(self, floor: float) -> None:
        """Forget idle tenants at or below the floor: on their return the lift gives them the floor anyway."""
        for tenant in [t for t, c in self.counters.items() if c <= floor and t not in self._live]:
            del self.counters[tenant]

    # -- service (Scheduler._admit, Scheduler.update_from_output) ----------
    def admitted(self, seq: Sequence) -> None:
        """Charge an admission's prompt: the tokens it computes, not those found in the prefix cache. A preempted
        sequence's recompute is the engine's choice, not the tenant's: free."""
        if seq.num_preemptions == 0:
            self.counters[tenant_of(seq)] += self.prompt_weight * (seq.num_prompt_tokens - seq.num_cached_tokens)

    def generated(self, seq: Sequence) -> None:
        self.counters[tenant_of(seq)] += self.output_weight

    # -- decisions ---------------------------------------------------------
    def admission_order(self, waiting: Iterable[Sequence]) -> Iterator[Sequence]:
        """The waiting sequences in VTC's order, decided one at a time: each next() gives the first sequence of the
        tenant whose counter is smallest now, so a charge made between two next() calls (an admission) counts
        for the second. Reads waiting once, at the first next()."""
        queues: dict[Hashable, deque[Sequence]] = {}
        for seq in waiting:
            queues.setdefault(tenant_of(seq), deque()).append(seq)
        while queues:
            # A tie is usual right after a lift: the lighter tenant wins it, and min() breaks the rest by queue order.
            tenant = min(queues, key=lambda t: (self.counters[t], self._live[t]))
            queue = queues[tenant]
            yield queue.popleft()
            if not queue:
                del queues[tenant]

    def victim(self, running: Seq[Sequence]) -> Sequence:
        """The sequence to preempt among running (in arrival order): the latest of the most-served tenant."""
        return max(reversed(running), key=lambda seq: self.counters[tenant_of(seq)])
