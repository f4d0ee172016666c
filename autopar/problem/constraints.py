"""Pin placements from a hand-written tensor-parallel plan (torchtitan style).

``{"layers.*.attention.wq": ColwiseParallel(), ...}`` fixes, on one mesh axis, the
placements PyTorch's ``parallelize_module`` would give those modules' parameters and
ops; everything else (other axes, unlisted ops) stays free, so a user's plan is priced
by the same cost model as the free plan, and the free plan can only be as fast or faster.

A pinned ``Shard(d)`` is also met by a strided shard of dim d (``strided(d, k)``): both
split the same features across the axis, only which rank holds which slice differs. So
``ColwiseParallel`` on a fused qkv projection may run as Megatron's interleaved QKV,
where each rank holds its heads' q, k and v and the attention needs no collective.
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from autopar.errors import InputError
from autopar.capture.graph import TensorMeta
from autopar.cost.moe import is_moe
from autopar.rules.strategy import OpCall, Strategy, is_strided
from autopar.problem.nodes import BUFFER, PARAM, PlanGraph

aten = torch.ops.aten


@dataclass
class Pin:
    """Required placements of one node on the pinned mesh axis."""

    output: Placement | None = None
    inputs: dict[int, Placement] = field(default_factory=dict)
    reason: str = ""
    strided_ok: bool = False
    """A strided shard of a pinned ``Shard(d)``'s dim also meets it (a TP style's feature
    split). Not for a data-parallel batch split: inputs passed already split are contiguous."""
    split: bool = False
    """The (first) output must not be Replicate on the axis: data split there stays split."""
    split_inputs: tuple[int, ...] = ()
    """Tensor inputs that must not arrive Replicate on the axis (data split there is not gathered)."""

    def __repr__(self) -> str:
        return (f"Pin({self.output}, {sorted(self.inputs.items())}, strided_ok={self.strided_ok}, split={self.split}, "
                f"split_inputs={self.split_inputs})")

    def admits(self, strategy: Strategy, axis: int) -> bool:
        """``strategy`` meets this pin on mesh dim ``axis``."""
        out = strategy.outputs[0] if strategy.outputs else None
        if self.output is not None and (out is None or not _meets(out[axis], self.output, self)):
            return False
        if self.split and (out is None or isinstance(out[axis], Replicate)):
            return False
        if any(isinstance(strategy.inputs[k][axis], Replicate) for k in self.split_inputs):
            return False
        return all(_meets(strategy.inputs[k][axis], p, self) for k, p in self.inputs.items())


def _norm(p: Placement, ndim: int) -> Placement:
    if isinstance(p, Shard) and p.dim < 0:
        return Shard(p.dim + ndim)
    return p


def pins_from_tp_plan(graph: PlanGraph, tp_plan: dict[str, object], axis: int) -> tuple[dict[str, Pin], dict[str, str]]:
    """Pins per node name, and a printable summary (pattern -> style)."""
    pins: dict[str, Pin] = {}
    weak: dict[str, Pin] = {}  # layouts a style asks of its neighbours; yield to their own pins
    consumers = graph.consumers()
    summary: dict[str, str] = {}
    modules = defaultdict(list)
    for name in graph.order:
        node = graph.nodes[name]
        modules[node.module].append(name)
    for pattern, style in tp_plan.items():
        matched = [m for m in modules if m and fnmatch.fnmatchcase(m, pattern)]
        if not matched:
            raise InputError(f"constraint {pattern!r} matches no module of the model")
        summary[pattern] = type(style).__name__
        for module in matched:
            where = f"{type(style).__name__} on {module}"
            if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not any(
                    graph.nodes[n].kind == "op" and graph.nodes[n].call.target in (aten.linear.default,
                                                                                   aten.embedding.default)
                    for n in modules[module]):
                raise InputError(f"{where}: the module runs no linear or embedding op; like torch's "
                                 f"{type(style).__name__}, it applies to nn.Linear and nn.Embedding only")
            embedding = any(graph.nodes[n].kind == "op" and graph.nodes[n].call.target is aten.embedding.default
                            for n in modules[module])
            for name in modules[module]:
                node = graph.nodes[name]
                if node.kind == PARAM:
                    pins[name] = Pin(output=_param_placement(style, node.fqn or name, where, embedding), reason=where)
                    continue
                if node.kind != "op":
                    continue
                pin = _op_pin(style, node.call, where)
                if pin is None:
                    continue
                pins[name] = pin
                if isinstance(style, (ColwiseParallel, RowwiseParallel)):
                    given = 1 if embedding else 0  # the module's input: an embedding's indices, not its table
                    x = node.call.tensor_inputs[given]
                    src, idx = node.args[given]
                    if idx == 0:
                        weak[src] = Pin(output=_norm(style.input_layouts[0], x.ndim), reason=where)
                    out_layout = _norm(style.output_layouts[0], node.outputs[0].ndim)
                    if isinstance(style, RowwiseParallel):
                        for consumer, arg, _ in consumers[name]:
                            weak.setdefault(consumer, Pin(reason=where)).inputs[arg] = out_layout
    for name, pin in weak.items():
        if name in pins:
            continue
        pins[name] = pin
    for pin in pins.values():
        pin.strided_ok = True
    return pins, summary


def _param_placement(style: object, fqn: str, where: str, embedding: bool) -> Placement:
    """The placement torch's style gives a parameter: an nn.Linear weight is [out, in], so
    colwise splits dim 0 and rowwise dim 1; an nn.Embedding table is [vocab, dim], so colwise
    splits the embedding dim (1) and rowwise the vocabulary (0)."""
    leaf = fqn.rsplit(".", 1)[-1]
    if isinstance(style, ColwiseParallel):
        if embedding:
            return Shard(1) if leaf == "weight" else Replicate()
        return Shard(0) if leaf in ("weight", "bias") else Replicate()
    if isinstance(style, RowwiseParallel):
        if embedding:
            return Shard(0) if leaf == "weight" else Replicate()
        return Shard(1) if leaf == "weight" else Replicate()
    if isinstance(style, SequenceParallel):
        return Replicate()
    raise InputError(f"{where}: style {type(style).__name__} is not supported as a constraint "
                     "(use ColwiseParallel, RowwiseParallel or SequenceParallel)")


def _op_pin(style: object, call: OpCall, where: str) -> Pin | None:
    out = call.outputs[0]
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        if call.target is aten.linear.default:
            has_bias = len(call.tensor_inputs) == 3
            if isinstance(style, ColwiseParallel):
                inputs = {0: Replicate(), 1: Shard(0), **({2: Shard(0)} if has_bias else {})}
                return Pin(output=Shard(out.ndim - 1), inputs=inputs, reason=where)
            x = call.tensor_inputs[0]
            # The bias (a replicated parameter) joins the Partial sum on one rank only, which
            # equals torch's adding it after the all-reduce.
            inputs = {0: Shard(x.ndim - 1), 1: Shard(1), **({2: Partial()} if has_bias else {})}
            return Pin(output=Partial(), inputs=inputs, reason=where)
        if call.target is aten.embedding.default:
            if isinstance(style, RowwiseParallel):  # the vocabulary split: each rank's rows, a Partial lookup
                return Pin(output=Partial(), inputs={0: Shard(0), 1: Replicate()}, reason=where)
            return Pin(output=Shard(out.ndim - 1), inputs={0: Shard(1), 1: Replicate()}, reason=where)
        return None  # ops inside the module other than its matmul follow freely
    if isinstance(style, SequenceParallel):
        seq = style.sequence_sharding[0]
        placement = _norm(seq, out.ndim)
        return Pin(output=placement, inputs={0: _norm(seq, call.tensor_inputs[0].ndim)}, reason=where)
    raise InputError(f"{where}: style {type(style).__name__} is not supported as a constraint "
                     "(use ColwiseParallel, RowwiseParallel or SequenceParallel)")


def _meets(actual: Placement, pinned: Placement, pin: Pin) -> bool:
    """``actual`` satisfies a pin: equal, or (where the pin allows) a strided shard of the pinned Shard's dim."""
    if actual == pinned:
        return True
    return pin.strided_ok and isinstance(pinned, Shard) and is_strided(actual) and actual.dim == pinned.dim


