"""Serving steps planned by the intra-op ILP: a replica's prefill and decode steps, each a forward-only
``autopar.plan_step`` on the replica's mesh, and the ``StepTimes`` fitted through them.

Which points, and why the form is right (the cost model prices each op by its roofline, the
larger of FLOPs at peak and bytes at bandwidth, plus its collectives):

- Decode, batch B over a cache of L positions per row: the weights are read once per step, every
  request adds its activations, sampled logits and all-reduce bytes, and its attention reads its
  cache (writes, gathers and the masked product all scale with B x L). So
  ``t = w + beta B + gamma C`` with C = B x L the context tokens read. Planned at (B1, L1), (B2, L1),
  (B2, L2) (``DECODE_BATCHES`` and two contexts: a quarter of the workload's longest request and the
  longest), the three coefficients solved exactly.
- Prefill, one chunk of T tokens over a cache of L positions: compute-bound past a few hundred
  tokens, its matmuls linear in T and its attention in the (query, key) pairs it computes, T x L.
  So ``t = a + b T + c P``; planned at (T1, T1), (T2, T2) and (T1, T2) (two whole prompts and a
  chunk after a prefix), solved exactly. ``c`` is per pair computed; the simulator passes causal
  pairs (a chunk of c after p: c p + c(c+1)/2), which is what a kernel that skips masked blocks
  (flash attention) computes: the example's program applies its mask instead, so its planned
  points compute about twice the pairs of a causal prompt.
- A step of N new tokens, B of them decodes (chunked prefill mixes both), costs the larger of the two
  lines, ``max(w + beta B + gamma C, a + b N + c P)``: whole steps on a roofline. A small prefill chunk
  still reads every weight (the decode line's w), a large decode batch turns compute-bound (the prefill
  line). Prefill tokens are not charged beta: the decode plans' per-request cost is in the decode plans'
  layout, which the ILP does not choose for a prefill (it may split a prompt's tokens instead). Per-op
  rooflines summed are convex, so the lines are chords between their points (pessimistic inside,
  optimistic beyond); ``tests/test_serving_plan.py`` checks a held-out planned point against the fit.

All steps of a replica are planned with its parameters placed alike (``plan_step_times``'s layouts: a
replica holds one copy of its weights, as ``compile_serving`` runs it), each leaving room for a full
batch's caches (``Reserve``). KV capacity per replica: the
device memory limit less the largest (weights + activations other than the cache) over the planned points
its phases run, over the plan's KV bytes per token per device (the cache buffers' shares as the plan
places them). Planned steps are cached per model, mesh, memory limit and shape, so a search over SLOs or
cluster sizes plans each step once.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from autopar.config import PlanConfig
from autopar.cost.collectives import point_to_point_time
from autopar.errors import InputError, MemoryLimitError
from autopar.hardware import HardwareProfile
from autopar.mesh import Mesh
from autopar.pipeline.spec import Pipeline
from autopar.problem.nodes import PARAM
from autopar.search import planner
from autopar.search.planned import PlannedStep
from autopar.search.problem import Step
from autopar.serving.servable import KV_HEADS_DIM, StepShape, cache_buffers, kv_bytes_per_token, step_inputs
from autopar.serving.staged import SERVING_PIPELINE, Cut, element_size, stage_figures

DECODE_BATCHES = (32, 128)
"""Decode batches planned: both large enough that the cache's ops are past their per-call latency floor
(at 8 requests of 512 tokens they are not, and the line's slope would come out too low)."""
PREFILL_TOKENS = (256, 2048)
"""Prefill chunk lengths planned (the larger capped by the token budget and the model's positions)."""


@dataclass(frozen=True, kw_only=True)
class PlannedPoint:
    """One planned serving step and the figures the fit and the KV capacity read from its plan."""

    shape: StepShape
    """What the step holds."""
    step_time_s: float
    """The plan's predicted seconds (``plan.predicted.step_time_s``: compute and exposed communication)."""
    weight_bytes: float
    """Weights per device, as the plan places them."""
    working_bytes: float
    """Activations per device other than the KV cache (the plan's activations less its cache share)."""
    kv_bytes_per_token_device: float
    """KV-cache bytes a token takes on one device, as the plan splits the cache buffers."""
    kv_bytes_per_token: int
    """KV-cache bytes a token takes over the whole replica's cache (every layer, keys and values, unsplit)."""
    parameters: dict[str, str] = field(repr=False)
    """The plan's placement of every parameter (a serving plan reports them)."""
    state: "State" = field(repr=False)
    """The parameters' placements as the ``state_placements`` option takes them (to pin other steps)."""
    cut: Cut = ()
    """A pipelined step's stages' units (``Pipeline.stage_blocks``, to pin other steps); () without pp."""


EXPERT_PARALLEL: dict[str, Any] = {"data_axes": ("ep",), "expert_axes": ("ep",)}
"""A decode step on an expert-parallel replica (``compile_serving(decode_options=...)`` runs it so): the batch
of slots split on ep (attention data parallel), the stacked expert weights free to split by expert there,
tokens reaching their experts by all-to-all (DeepSeek-V3's serving: data-parallel attention, experts on ep)."""

State = tuple[tuple[str, tuple[Placement, ...]], ...]
"""Parameter FQN -> placement per mesh axis, as a sorted tuple (hashable: a key of the cache of planned steps)."""


_PLANNED: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, PlannedPoint | InputError]]" = weakref.WeakKeyDictionary()
"""Planned points per model object, by (hardware, devices per node, tp, pp, limit, shape, pins); a step that
cannot be planned (no plan fits the memory) keeps its error, which is as costly to find as a plan."""


