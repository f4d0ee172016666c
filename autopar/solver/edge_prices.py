"""Edge prices for one ILP: reshard time and held bytes per (producer group, consumer group).

The same reshard recurs on many edges (q, k and v read one norm; every folded block's
residual stream), so one solve prices each distinct (tensor, edge flags, produced
placement, requested placement and split) once. Keys are interned to small ints: hashing
a tuple of DTensor placements runs Python ``__hash__`` per placement, and an 8B Llama's
ILP looks up ~70,000 pairs. An ``EdgePrices`` serves every solve whose context prices edges alike
(``EdgePrices.key``): a memory search's scenarios of one prepared problem share one.
"""

from __future__ import annotations

from collections.abc import Hashable

from autopar.capture.graph import TensorMeta
from autopar.cost.model import CostContext, EdgeCost, edge_cost, held_reshard_bytes
from autopar.rules.strategy import Placements, Strategy


class EdgePrices:
    """Memoized ``edge_cost`` times and ``held_reshard_bytes`` of one solve's edges."""

    def __init__(self, ctx: CostContext) -> None:
        self._ctx = ctx
        self.key = self.key_of(ctx)
        self._ids: dict[Hashable, int] = {}
        self._cost: dict[tuple[int, int, int], EdgeCost] = {}
        self._held: dict[tuple[int, int, int], float] = {}

    @staticmethod
    def key_of(ctx: CostContext) -> tuple[Hashable, ...]:
        """What of a context ``edge_cost`` and ``held_reshard_bytes`` read: contexts alike here price
        every edge alike (a scenario's offload and ZeRO-1 choices price parameters, not edges)."""
        mesh = ctx.mesh
        return (tuple(mesh.axes.items()), mesh.hardware, mesh.devices_per_node, mesh.zigzag, ctx.precision,
                ctx.train, ctx.micro_batches)

    def _id(self, key: Hashable) -> int:
        return self._ids.setdefault(key, len(self._ids))

    def _ids_of(self, meta: TensorMeta, flags: dict[str, bool], keys_p: list[Placements],
                keys_c: list[tuple[Placements, tuple[bool, ...]]]) -> tuple[int, list[int], list[int]]:
        return (self._id((meta, tuple(flags.items()))), [self._id(a) for a in keys_p],
                [self._id(b) for b in keys_c])

    def held(self, meta: TensorMeta, flags: dict[str, bool], keys_p: list[Placements],
             keys_c: list[tuple[Placements, tuple[bool, ...]]]) -> list[list[float]]:
        """Bytes held until backward when producer group a feeds consumer group b; ``keys_c[b]``
        is (placement asked for, the consumer's split per mesh dim)."""
        edge, ids_p, ids_c = self._ids_of(meta, flags, keys_p, keys_c)
        return [[self._held_at((edge, ia, ib), meta, a, b[0], flags) for ib, b in zip(ids_c, keys_c)]
                for ia, a in zip(ids_p, keys_p)]

    def times(self, meta: TensorMeta, flags: dict[str, bool], keys_p: list[Placements],
              keys_c: list[tuple[Placements, tuple[bool, ...]]], consumers: list[Strategy]) -> list[list[float]]:
        """Reshard seconds (both directions) of producer group a feeding consumer group b;
        ``consumers[b]`` is a strategy of group b (its split is what ``edge_cost`` reads)."""
        edge, ids_p, ids_c = self._ids_of(meta, flags, keys_p, keys_c)
        return [[self._cost_at((edge, ia, ib), meta, a, b[0], consumer, flags).time
                 for ib, b, consumer in zip(ids_c, keys_c, consumers)] for ia, a in zip(ids_p, keys_p)]

    def cost(self, meta: TensorMeta, flags: dict[str, bool], produced: Placements,
             consumed: tuple[Placements, tuple[bool, ...]], consumer: Strategy) -> EdgeCost:
        """The whole ``edge_cost`` (its collectives too) of one pair, as ``times`` prices it."""
        key = (self._id((meta, tuple(flags.items()))), self._id(produced), self._id(consumed))
        return self._cost_at(key, meta, produced, consumed[0], consumer, flags)

    def chosen(self, meta: TensorMeta, flags: dict[str, bool], produced: Placements, consumer: Strategy,
               arg: int) -> tuple[EdgeCost, float]:
        """The edge cost and held bytes of a plan's one edge into ``consumer``'s input ``arg``, as the
        ILP priced that pair (``build_plan`` lists what its solution runs)."""
        consumed = (consumer.inputs[arg], tuple(consumer.is_active(i) for i in range(self._ctx.mesh.ndim)))
        key = (self._id((meta, tuple(flags.items()))), self._id(produced), self._id(consumed))
        return (self._cost_at(key, meta, produced, consumed[0], consumer, flags),
                self._held_at(key, meta, produced, consumed[0], flags))

    def _held_at(self, key: tuple[int, int, int], meta: TensorMeta, produced: Placements, required: Placements,
                 flags: dict[str, bool]) -> float:
        found = self._held.get(key)
        if found is None:
            found = self._held[key] = held_reshard_bytes(meta, produced, required, self._ctx, **flags)
        return found

    def _cost_at(self, key: tuple[int, int, int], meta: TensorMeta, produced: Placements, required: Placements,
                 consumer: Strategy, flags: dict[str, bool]) -> EdgeCost:
        found = self._cost.get(key)
        if found is None:
            found = self._cost[key] = edge_cost(meta, produced, required, consumer, self._ctx, **flags)
        return found
