"""Which kind of context-parallel attention a strategy runs on each mesh dim, and pinning one.

Attention over a sequence split on a mesh dim runs in one of three ways, each a strategy of the
attention rule (``rules.attention``) the solver may choose per call: queries split on their
sequence with keys and values all-gathered ("allgather"); queries, keys and values all split
on it, keys and values passed around the ring ("ring", ``runtime.ring``); or heads split on an
axis the activations are split on by sequence (Ulysses: all-to-alls around attention).
``context_attention`` pins one: "ring" or "allgather" keeps, at every attention call whose
queries may split on their sequence, only strategies of that kind, and at every call none that
splits heads on a context axis (that would be Ulysses); "ulysses" keeps only those that split no
call's queries on their sequence (the sequence-split activations then reach attention through
all-to-alls to a heads split, or gathered, whichever is cheaper).
"""

from __future__ import annotations

from autopar.errors import InputError
from autopar.mesh import Mesh
from autopar.rules.attention import ATTENTION_OPS
from autopar.rules.strategy import Strategy, shard_dim
from autopar.problem.nodes import PlanGraph, PlanNode

KINDS = ("ring", "allgather", "ulysses")


def sequence_kind(strategy: Strategy, q_ndim: int, k_ndim: int, mesh_dim: int) -> str | None:
    """"ring" or "allgather" where ``strategy`` splits the queries on their sequence on
    ``mesh_dim``, else None."""
    if shard_dim(strategy.inputs[0][mesh_dim]) != q_ndim - 2:
        return None
    return "ring" if shard_dim(strategy.inputs[1][mesh_dim]) == k_ndim - 2 else "allgather"


def pin_context_attention(graph: PlanGraph, kind: str | None, mesh: Mesh, context_axes: tuple[str, ...] = ()
                          ) -> None:
    """Keep, at each attention call, only the strategies whose sequence splits are of ``kind``
    (None: every strategy the runtime runs on the mesh's hardware), and for "ring" or "allgather"
    none splitting heads on ``context_axes``. Refused where a call would keep none."""
    hardware = mesh.hardware
    if kind not in (None, *KINDS):
        raise InputError(f"context_attention is 'ring', 'allgather', 'ulysses' or None (the solver's choice), "
                         f"got {kind!r}")
    if kind == "ring" and not hardware.ring_attention:
        raise InputError(f"context_attention='ring': autopar runs ring attention on CPU meshes only so far "
                         f"(runtime.ring), not on {hardware.name}")
    # a plan must run: no ring where the runtime has no kernel for it
    runs = {"ring", "allgather"} if hardware.ring_attention else {"allgather"}
    allowed = runs if kind is None else set() if kind == "ulysses" else {kind}
    for name in graph.order:
        node = graph.nodes[name]
        if node.call is None or node.call.target not in ATTENTION_OPS or len(node.call.tensor_inputs) < 3:
            continue
        q, k = node.call.tensor_inputs[0].ndim, node.call.tensor_inputs[1].ndim
        kinds = [{sequence_kind(s, q, k, d) for d in range(len(s.inputs[0]))} - {None} for s in node.strategies]
        if kind in ("ring", "allgather") and any(kinds) and not any(kind in found for found in kinds):
            raise InputError(f"context_attention={kind!r}: attention call {name} has no strategy of that kind "
                             "(ring attention needs self-attention without dropout, rules.attention)")
        keep = [i for i, found in enumerate(kinds) if found <= allowed
                and not (kind in ("ring", "allgather") and _heads_split(node.strategies[i], q, mesh, context_axes))]
        if kind == "ulysses" and node.strategies and not keep:  # else the solver fails on an empty choice
            raise InputError(f"context_attention='ulysses': attention call {name} has no strategy splitting its heads "
                             "on the context axes, and its output must stay split there: its heads and key/value "
                             "heads must divide by the ranks (into 2n chunks on a zig-zag axis)")
        _keep(node, keep)


def _heads_split(strategy: Strategy, q_ndim: int, mesh: Mesh, context_axes: tuple[str, ...]) -> bool:
    """Whether ``strategy`` splits the queries' heads (4-D calls) on a context axis: Ulysses there."""
    return q_ndim >= 4 and any(shard_dim(strategy.inputs[0][mesh.names.index(a)]) == q_ndim - 3
                               for a in context_axes if mesh.axes[a] > 1)


def _keep(node: PlanNode, keep: list[int]) -> None:
    node.strategies = [node.strategies[i] for i in keep]
    node.costs = [node.costs[i] for i in keep]
    if node.comm_times:
        node.comm_times = [node.comm_times[i] for i in keep]