def plan_point(model: nn.Module, profile: HardwareProfile, devices_per_node: int, tp: int, shape: StepShape,
               memory_limit: float, pinned: State = (), *, pp: int = 1, cut: Cut = (), ep: int = 1) -> PlannedPoint:
    """The step ``shape`` planned forward-only on a ``{"tp": tp}`` mesh of ``profile`` (cached), its
    parameters placed as ``pinned`` says (another step's ``state``: one replica holds one copy of its weights).
    ``pp`` > 1: on a ``{"pp": pp, "tp": tp}`` mesh, one micro-batch through pp stages (``staged``), cut as
    ``cut`` says (another step's ``cut``; () lets the planner cut). ``ep`` > 1 (with tp = pp = 1): on an
    ``{"ep": ep}`` mesh, a decode step's batch of slots split there with the experts free to split by expert
    (``EXPERT_PARALLEL``), a prefill chunk (one request: no batch to split) planned freely around them."""
    key = (profile.name, devices_per_node, tp, pp, ep, memory_limit, shape, pinned, cut)
    cache = _PLANNED.setdefault(model, {})
    if key not in cache:
        try:
            cache[key] = _planned(model, profile, devices_per_node, (tp, pp, ep), shape, memory_limit, pinned, cut)
        except InputError as exc:
            cache[key] = exc
    found = cache[key]
    if isinstance(found, InputError):
        raise found
    return found


def cache_placements(buffers: dict[str, torch.Tensor], tp: int) -> dict[str, tuple[Placement, ...]]:
    """The cache buffers (slots, max_len, kv heads, ...) split by KV heads on tp where those divide by
    it, replicated where they do not (as vLLM keeps them): pinned, since a step's time barely sees
    the cache's layout (a write touches a few rows) while its memory is what a replica serves from."""
    return {name: (Shard(KV_HEADS_DIM) if tp > 1 and b.shape[KV_HEADS_DIM] % tp == 0 else Replicate(),)
            for name, b in buffers.items()}


def _plan(model: nn.Module, mesh: Mesh, inputs: tuple[Any, ...], **options: Any) -> PlannedStep:
    """A forward step of ``model`` planned on ``mesh`` (``search.planner``)."""
    return planner.plan(Step(model=model, example_inputs=inputs), PlanConfig.from_options(train=False, **options), mesh)


