"""Which activations a training step holds from forward to backward: the tensors autograd
saves, each storage once.

An op's output is held when the op's own backward keeps it (``log_softmax``, SDPA) or when
some consumer's backward keeps it, directly or through views (a linear keeps its input, SDPA
keeps q, k and v, views of one fused projection); besides, an op may keep tensors it makes
inside (a composite loss its ``log_softmax``, ``rms_norm`` its normalized input). Outputs
nothing keeps (a residual ``add``'s, a logits tensor a loss reads) die in forward: the plan
does not count them (``autopar.cost.saved`` probes autograd for each op). Only ops a
gradient reaches run a backward and keep anything (``settle_gradients``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from autopar.capture.aliasing import writes_first_arg
from autopar.capture.graph import TensorMeta
from autopar.cost.compute import VIEW_OPS
from autopar.cost.saved import SavedTensors, saved_tensors
from autopar.rules.strategy import call_key
from autopar.problem.nodes import OP, PlanNode, ProbeMemo

def node_saved_tensors(node: PlanNode, nodes: dict[str, PlanNode]) -> SavedTensors | None:
    """The probe of one op node (``cost.saved.saved_tensors``); None where it cannot tell
    (a subgraph call, arguments it cannot lay out)."""
    call = node.call
    if call is None or node.kind != OP or call.target is operator.getitem \
            or isinstance(call.target, torch._ops.HigherOrderOperator):
        return None

    def meta(a: Any) -> Any:
        return torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, TensorMeta) else a
    needs_grad = [nodes[src].needs_grad for src, _ in node.args]
    try:
        return saved_tensors(call.target, tree_map_only(TensorMeta, meta, call.args),
                             tree_map_only(TensorMeta, meta, call.kwargs), needs_grad)
    except (ValueError, IndexError, TypeError):
        return None


def cached_probe(node: PlanNode, nodes: dict[str, PlanNode], memo: ProbeMemo) -> SavedTensors | None:
    """``node_saved_tensors`` through ``memo`` (keyed by the call when it hashes, else the node)."""
    needs_grad = tuple(nodes[src].needs_grad for src, _ in node.args)
    call = call_key(node.call) if node.call is not None else None
    found = memo.by_node if call is None else memo.by_call
    key = (node.name if call is None else call, needs_grad)
    if key not in found:
        found[key] = node_saved_tensors(node, nodes)
    return found[key]


def saved_activations(nodes: dict[str, PlanNode], order: list[str], receives: set[str], memo: ProbeMemo
                      ) -> dict[str, SavedTensors]:
    """For each op node: which of its outputs backward keeps (its own or a consumer's saving,
    through views and in-place writes to the storage's owner) and what it keeps inside.
    ``receives``: the nodes a gradient reaches (their backward runs); ``memo``: probes so far."""
    kept = {name: [False] * len(nodes[name].outputs) for name in order}
    internal: dict[str, int] = {}
    for name in order:
        node = nodes[name]
        if name not in receives or node.kind != OP:
            continue
        probe = cached_probe(node, nodes, memo)
        if probe is None:
            if node.call is not None and node.call.target is operator.getitem:
                continue  # picks an output: keeps nothing itself
            probe = SavedTensors(tuple(True for _ in node.args), tuple(True for _ in node.outputs), 0)
        for (src, index), saved in zip(node.args, probe.inputs):
            if saved and index < len(kept[src]):
                kept[src][index] = True
        for index, saved in enumerate(probe.outputs[:len(kept[name])]):
            kept[name][index] = kept[name][index] or saved
        internal[name] = probe.internal_bytes
    for name in reversed(order):  # a view (or in-place result) kept keeps its input's storage
        node = nodes[name]
        if node.kind == OP and node.call is not None and node.args and any(kept[name]) \
                and (node.call.target in VIEW_OPS or writes_first_arg(node.call.target)):
            src, index = node.args[0]
            if index < len(kept[src]):
                kept[src][index] = True
    return {name: SavedTensors((), tuple(kept[name]), internal.get(name, 0))
            for name in order if nodes[name].kind == OP}