def apply_pins(graph: PlanGraph, pins: dict[str, Pin], axis: int, axis_name: str, axis_size: int) -> None:
    """Keep only the strategies that agree with each pin on ``axis``; explain a pin nothing meets."""
    for name, pin in pins.items():
        node = graph.nodes[name]
        keep = [i for i, s in enumerate(node.strategies) if pin.admits(s, axis)]
        if not keep:
            shapes = [tuple(m.shape) for m in node.outputs if m is not None]
            dims = ""
            if isinstance(pin.output, Shard) and shapes and pin.output.dim < len(shapes[0]):
                size = shapes[0][pin.output.dim]
                if size % axis_size:
                    dims = f": dim {pin.output.dim} of size {size} does not divide by mesh axis {axis_name}={axis_size}"
            shown = ", ".join(str(tuple(sh)) for sh in shapes)
            wanted = pin.output if pin.output is not None else "a split output" if pin.split else "its pinned inputs"
            raise InputError(f"{pin.reason}: {name} ({node.op}, shape {shown}) cannot take "
                             f"{wanted} on axis {axis_name}{dims}")
        node.strategies = [node.strategies[i] for i in keep]
        node.costs = [node.costs[i] for i in keep]
        if node.comm_times:
            node.comm_times = [node.comm_times[i] for i in keep]