def _planned(model: nn.Module, profile: HardwareProfile, devices_per_node: int, replica: tuple[int, int, int],
             shape: StepShape, memory_limit: float, pinned: State, cut: Cut) -> PlannedPoint:
    """``plan_point`` uncached; ``replica``: (tp, pp, ep)."""
    tp, pp, ep = replica
    inputs = step_inputs(model, shape)
    buffers = cache_buffers(model, shape)
    placements = {**dict(pinned), **cache_placements(buffers, tp)}
    if pp > 1:  # the stage mesh is {"tp": tp}: the placements (one entry per axis) are the stages' too
        pipeline = Pipeline(axis="pp", stage_blocks=cut or None, **SERVING_PIPELINE)
        planned = _plan(model, Mesh({"pp": pp, "tp": tp}, profile, devices_per_node), inputs,
                        memory_limit=memory_limit, state_placements=placements, pipeline=pipeline)
    elif ep > 1:  # the cache stays whole on ep (each rank reads its own slots' rows of it)
        if shape.steps == 1 and shape.batch % ep:
            raise InputError(f"a decode step of {shape.batch} requests does not split over ep={ep}")
        batch_split = EXPERT_PARALLEL if shape.steps == 1 else {}
        planned = _plan(model, Mesh({"ep": ep}, profile, devices_per_node), inputs,
                        memory_limit=memory_limit, state_placements=placements, **batch_split)
    else:
        planned = _plan(model, Mesh({"tp": tp}, profile, devices_per_node), inputs,
                        memory_limit=memory_limit, state_placements=placements)
    plan = planned.plan
    state = tuple(sorted((node.fqn or name, tuple(planned.chosen[name].outputs[0]))
                         for name, node in planned.graph.nodes.items() if node.kind == PARAM))
    if plan.pipeline is not None:
        staged = stage_figures(plan.pipeline, [(n.module, n.shapes[0], n.outputs[0]) for n in plan.nodes
                                               if n.op == "buffer" and n.shapes and n.shapes[0][:2] ==
                                               [shape.batch, shape.max_len]],
                               shape.batch, shape.max_len, element_size(buffers), tp)
        return PlannedPoint(shape=shape, step_time_s=plan.predicted.step_time_s, weight_bytes=staged.weight_bytes,
                            working_bytes=staged.working_bytes,
                            kv_bytes_per_token_device=staged.kv_bytes_per_token_device or kv_bytes_per_token(buffers),
                            kv_bytes_per_token=kv_bytes_per_token(buffers), parameters=dict(plan.parameters),
                            state=state, cut=staged.cut)
    kv_device = 0.0
    for node in plan.nodes:  # the cache buffers as the plan places them
        if node.op == "buffer" and node.shapes and node.shapes[0][:2] == [shape.batch, shape.max_len]:
            per_token = math.prod(node.shapes[0][2:]) * next(iter(buffers.values())).element_size()
            kv_device += per_token / (tp if "S" in node.outputs[0] else 1)
    if not kv_device:  # the buffers are the cache (cache_buffers found them), but no plan node matched
        kv_device = kv_bytes_per_token(buffers)
    parts = plan.predicted.memory_parts
    cache_bytes = kv_device * shape.batch * shape.max_len
    return PlannedPoint(shape=shape, step_time_s=plan.predicted.step_time_s,
                        weight_bytes=parts.get("weights", plan.predicted.parameter_memory_bytes),
                        working_bytes=max(parts.get("activations", 0.0) - cache_bytes, 0.0),
                        kv_bytes_per_token_device=kv_device, kv_bytes_per_token=kv_bytes_per_token(buffers),
                        parameters=dict(plan.parameters), state=state)


@dataclass(frozen=True, kw_only=True)
class Reserve:
    """Room for the KV cache a replica needs, kept out of the memory its steps are planned in.

    The ILP minimizes a step's time within the memory limit: left the whole device, it keeps weights
    replicated wherever that saves communication (a 70B prefill at tp=4 fills 75 GB per device), leaving
    no room for the caches that make a serving replica useful. So each step is planned within the limit
    less the cache of ``tokens`` tokens not already in the step itself, at the cache's share per device
    when split by heads; where that leaves no plan the whole limit is used (the capacity then says so)."""

    tokens: int
    """KV tokens to leave room for: ``plan_serving`` asks for a full batch at the mean request length."""
    bytes_per_token: float
    """KV bytes of a token per device, as reserved (the whole cache's over tp x pp)."""
    limit: float
    """The device's memory limit."""

    def plan(self, model: nn.Module, profile: HardwareProfile, devices_per_node: int, tp: int, shape: StepShape,
             pinned: State = (), *, pp: int = 1, cut: Cut = (), ep: int = 1) -> PlannedPoint:
        spare = max(self.tokens - shape.batch * shape.max_len, 0) * self.bytes_per_token
        if spare and spare < self.limit:
            try:
                return plan_point(model, profile, devices_per_node, tp, shape, self.limit - spare, pinned,
                                  pp=pp, cut=cut, ep=ep)
            except MemoryLimitError:
                pass
        return plan_point(model, profile, devices_per_node, tp, shape, self.limit, pinned, pp=pp, cut=cut, ep=ep)


def _solve(rows: list[tuple[float, float, float]], times: list[float]) -> tuple[float, float, float]:
    """The line through three points (exact: the points are chosen independent)."""
    a, b, c = np.linalg.solve(np.array(rows, dtype=float), np.array(times, dtype=float))
    return float(a), float(b), float(c)


