"""Peak memory of each pipeline rank under its schedule.

A rank holds its stages' model state (parameters, gradients, optimizer state) for the whole
step, and each stage's saved activations from a micro-batch's forward until its backward has
used them. How many micro-batches are in flight at once is the schedule's: GPipe runs every
forward first (m in flight), 1F1B's rank r at most p - r (Narayanan et al. 2021, arXiv
2104.04473 §2.2.1), interleaved and zero-bubble schedules in between and differently per
rank. Rather than a formula per schedule, each rank's actions are walked in the order torch
runs them (``schedule_sim.torch_order``): a forward (F) adds its stage's activations, a full
backward (B) frees them, and in a zero-bubble split the weight-gradient step (W) frees them,
not the input-gradient step (I), since W still reads the saved inputs (Qi et al. 2024, arXiv
2401.10241 §3: ZB-H1/ZB-V keep W's inputs alive until W runs; counting all of a micro-batch's
activations until W is the upper estimate).

A model buffer read by one stage only (a layer's KV cache in a serving step) is held by that
stage's ranks for the whole step (``buffer_stages``), like its parameters. Backward's largest working
set (``memory.backward``: one op's gradients and temporaries) is each rank's own: the largest of its
stages' ops (``rank_working_sets``; a pipeline's gradients are all made by the first micro-batch's
backward, so none is discounted). What the whole-step plan prices once besides the ops' activations,
the user inputs, those buffers and that working set (a buffer read by several stages, a reshard held
until backward, a checkpointed block's recompute peak, a prefetched gather, the gradient buckets'
buffers: ``activation_memory_bytes`` less what ``stage_bytes``, ``held_bytes`` and
``rank_working_sets`` share out) is added to every rank: an upper estimate, since each rank holds
only its stages' share of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.cost.model import NodeCost
from autopar.problem.block_paths import block_of
from autopar.problem.nodes import BUFFER, INPUT, OP, PARAM, PlanGraph, PlanNode
from autopar.pipeline.schedule_sim import torch_order


def node_costs(graph: PlanGraph, chosen: dict) -> dict[str, NodeCost]:
    """Each node's cost under its chosen strategy (the one ``build_plan`` priced)."""
    out = {}
    for name in graph.order:
        node = graph.nodes[name]
        index = next(i for i, s in enumerate(node.strategies) if s is chosen[name])
        out[name] = node.costs[index]
    return out


def stage_bytes(graph: PlanGraph, costs: dict[str, NodeCost], stage_of: dict[str, int],
                params: dict[str, tuple[int, ...]], count: int) -> tuple[list[float], list[float]]:
    """(model state bytes per stage, saved activation bytes of one micro-batch per stage);
    ``params``: the stages holding each parameter (a tied weight's copies each count where they
    are held); the user inputs a micro-batch brings are the first stage's."""
    state, act = [0.0] * count, [0.0] * count
    for name, held in params.items():
        for s in held:
            state[s] += costs[name].memory
    for name in graph.order:
        kind = graph.nodes[name].kind
        if kind == OP and name in stage_of:
            act[stage_of[name]] += costs[name].memory
        elif kind == INPUT:
            act[0] += costs[name].memory
    return state, act


def buffer_stages(graph: PlanGraph, stage_of: dict[str, int]) -> dict[str, int]:
    """Buffer node -> the one stage whose ops read it; a buffer read by several stages (rotary
    tables shared by every layer) or by none is left out: every rank counts it (``whole_step_extra``)."""
    readers: dict[str, set[int]] = {}
    for name, s in stage_of.items():
        for src, _ in graph.nodes[name].args:
            if graph.nodes[src].kind == BUFFER:
                readers.setdefault(src, set()).add(s)
    return {name: next(iter(found)) for name, found in readers.items() if len(found) == 1}


def held_bytes(costs: dict[str, NodeCost], buffers: dict[str, int], count: int) -> list[float]:
    """Bytes per device of the buffers each stage alone reads (``buffer_stages``), held the whole step."""
    held = [0.0] * count
    for name, s in buffers.items():
        held[s] += costs[name].memory
    return held