def data_parallel_pins(graph: PlanGraph, user_inputs: list[str], axis: int, axis_name: str, *,
                       inputs_whole: bool = True, free_params: frozenset[str] = frozenset()) -> dict[str, Pin]:
    """Plain data parallelism on one axis: parameters replicated (but ``free_params``, left to
    the planner: expert weights on an expert axis, ``expert_parameters``), batch inputs split on dim 0
    (strided allowed when every rank receives the whole batch and slices it itself), and
    everything computed from the inputs stays split on the axis (Shard or Partial: each rank
    works on its part of the batch, never gathers it) wherever the op has such a strategy;
    an op that can only run replicated (no rule), or writes into a replicated tensor in
    place, gathers its input, as the plan then shows."""
    return _split_input_pins(graph, user_inputs, axis, 0, _batch_size(graph, user_inputs),
                             f"data parallel on {axis_name}", "batch split", inputs_whole, gathers=False,
                             free_params=free_params)


def context_parallel_pins(graph: PlanGraph, user_inputs: list[str], axis: int, axis_name: str) -> dict[str, Pin]:
    """Context parallelism on one axis: as ``data_parallel_pins``, but the inputs are split on
    dim 1, the sequence (every input whose leading dims are the first input's batch and
    sequence: tokens, positions, targets), in contiguous chunks; what is computed from them
    stays split on the axis, though an op may gather an input split there (attention takes
    its queries split on the sequence and gathers keys and values, ``rules.attention``)."""
    first = _first_input(graph, user_inputs)
    if first is None or first.ndim < 2:
        raise InputError(f"context parallel on {axis_name}: the first input needs a sequence dim (dim 1) to split, "
                         f"got shape {None if first is None else tuple(first.shape)}")
    return _split_input_pins(graph, user_inputs, axis, 1, first.shape[:2], f"context parallel on {axis_name}",
                             "sequence split", False, gathers=True)


def _split_input_pins(graph: PlanGraph, user_inputs: list[str], axis: int, dim: int,
                      leading: int | tuple[int, ...] | None, why: str, what: str, strided_ok: bool, *,
                      gathers: bool, free_params: frozenset[str] = frozenset()) -> dict[str, Pin]:
    """Parameters replicated (but ``free_params``); user inputs whose leading dims are ``leading`` (a batch size,
    or (batch, sequence)) split on ``dim``; ops computed from them kept split where they can
    (their outputs; with ``gathers`` False their split inputs too); an op that cannot keep them split
    gathers them, and what it computes is not pinned on (indices a ``where`` makes from a gathered mask
    would otherwise be pinned Partial and all-reduced again before every reader)."""
    pins: dict[str, Pin] = {}
    from_data: set[str] = set()
    want = (leading,) if isinstance(leading, int) or leading is None else tuple(leading)
    for name in graph.order:
        node = graph.nodes[name]
        if node.kind == PARAM:
            if name not in free_params:
                pins[name] = Pin(output=Replicate(), reason=why)
        elif name in user_inputs and node.outputs[0] is not None and node.outputs[0].shape[:len(want)] == want:
            pins[name] = Pin(output=Shard(dim), reason=f"{why} ({what})", strided_ok=strided_ok)
            from_data.add(name)
        elif node.kind == "op" and node.family != "factory" and any(src in from_data for src, _ in node.args):
            from_data.add(name)  # (a factory reads only the shape of what it is given)
            if node.as_produced:  # an in-place write (or view written through) follows its tensor
                continue
            data_args = () if gathers else tuple(k for k, (src, _) in enumerate(node.args) if src in from_data)
            pin = Pin(split=True, split_inputs=data_args, reason=f"{why} (computed from the {what.split()[0]})")
            if any(pin.admits(s, axis) for s in node.strategies):
                pins[name] = pin
            else:  # it gathers its input: what it makes is whole (a where's indices), and its readers are free
                from_data.discard(name)
    return pins


BATCHED_MATMULS = (aten.bmm.default, aten.matmul.default, aten.einsum.default)