@dataclass(frozen=True, kw_only=True)
class PlannedStepTimes:
    """``StepTimes`` of one replica fitted through ILP-planned steps (module docstring). A replica of pp > 1
    stages serves as vLLM's pipeline parallelism does: pp batches in flight, each stage busy with a different
    one, so it is pp virtual replicas, each with the whole chain's latency as its step time and 1/pp of the
    replica's KV cache. These times are one virtual replica's (the simulator runs replicas x pp of them)."""

    tp: int
    """Tensor-parallel degree of the replica (devices per stage)."""
    decode_line: tuple[float, float, float]
    """(w, beta, gamma): seconds, per token in the step, per context token read."""
    prefill_line: tuple[float, float, float]
    """(a, b, c): seconds, per token in the step, per (query, key) pair."""
    kv_capacity_tokens: int
    """Tokens of KV cache one replica holds (for the phases it runs)."""
    kv_bytes_per_token_device: float
    """KV bytes a token takes on one device of the replica."""
    transfer_mesh: Mesh = field(repr=False, compare=False)
    """Two devices whose link carries a KV transfer (intra- or inter-node)."""
    state: State = field(repr=False, compare=False)
    """The replica's parameter placements (its layout's anchor step's), every other planned step pinned to them."""
    prefill_points: tuple[PlannedPoint, ...] = field(repr=False, compare=False)
    """The planned prefill steps the line goes through."""
    decode_points: tuple[PlannedPoint, ...] = field(repr=False, compare=False)
    """The planned decode steps the line goes through."""
    step_overhead_s: float = 0.0
    """Fixed seconds per step besides the planned program (scheduler, sampling)."""
    pp: int = 1
    """Pipeline stages of the replica (its devices: tp x pp); ``kv_capacity_tokens`` is a pp-th of its cache."""
    ep: int = 1
    """Expert-parallel devices of the replica (``plan_point``; then tp = pp = 1): its cache is whole on each."""

    @property
    def devices(self) -> int:
        """Devices of one replica."""
        return self.tp * self.pp * self.ep

    def mixed_s(self, prefill_tokens: int, prefill_context: int, decode_batch: int,
                decode_context_tokens: int) -> float:
        tokens = prefill_tokens + decode_batch
        if tokens == 0:
            return 0.0
        w, beta, gamma = self.decode_line
        a, b, c = self.prefill_line
        # Prefill tokens are charged on the compute line only: a chunk's per-token work on the memory line
        # would be priced in the decode plan's layout, which the ILP does not pick for a prefill.
        memory = w + beta * decode_batch + gamma * decode_context_tokens
        compute = a + b * tokens + c * (prefill_context + decode_context_tokens)
        return max(memory, compute, 0.0) + self.step_overhead_s

    def prefill_s(self, tokens_in_batch: int, context: int) -> float:
        return self.mixed_s(tokens_in_batch, context, 0, 0)

    def decode_s(self, batch_size: int, total_context_tokens: int) -> float:
        return self.mixed_s(0, 0, batch_size, total_context_tokens)

    def kv_transfer_s(self, tokens: int) -> float:
        # Each device of the replica receives its share of the heads, all in parallel.
        return point_to_point_time(tokens * self.kv_bytes_per_token_device, 0, self.transfer_mesh)

    def for_phases(self, points: tuple[PlannedPoint, ...], cache_points: tuple[PlannedPoint, ...],
                   memory_limit: float) -> "PlannedStepTimes":
        """This replica with the KV capacity left when it runs the steps of ``points`` and keeps its
        caches as the plans of ``cache_points`` place them (a prefill pool: its prefill plans'), shared by its
        pp virtual replicas (class docstring)."""
        per_token = max(p.kv_bytes_per_token_device for p in cache_points)
        return replace(self, kv_capacity_tokens=kv_capacity(points, memory_limit, per_token) // self.pp,
                       kv_bytes_per_token_device=per_token)