def whole_step_extra(graph: PlanGraph, costs: dict[str, NodeCost], activation_memory_bytes: float,
                     buffers: dict[str, int] | None = None) -> float:
    """What the whole-step plan's activation bytes hold besides what ``stage_bytes`` shares out
    among the stages, its ops' and user inputs' bytes, and the ``buffers`` one stage holds (module
    docstring)."""
    shared = sum(c.memory for n, c in costs.items() if graph.nodes[n].kind in (OP, INPUT))
    shared += sum(costs[n].memory for n in buffers or {})
    return max(0.0, activation_memory_bytes - shared)


def rank_working_sets(working: Mapping[str, float], stage_of: Mapping[str, int], rank_of: Sequence[int]
                      ) -> tuple[list[float], float]:
    """(each pp rank's largest backward working set: its stages' largest op's, the largest of all: what the
    whole-step plan's activation bytes hold of it); ``working``: each op's (``memory.backward.op_working_sets``)."""
    per_stage = [0.0] * len(rank_of)
    for name, s in stage_of.items():
        per_stage[s] = max(per_stage[s], working.get(name, 0.0))
    per_rank = [0.0] * (max(rank_of, default=-1) + 1)
    for s, r in enumerate(rank_of):
        per_rank[r] = max(per_rank[r], per_stage[s])
    return per_rank, max(per_stage, default=0.0)


def rank_peaks(schedule: str, p: int, v: int, m: int, rank_of: Sequence[int], state: Sequence[float],
               act: Sequence[float], extra: float, working: Sequence[float] = ()) -> list[float]:
    """Each pp rank's peak bytes: its stages' state (and buffers held the whole step), the most
    activations its schedule keeps alive at once (walked in torch's order), ``extra``, and its
    backward working set (``working``, per rank; none if empty)."""
    peaks = []
    for r, ops in enumerate(torch_order(schedule, p, v, m)):
        has_w = {(s, i) for kind, s, i in ops if kind == "W"}
        live = peak = 0.0
        for kind, s, i in ops:
            if kind == "F":
                live += act[s]
                peak = max(peak, live)
            elif kind == "W" or (kind in ("B", "I") and (s, i) not in has_w):
                live -= act[s]
        own = working[r] if working else 0.0
        peaks.append(sum(b for s, b in enumerate(state) if rank_of[s] == r) + peak + extra + own)
    return peaks


@dataclass(frozen=True, kw_only=True)
class MemoryShares:
    """What the busiest pp rank holds of the whole step's memory row, for a stage-mesh ILP
    solved under the memory limit (``search.pipeline_limited``): the state of the repeated blocks' parameters
    times ``block_state``, every other parameter's whole (the head and tail are one rank's), the
    rest (activations and what goes with them) times ``activations``. ``for_pipeline`` gives
    1F1B's first rank: a p-th of the blocks (rounded up), p micro-batches in flight of a p-th of
    the blocks' activations each, i.e. one micro-batch of them all. The exact per-rank peak is
    checked after (``rank_peaks``)."""

    block_state: float
    """Share of the repeated blocks' parameter state."""
    activations: float = 1.0
    """Multiple of one micro-batch's activations of the whole step."""

    @staticmethod
    def for_pipeline(p: int, blocks: int) -> MemoryShares:
        return MemoryShares(block_state=math.ceil(blocks / p) / blocks if blocks else 1.0)

    def weight(self, node: PlanNode) -> float:
        """The share of ``node``'s memory the busiest rank holds: a repeated block's parameter
        ``block_state``, another parameter all of it, anything else ``activations``."""
        if node.kind == PARAM:
            return self.block_state if block_of(node.module or "") is not None else 1.0
        return self.activations

    def weigh(self, graph: PlanGraph, columns: dict[str, list[int]], row: dict[int, float]) -> dict[int, float]:
        """``row`` (column -> bytes) weighted: ``columns`` are each node's strategy columns."""
        weight = {j: self.weight(graph.nodes[v]) for v, cols in columns.items() if graph.nodes[v].kind == PARAM
                  for j in cols}
        return {j: b * weight.get(j, self.activations) for j, b in row.items()}
