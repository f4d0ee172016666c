"""Edge prices for one ILP: reshard time and held bytes per (producer group, consumer group).

The same reshard recurs on many edges (q, k and v read one norm; every folded block's
residual stream), so one solve prices each distinct (tensor, edge flags, produced
placement, requested placement and split) once. Keys are interned to small ints: hashing
a tuple of DTensor placements runs Python ``__hash__`` per placement, and an 8B Llama's
ILP looks up ~70,000 pairs. An ``EdgePrices`` serves every solve whose context prices edges alike
(``EdgePrices.key``): a memory search's scenarios of one prepared problem share one, and with it
each edge's whole price matrices, made once for all of their builds; a scenario that flags an edge
recomputed or gathered again prices it from the collectives another scenario found for it
(``cost.model.priced_edge``): the flags decide only whether its forward runs again.
"""

from __future__ import annotations

from collections.abc import Hashable

from autopar.capture.graph import TensorMeta
from autopar.cost.model import (CostContext, EdgeCalls, EdgeCost, edge_calls, held_reshard_bytes, priced_edge,
                                runs_again)
from autopar.problem.nodes import ObjectMemo
from autopar.rules.strategy import Placements, Strategy

EdgeIds = tuple[int, list[int], list[int]]
"""An edge's interned keys (``EdgePrices.ids``): its tensor and flags, its producer groups, its consumer groups."""