def kv_capacity(points: tuple[PlannedPoint, ...], memory_limit: float, per_token: float) -> int:
    """Tokens of KV cache of ``per_token`` bytes per device left beside the largest weights and the
    largest working memory of ``points`` (a replica holds one set of weights, and runs one step at a time)."""
    used = max(p.weight_bytes for p in points) + max(p.working_bytes for p in points)
    return max(int((memory_limit - used) // per_token), 0)


def plan_step_times(model: nn.Module, profile: HardwareProfile, devices_per_node: int, tp: int, *,
                    max_context: int, token_budget: int, max_positions: int, transfer_intra_node: bool,
                    kv_reserve_tokens: int = 0, step_overhead_s: float = 0.0, layout: str = "decode", pp: int = 1,
                    ep: int = 1) -> PlannedStepTimes:
    """A replica of ``tp`` x ``pp`` devices: its prefill and decode steps planned (module docstring) and fitted.
    ``max_context``: the longest request (prompt + output) to serve; ``max_positions``: the model's limit;
    ``kv_reserve_tokens``: KV-cache tokens the steps are planned to leave room for (``Reserve``).

    One replica holds one copy of its weights, so every step is planned with the parameters placed as
    one anchor step's plan (``compile_serving`` runs them so): ``layout="decode"`` (aggregated and decode
    replicas) anchors at the largest decode step, planned freely; ``"prefill"`` (prefill replicas) at the
    largest prefill step, its decode line borrowed from the decode layout (a prefill replica decodes
    nothing: the line only floors its small chunks at a read of the weights). With ``pp`` > 1 the anchor's
    stage cut is pinned too (``compile_serving`` cuts the prefill at the decode's): every step holds the same
    layers, and caches, on each stage. ``ep`` > 1: an expert-parallel replica of ``ep`` devices (``plan_point``),
    decode layout only (a prefill chunk has no batch to split: its own layout would be a TP replica's)."""
    if layout not in ("decode", "prefill"):
        raise InputError(f"layout must be 'decode' or 'prefill', got {layout!r}")
    if ep > 1 and (tp, pp, layout) != (1, 1, "decode"):
        raise InputError(f"an expert-parallel replica (ep={ep}) runs alone on its devices (tp = pp = 1), in the "
                         "decode layout")
    limit = profile.memory_limit()
    probe = StepShape(batch=1, steps=1, max_len=2)
    step_inputs(model, probe)
    reserve = Reserve(tokens=kv_reserve_tokens, limit=limit,
                      bytes_per_token=kv_bytes_per_token(cache_buffers(model, probe)) / (tp * pp))
    long = min(max_context, max_positions)
    short = max(long // 4, 1)
    if long <= short:
        raise InputError(f"requests of up to {max_context} tokens are too short to plan decode steps at two contexts")
    t1, t2 = min(PREFILL_TOKENS[0], max_positions // 2), min(max(token_budget, PREFILL_TOKENS[0] * 2), max_positions)
    b1, b2 = DECODE_BATCHES

    def points(shapes: list[StepShape], anchor: int, pin: PlannedPoint | None) -> tuple[PlannedPoint, ...]:
        first = reserve.plan(model, profile, devices_per_node, tp, shapes[anchor], pin.state if pin else (), pp=pp,
                             cut=pin.cut if pin else (), ep=ep)
        pin = pin or first
        return tuple(first if i == anchor else reserve.plan(model, profile, devices_per_node, tp, shape, pin.state,
                                                            pp=pp, cut=pin.cut, ep=ep)
                     for i, shape in enumerate(shapes))
    decode_shapes = [StepShape(batch=b, steps=1, max_len=n) for b, n in ((b1, short), (b2, short), (b2, long))]
    prefill_shapes = [StepShape(batch=1, steps=t, max_len=n) for t, n in ((t1, t1), (t2, t2), (t1, t2))]
    decode = points(decode_shapes, 2, None)
    prefill = points(prefill_shapes, 1, decode[2] if layout == "decode" else None)
    decode_line = _solve([(1, p.shape.tokens, p.shape.context_tokens) for p in decode],
                         [p.step_time_s for p in decode])
    prefill_line = _solve([(1, p.shape.tokens, p.shape.pairs) for p in prefill], [p.step_time_s for p in prefill])
    pair = Mesh({"pd": 2}, profile, devices_per_node=2 if transfer_intra_node else 1)
    # Aggregated by default: both phases' steps, the caches as the decode plans keep them (decodes hold them longest).
    times = PlannedStepTimes(tp=tp, decode_line=decode_line, prefill_line=prefill_line, kv_capacity_tokens=0,
                             kv_bytes_per_token_device=0.0, transfer_mesh=pair,
                             state=decode[2].state if layout == "decode" else prefill[1].state,
                             prefill_points=prefill, decode_points=decode, step_overhead_s=step_overhead_s, pp=pp,
                             ep=ep)
    return times.for_phases(prefill + decode, decode, limit)


def describe_points(times: PlannedStepTimes) -> list[dict[str, Any]]:
    """The planned points as JSON rows (what the fit went through)."""
    return [{"phase": phase, "batch": p.shape.batch, "steps": p.shape.steps, "max_len": p.shape.max_len,
             "step_time_s": p.step_time_s, "weight_bytes": p.weight_bytes, "working_bytes": p.working_bytes}
            for phase, points in (("prefill", times.prefill_points), ("decode", times.decode_points))
            for p in points]
