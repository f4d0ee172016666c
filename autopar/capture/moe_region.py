"""Recognise Hugging Face's sorted dropless expert region in a captured graph and replace it by
one ``autopar::moe_experts`` call (``capture.moe``), before planning: the planner must see the
region as one op to choose expert parallelism for it.

The region (``transformers.integrations.moe.grouped_mm_experts_forward``, Mixtral's SwiGLU
experts, no bias, weights not transposed), as torch.export captures it::

    ids_flat = reshape(ids, [-1]); w_flat = reshape(weights, [-1])
    sorted_ids, perm = sort(ids_flat)
    rows = index(x, [floor_divide(perm, k)]);  w_sorted = index(w_flat, [perm])
    offs = cumsum(histc(to(sorted_ids, float), E, 0, E - 1), 0, dtype=int32)
    gate, up = chunk(grouped_mm(to(rows), transpose(gate_up, -2, -1), offs), 2, -1)
    out = grouped_mm(to(mul(silu(gate), up)), transpose(down, -2, -1), offs)
    inv = index_put_(empty_like(perm), [perm], arange(n))
    y = sum(view(index(mul(out, unsqueeze(w_sorted, -1)), [inv]), [T, k, H]), [1])   (then to(dtype))

Every ``to`` inside must be a no-op (same dtype), and the output must come back in the tokens'
dtype (the op's last cast): a region that casts otherwise is left as captured. Only the
nodes listed are replaced, and only when nothing outside the region reads any of them; anything
else (another activation, biases, a post-expert norm) leaves the region as captured, where the
per-op rules plan it (its tokens gathered on a data axis: correct, without expert parallelism).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from autopar.capture.moe import MOE_EXPERTS

aten = torch.ops.aten
_SORTS = (aten.sort.default, aten.sort.stable)
_GROUPED_MM = ("transformers::grouped_mm_fallback", "aten::_grouped_mm")


class _NoMatch(Exception):
    """The region differs from the form above (it is then left as captured)."""


def _op(node: Any, *targets: Any) -> torch.fx.Node:
    """``node`` when it is a call of one of ``targets``, else no match."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in targets:
        raise _NoMatch
    return node