class EdgePrices:
    """Memoized ``edge_cost`` times and ``held_reshard_bytes`` of one solve's edges."""

    def __init__(self, ctx: CostContext) -> None:
        self._ctx = ctx
        self.key = self.key_of(ctx)
        self._ids: dict[Hashable, int] = {}
        self._cost: dict[tuple[int, int, int], EdgeCost] = {}
        self._calls: dict[tuple[int, int, int], EdgeCalls] = {}
        """An edge's collectives by (its tensor and the flags they depend on, a, b): memory scenarios flag an
        edge recomputed or regathered, which only decides whether its forward runs again."""
        self._core: dict[int, int] = {}
        """An edge's interned key -> that of its tensor and the flags its collectives depend on."""
        self._held: dict[tuple[int, int, int], float] = {}
        self._by_object = ObjectMemo()
        """Interned placements and scaled matrices, by the object (``_id_of``, ``scaled``)."""
        self._held_rows: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[list[float]]] = {}
        self._time_rows: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[list[float]]] = {}
        """An edge's whole matrices (``held``, ``times``), by its keys: a memory search builds its scenarios'
        models out of the same edges, and an edge's pairs number up to hundreds."""

    @staticmethod
    def key_of(ctx: CostContext) -> tuple[Hashable, ...]:
        """What of a context ``edge_cost`` and ``held_reshard_bytes`` read: contexts alike here price
        every edge alike (a scenario's offload and ZeRO-1 choices price parameters, not edges)."""
        mesh = ctx.mesh
        return (tuple(mesh.axes.items()), mesh.hardware, mesh.devices_per_node, mesh.zigzag, ctx.precision,
                ctx.train, ctx.micro_batches)

    def _id(self, key: Hashable) -> int:
        return self._ids.setdefault(key, len(self._ids))

    def _id_of(self, key: Hashable) -> int:
        """``_id`` of a placement a strategy holds, found by the object first: hashing a tuple of DTensor
        placements runs a Python ``__hash__`` per placement, and a strategy's tuple recurs on every edge it
        ends."""
        return self._by_object.kept("id", key, lambda: self._id(key))

    def ids(self, meta: TensorMeta, flags: dict[str, bool], keys_p: list[Placements],
            keys_c: list[tuple[Placements, tuple[bool, ...]]]) -> EdgeIds:
        """One edge's keys interned: the tensor and its flags, each producer group's placement and each
        consumer group's (placement asked for, the consumer's split per mesh dim). Every price of the
        edge's pairs below reads them."""
        return (self._id((meta, tuple(flags.items()))), [self._id_of(a) for a in keys_p],
                [self._id((self._id_of(placement), active)) for placement, active in keys_c])

    def held(self, ids: EdgeIds, meta: TensorMeta, flags: dict[str, bool], keys_p: list[Placements],
             keys_c: list[tuple[Placements, tuple[bool, ...]]]) -> list[list[float]]:
        """Bytes held until backward when producer group a feeds consumer group b (``ids``: ``self.ids`` of
        the same edge); the caller does not change the rows."""
        key = (ids[0], tuple(ids[1]), tuple(ids[2]))
        found = self._held_rows.get(key)
        if found is None:
            edge, ids_p, ids_c = ids
            found = self._held_rows[key] = [
                [self._held_at((edge, ia, ib), meta, a, b[0], flags) for ib, b in zip(ids_c, keys_c)]
                for ia, a in zip(ids_p, keys_p)]
        return found

    def times(self, ids: EdgeIds, meta: TensorMeta, flags: dict[str, bool], keys_p: list[Placements],
              keys_c: list[tuple[Placements, tuple[bool, ...]]], consumers: list[Strategy]) -> list[list[float]]:
        """Reshard seconds (both directions) of producer group a feeding consumer group b;
        ``consumers[b]`` is a strategy of group b (its split is what ``edge_cost`` reads); the caller does not
        change the rows."""
        key = (ids[0], tuple(ids[1]), tuple(ids[2]))
        found = self._time_rows.get(key)
        if found is None:
            edge, ids_p, ids_c = ids
            found = self._time_rows[key] = [
                [self._cost_at((edge, ia, ib), meta, a, b[0], consumer, flags).time
                 for ib, b, consumer in zip(ids_c, keys_c, consumers)] for ia, a in zip(ids_p, keys_p)]
        return found

    def scaled(self, rows: list[list[float]], factor: float) -> list[list[float]]:
        """``rows`` (a matrix this object returned or scaled) times ``factor``, made once per matrix and factor:
        a memory search's builds price the same edges again. ``rows`` itself where the factor is 1 (exact);
        read only, as the rows it scales."""
        if factor == 1:
            return rows
        return self._by_object.kept(("scaled", factor), rows,
                                    lambda: [[value * factor for value in row] for row in rows])

    def cost(self, ids: EdgeIds, a: int, b: int, meta: TensorMeta, flags: dict[str, bool], produced: Placements,
             required: Placements, consumer: Strategy) -> EdgeCost:
        """The whole ``edge_cost`` (its collectives too) of pair (a, b) of the edge ``ids`` names, as
        ``times`` prices it: ``produced`` is group a's placement, ``required`` what group b asks for."""
        edge, ids_p, ids_c = ids
        return self._cost_at((edge, ids_p[a], ids_c[b]), meta, produced, required, consumer, flags)

    def chosen(self, meta: TensorMeta, flags: dict[str, bool], produced: Placements, consumer: Strategy,
               arg: int) -> tuple[EdgeCost, float]:
        """The edge cost and held bytes of a plan's one edge into ``consumer``'s input ``arg``, as the
        ILP priced that pair (``build_plan`` lists what its solution runs)."""
        consumed = (consumer.inputs[arg], tuple(consumer.is_active(i) for i in range(self._ctx.mesh.ndim)))
        key = (self._id((meta, tuple(flags.items()))), self._id_of(produced),
               self._id((self._id_of(consumed[0]), consumed[1])))
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
            core = self._core.get(key[0])
            if core is None:  # what the edge's collectives depend on: not whether its forward runs again
                core = self._core[key[0]] = self._id(("calls", meta, flags["from_parameter"], flags["needs_grad"],
                                                      flags["grouped"]))
            calls = self._calls.get((core, key[1], key[2]))
            if calls is None:
                calls = self._calls[(core, key[1], key[2])] = edge_calls(
                    meta, produced, required, consumer, self._ctx, from_parameter=flags["from_parameter"],
                    needs_grad=flags["needs_grad"], grouped=flags["grouped"])
            again = runs_again(self._ctx, flags["from_parameter"], flags["needs_grad"], flags["recomputed"],
                               flags["saves_input"], flags["regathered"])
            found = self._cost[key] = priced_edge(calls, self._ctx, again)
        return found
