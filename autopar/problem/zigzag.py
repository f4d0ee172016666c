"""Which context axes cut the sequence zig-zag (``Mesh.zigzag``), and the pins that keeps sound.

Split on its query rows in contiguous chunks, a causal attention leaves the rank holding the
first rows with little to do and the one holding the last rows with its whole rows x keys
rectangle; the step waits for that one. Zig-zag chunks (2n of them, rank i holding chunks i
and 2n-1-i, as Megatron-LM, TransformerEngine and torch's context_parallel cut) give every
rank the same work (``rules.attention.busiest_pairs``). The layout is the axis's, for every
tensor split on it: slices, gathers and the collectives that move chunks follow it
(``runtime.ops.Comm``), so inputs, targets, position tables and masks split on the sequence
line up with each other, and what is gathered (keys and values, outputs) comes back in order.

An axis is zig-zag when it is a context axis of more than one rank, the step has a causal
attention and every attention call is causal or unmasked (non-causal, no mask: the same
work for every row, so nothing to balance and nothing that a cut could unbalance; an explicit
mask may be any pattern, whose balance nothing here knows), and the first input's sequence
divides into 2n chunks on each such axis. Such a layout is a candidate, not a choice: every
dim split on a zig-zag axis must divide into 2n chunks, which can take away a split the
contiguous layout allows (a batch of n sequences, or grouped-query keys with 8 heads on 8
ranks: the heads split behind all-to-alls, balanced and often the cheaper context
parallelism), so the step is planned both ways and the faster plan kept (``search.context``;
ties stay contiguous). Not where ZeRO-2/3 stores parameters split on the
axis: state is cut in contiguous chunks where it is stored (``runtime.parameters``), so
parameters and buffers stay replicated on a zig-zag axis (``state_pins``).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate

from autopar.capture.graph import CapturedGraph
from autopar.mesh import Mesh
from autopar.rules.attention import ATTENTION_OPS
from autopar.rules.strategy import schema_arg
from autopar.problem.constraints import Pin
from autopar.problem.nodes import BUFFER, PlanGraph


def _attention_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATTENTION_OPS]


def balances_causal(gm: torch.fx.GraphModule) -> bool:
    """The graph has a causal attention, and every attention call is causal or unmasked."""
    calls = _attention_calls(gm)
    causal = [bool(schema_arg(n.target, n.args, n.kwargs, "is_causal", False)) for n in calls]
    masked = [schema_arg(n.target, n.args, n.kwargs, "attn_mask", None) is not None for n in calls]
    return any(causal) and all(c or not m for c, m in zip(causal, masked))


def zigzag_axes(captured: CapturedGraph, mesh: Mesh, context_axes: tuple[str, ...], zero: dict[str, int]
                ) -> tuple[tuple[str, ...], str]:
    """The context axes whose shards may be zig-zag (module docstring), and why none may ("" when some)."""
    axes = tuple(a for a in context_axes if mesh.axes[a] > 1 and zero.get(a, 0) < 2)
    if not axes:
        return (), "no context axis of more than one rank without ZeRO-2/3 on it"
    if not balances_causal(captured.gm):
        return (), "zig-zag balances causal attention: the step has none, or an attention with an explicit mask"
    first = next((n for n in captured.gm.graph.nodes if n.name in captured.user_inputs), None)
    value = None if first is None else first.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.ndim < 2:
        return (), "the first input has no sequence dim"
    chunks = math.prod(2 * n if a in axes else n for a, n in mesh.axes.items() if a in context_axes)
    if value.shape[1] % chunks:
        return (), f"the sequence ({value.shape[1]}) does not divide into {chunks} zig-zag chunks"
    return axes, ""


def state_pins(graph: PlanGraph, axis_name: str) -> dict[str, Pin]:
    """Buffers (and constants) replicated on a zig-zag axis, as the context axis's pins keep
    parameters (module docstring)."""
    why = f"zig-zag context parallel on {axis_name} (state is stored in contiguous chunks)"
    return {name: Pin(output=Replicate(), reason=why) for name, node in graph.nodes.items() if node.kind == BUFFER}