def expert_parameters(graph: PlanGraph) -> frozenset[str]:
    """Parameters used only as an operand of batched matmuls whose batch dim is the parameter's
    dim 0: stacked expert weights ``(experts, in, out)`` run on ``(experts, tokens, in)`` slots,
    or as the expert weights of a whole dropless expert layer (``capture.moe``).

    On an expert axis (``expert_axes``) these are not pinned replicated, so the planner may
    split them by expert (``Shard(0)``) while the batch stays split: the slots then travel from
    their sequence's rank to their expert's rank by an all-to-all (a batch split turning into an
    expert split), which the planner prices against running every expert on every rank. Any
    other parameter, used even once elsewhere, is a dense weight and stays replicated."""
    consumers = graph.consumers()
    found = set()
    for name in graph.order:
        node = graph.nodes[name]
        uses = consumers[name]
        if node.kind == PARAM and uses and all(_batch_operand(graph.nodes[c].call, k) for c, k, _ in uses):
            found.add(name)
    return frozenset(found)


def _batch_operand(call: OpCall | None, arg: int) -> bool:
    """Tensor input ``arg`` of ``call`` is a batched matmul operand whose dim 0 is the batch dim,
    shared with the other operand and kept in the output, or a stacked expert weight of a whole
    expert layer (``autopar::moe_experts``: ``gate_up``, ``down``)."""
    if call is not None and is_moe(call.target):
        return arg in (3, 4)
    if call is None or call.target not in BATCHED_MATMULS:
        return False
    operands = call.tensor_inputs
    if call.target is aten.bmm.default:
        return True
    if call.target is aten.matmul.default:
        return operands[0].ndim > 2 and operands[1].ndim > 2 and operands[0].shape[:-2] == operands[1].shape[:-2]
    equation = call.args[0].replace(" ", "")
    if "->" not in equation or "." in equation:
        return False
    lhs, out = equation.split("->")
    labels = lhs.split(",")
    first = labels[arg][:1]
    return bool(first) and first in out and any(first in other for k, other in enumerate(labels) if k != arg)


def _first_input(graph: PlanGraph, user_inputs: list[str]) -> TensorMeta | None:
    for name in user_inputs:
        meta = graph.nodes[name].outputs[0] if name in graph.nodes else None
        if meta is not None and meta.ndim >= 1:
            return meta
    return None


def _batch_size(graph: PlanGraph, user_inputs: list[str]) -> int | None:
    """The batch: the leading dim of the first input that has one. Inputs without that
    leading dim (a bias vector, a scalar) are not data to split; they stay free."""
    first = _first_input(graph, user_inputs)
    return None if first is None else first.shape[0]


def placement_pins(graph: PlanGraph, placements: dict[str, tuple[Placement, ...]], axis: int, why: str
                   ) -> dict[str, Pin]:
    """Every parameter and buffer ``placements`` names (by FQN) pinned to its placement on mesh
    dim ``axis``: another step's plan, so that two programs run on one copy of the state (a
    serving deployment's prefill and decode steps, ``runtime.serving``). Exact placements, a
    strided shard only where the other plan has one: both programs read the same local shard."""
    pins: dict[str, Pin] = {}
    for name in graph.order:
        node = graph.nodes[name]
        if node.kind in (PARAM, BUFFER) and (node.fqn or name) in placements:
            pins[name] = Pin(output=placements[node.fqn or name][axis], reason=f"{why} ({node.fqn or name})")
    return pins


def zero_pins(graph: PlanGraph, axis: int, axis_name: str, stage: int, axis_size: int
              ) -> tuple[dict[str, Pin], list[str]]:
    """A ZeRO stage pinned on a data axis: every parameter replicated there (stage 0, DDP;
    stage 1, whose optimizer state is then sharded: ``autopar.cost.zero1``), or stored split there (2 and 3: a shard of any dim, strided over another axis's split
    included, as FSDP on top of TP). Returns the pins and the parameters no dim of which
    divides by the axis, which stay replicated (as FSDP would pad them; the plan notes them).
    Frozen parameters are sharded too: they keep weights only, which sharding still shrinks."""
    pins: dict[str, Pin] = {}
    unsplittable: list[str] = []
    for name in graph.order:
        node = graph.nodes[name]
        if node.kind != PARAM:
            continue
        if stage in (0, 1):
            pins[name] = Pin(output=Replicate(), reason=f"ZeRO-{stage}{' (DDP)' * (stage == 0)} on {axis_name}")
            continue
        pin = Pin(split=True, reason=f"ZeRO-{stage} on {axis_name}")
        if axis_size > 1 and any(pin.admits(s, axis) for s in node.strategies):
            pins[name] = pin
        elif axis_size > 1:
            unsplittable.append(node.fqn or name)
    return pins, unsplittable