def _uncast(node: Any) -> torch.fx.Node:
    """The tensor under a chain of no-op ``to(dtype)`` casts."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.to.dtype:
        source = node.args[0]
        if source.meta["val"].dtype != node.meta["val"].dtype:
            raise _NoMatch  # a real cast: the op would compute in another dtype
        node = source
    if not isinstance(node, torch.fx.Node):
        raise _NoMatch
    return node


def _only_user(node: torch.fx.Node, *targets: Any) -> torch.fx.Node:
    users = list(node.users)
    if len(users) != 1:
        raise _NoMatch
    return _op(users[0], *targets)


def _getitem(node: torch.fx.Node, index: int) -> torch.fx.Node:
    found = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
    if len(found) != 1:
        raise _NoMatch
    return found[0]


def _grouped_mm_name(node: torch.fx.Node) -> str:
    target = node.target
    name = target.name() if isinstance(target, torch._ops.OpOverload) else ""
    if name not in _GROUPED_MM or len(node.args) != 3 or node.kwargs:
        raise _NoMatch
    return name


def _weight(transposed: Any) -> torch.fx.Node:
    """The stacked expert weight a grouped matmul reads as ``transpose(w, -2, -1)``."""
    node = _op(transposed, aten.transpose.int)
    if sorted(d % 3 for d in node.args[1:]) != [1, 2] or node.args[0].meta["val"].ndim != 3:
        raise _NoMatch
    return node.args[0]


@dataclass
class _Dispatch:
    """The routing half of a region: what sorting the pairs made."""

    x: torch.fx.Node
    ids: torch.fx.Node
    weights: torch.fx.Node
    rows: torch.fx.Node
    w_sorted: torch.fx.Node
    inverse: torch.fx.Node
    offs: torch.fx.Node
    experts: int
    made: tuple[torch.fx.Node, ...]
    """Nodes that only feed the inverse permutation (``empty_like``, ``arange``)."""


def _dispatch(sort: torch.fx.Node) -> _Dispatch:
    """The sort of the flat expert ids, the gathers it keys and the group offsets; no match otherwise."""
    ids = _op(sort.args[0], aten.reshape.default, aten.view.default).args[0]
    if ids.meta["val"].ndim != 2 or ids.meta["val"].dtype.is_floating_point:
        raise _NoMatch
    tokens, k = ids.meta["val"].shape
    sorted_ids, perm = _getitem(sort, 0), _getitem(sort, 1)
    by_target = {u.target: u for u in perm.users}
    if len(by_target) != len(perm.users):
        raise _NoMatch
    pair_token = _op(by_target.get(aten.floor_divide.default), aten.floor_divide.default)
    if pair_token.args[1] != k:
        raise _NoMatch
    rows = _only_user(pair_token, aten.index.Tensor)
    w_sorted = _op(by_target.get(aten.index.Tensor), aten.index.Tensor)
    weights = _op(w_sorted.args[0], aten.reshape.default, aten.view.default).args[0]
    inverse = _op(by_target.get(aten.index_put_.default), aten.index_put_.default)
    made = (_op(inverse.args[0], aten.empty_like.default), _op(inverse.args[2], aten.arange.default))
    histc = _only_user(_only_user(sorted_ids, aten.to.dtype), aten.histc.default)
    x = rows.args[0]
    if weights.meta["val"].shape != (tokens, k) or x.meta["val"].shape[0] != tokens:
        raise _NoMatch
    return _Dispatch(x, ids, weights, rows, w_sorted, inverse, _only_user(histc, aten.cumsum.default),
                     histc.args[1], made)


def _experts(d: _Dispatch) -> tuple[str, torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """The SwiGLU of grouped matmuls on the sorted rows: (grouped matmul's name, gate_up, down,
    the down projection's node); no match otherwise."""
    if len(d.offs.users) != 2:
        raise _NoMatch
    up_mm, down_mm = sorted(d.offs.users, key=lambda n: n.meta["val"].shape[-1], reverse=True)
    name = _grouped_mm_name(up_mm)
    if _grouped_mm_name(down_mm) != name or _uncast(up_mm.args[0]) is not d.rows or up_mm.args[2] is not d.offs:
        raise _NoMatch
    gate_up, down = _weight(up_mm.args[1]), _weight(down_mm.args[1])
    if gate_up.meta["val"].shape[0] != d.experts or down.meta["val"].shape[0] != d.experts:
        raise _NoMatch
    chunk = _only_user(up_mm, aten.chunk.default)
    if tuple(chunk.args[1:]) not in ((2, -1), (2, 1)):
        raise _NoMatch
    gate, up = _getitem(chunk, 0), _getitem(chunk, 1)
    silu = _only_user(gate, aten.silu.default)
    glu = _only_user(silu, aten.mul.Tensor)
    if glu.args != (silu, up) or _uncast(down_mm.args[0]) is not glu or down_mm.args[2] is not d.offs:
        raise _NoMatch
    return name, gate_up, down, down_mm


def _combine(d: _Dispatch, down_mm: torch.fx.Node) -> torch.fx.Node:
    """The weighting, unsort and sum over choices after the experts: the region's output node."""
    weighted = _only_user(down_mm, aten.mul.Tensor)
    scale = _op(weighted.args[1], aten.unsqueeze.default)
    unsorted = _only_user(weighted, aten.index.Tensor)
    if scale.args[0] is not d.w_sorted or list(unsorted.args[1]) != [d.inverse]:
        raise _NoMatch
    summed = _only_user(_only_user(unsorted, aten.view.default, aten.reshape.default), aten.sum.dim_IntList)
    if list(summed.args[1]) != [1] or summed.meta["val"].shape != d.x.meta["val"].shape:
        raise _NoMatch
    out = summed  # then casts, back to the tokens' dtype (a bf16 model sums its fp32-weighted rows in fp32)
    while len(out.users) == 1 and next(iter(out.users)).target is aten.to.dtype:
        out = next(iter(out.users))
    if out.meta["val"].dtype != d.x.meta["val"].dtype:
        raise _NoMatch
    return out


def _match(sort: torch.fx.Node) -> tuple[tuple[torch.fx.Node, ...], str, torch.fx.Node, set[torch.fx.Node]]:
    """The region around ``sort``: (x, ids, weights, gate_up, down), the grouped matmul's name,
    the region's output node and its nodes; raises ``_NoMatch`` when it differs."""
    d = _dispatch(sort)
    name, gate_up, down, down_mm = _experts(d)
    out = _combine(d, down_mm)
    inputs = (d.x, d.ids, d.weights, gate_up, down)
    return inputs, name, out, _between(inputs, out) | set(d.made)


def _between(inputs: tuple[torch.fx.Node, ...], out: torch.fx.Node) -> set[torch.fx.Node]:
    """Nodes on a path from an input to ``out`` (the inputs themselves excluded)."""
    ancestors: set[torch.fx.Node] = set()
    stack = [out]
    while stack:
        node = stack.pop()
        if node in ancestors or node in inputs:
            continue
        ancestors.add(node)
        stack.extend(n for n in node.all_input_nodes)
    return {n for n in ancestors if n.op == "call_function"}


def collapse_moe_regions(gm: torch.fx.GraphModule) -> int:
    """Replace every recognised region by one ``autopar::moe_experts`` call; how many were."""
    count = 0
    for sort in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _SORTS]:
        try:
            inputs, name, out, region = _match(sort)
        except _NoMatch:
            continue
        if any(user not in region for node in region - {out} for user in node.users):
            continue  # a value inside is read elsewhere (the router's aux loss reads its own logits)
        with gm.graph.inserting_before(out):
            call = gm.graph.call_function(MOE_EXPERTS, (*inputs, name))
        call.meta.update({k: v for k, v in out.meta.items() if k in ("val", "nn_module_stack", "tensor_meta")})
        out.replace_all_uses_with(call)
        for node in reversed(list(gm.graph.nodes)):
            if node in region:
                gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
    return count
