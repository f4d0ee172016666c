"""The planning graph's data: every captured node the planner places, with its candidate
strategies and their costs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

from autopar.capture.graph import TensorMeta
from autopar.cost.model import NodeCost
from autopar.cost.saved import SavedTensors
from autopar.rules.strategy import DimStrategy, OpCall, Strategy

PARAM, BUFFER, INPUT, OP = "param", "buffer", "input", "op"
T = TypeVar("T")


class ProbeMemo:
    """``node_saved_tensors`` by op call and its arguments' ``needs_grad``: each layer of a deep
    model repeats the same calls, and pricing asks again per edge. Probes keyed by call read
    the call alone, so graphs may share them (``by_call``); a call that does not hash is kept by
    node name, for one graph only."""

    def __init__(self, by_call: dict[Hashable, SavedTensors | None] | None = None) -> None:
        self.by_call: dict[Hashable, SavedTensors | None] = {} if by_call is None else by_call
        self.by_node: dict[Hashable, SavedTensors | None] = {}


class ObjectMemo:
    """Values made once per object that is not hashed cheaply or by value (a folding, a strategy list, a
    tuple of DTensor placements, a price matrix), found by the object itself."""

    def __init__(self) -> None:
        self.by_owner: dict[tuple[Hashable, int], tuple[object, object]] = {}
        """(what, ``id`` of the object it is made for) -> (that object, what it is); the entry keeps the object,
        so its ``id`` names no other while it is there."""

    def kept(self, what: Hashable, owner: object, make: Callable[[], T]) -> T:
        """``make()``, the ``what`` of ``owner``, made once per such object."""
        key = (what, id(owner))
        found = self.by_owner.get(key)
        if found is None or found[0] is not owner:
            found = self.by_owner[key] = (owner, make())
        return found[1]  # type: ignore[return-value]


class EdgeMemo(ObjectMemo):
    """What a graph's edges alone decide (its order and each node's args), computed once for the graph
    and its copies: a scenario's copy reprices nodes (``dataclasses.replace`` on the graph and its nodes,
    ``PlanGraph.edges`` carried over) and keeps every edge, and a memory search builds hundreds of models
    of such copies. ``kept`` holds what a folding or a node's strategy list gives of them."""

    def __init__(self) -> None:
        super().__init__()
        self.consumers: dict[str, list[tuple[str, int, int]]] | None = None


@dataclass
class PlanNode:
    """One FX node the planner places."""

    name: str
    kind: str
    """'param', 'buffer', 'input' or 'op'."""
    op: str
    """Printable target ('aten.linear.default', 'parameter', ...)."""
    module: str
    """Module path the node belongs to ('layers.0.attention.wq'); '' at top level."""
    call: OpCall | None
    outputs: tuple[TensorMeta | None, ...]
    args: list[tuple[str, int]]
    """Producer (node name, output index) of each tensor input, in ``call.tensor_inputs`` order."""
    needs_grad: bool
    strategies: list[Strategy] = field(default_factory=list)
    dim_strategies: list[DimStrategy] = field(default_factory=list)
    """The rule's single-mesh-dim strategies ``strategies`` expand (empty for leaves)."""
    costs: list[NodeCost] = field(default_factory=list)
    family: str | None = None
    """The rule family of an op ('matmul', 'factory', ...); None without a rule."""
    fallback: str | None = None
    """Why only the all-Replicate strategy was offered (no rule for the op, or its rule does
    not handle this call); None when a rule handled it."""
    comm_times: list[float] = field(default_factory=list)
    """Seconds of collectives a strategy runs by itself (the loss's reductions), if any."""
    follower: bool = False
    """A view or elementwise op of one tensor: it takes its input placement as produced."""
    targets_input: str | None = None
    """For a loss: the user input its targets are a view of, if any (counted whole when
    every rank receives the whole batch)."""
    loss_root: bool = False
    """The op whose value the step returns as its loss (``problem.loss_collectives.mark_loss_root``)."""
    fqn: str | None = None
    frozen: bool = False
    """A parameter with ``requires_grad=False``: no gradient, no sync, no optimizer state."""
    saved: bool = True
    """Backward keeps something of this op (priced as activation memory)."""
    kept: SavedTensors | None = None
    """Which outputs backward keeps and what the op keeps inside (``saved_activations``);
    None: every output (before gradients are settled)."""
    grad_sums: tuple[int, ...] = ()
    """Per tensor input (as ``args``), 1 where autograd adds the gradient this op sends back for it to
    those of the value's earlier readers (a value read by several ops, or twice by one); empty: none
    (``problem.gradients.gradient_sums``)."""
    as_produced: frozenset[int] = frozenset()
    """Tensor inputs (indices into ``args``) that must arrive exactly as produced, never
    resharded: the op writes into them in place, or they are the base of a view that some
    op writes through (``capture.aliasing``)."""
    read_versions: tuple[int, ...] = ()
    """Per tensor input, how many in-place writes into its storage came before this read
    (empty: none). Reads of different versions cannot share one reshard."""
    written_before: tuple[tuple[str, ...], ...] = ()
    """Per tensor input, the in-place writes into its storage before this read (empty: none):
    a gradient this op sends that input reaches the values they wrote."""
    differentiable: bool = True
    """Backward sends gradients to its inputs (not a factory, ``detach`` or random draw, whose
    output, written in place, may still need a gradient of its own)."""

    block: str | None = None
    """The checkpointed block (module path) this op recomputes in, if any."""
    recompute_memory: list[float] = field(default_factory=list)
    """Per strategy, bytes of this op's outputs that a checkpointed block drops after forward
    and brings back while recomputing in backward (empty: nothing recomputed)."""
    replayed: bool = False
    """In a checkpointed block, its replay runs this op again (its policy does not keep its output)."""
    regather: bool = False
    """A parameter this op saves for backward, gathered for it on a data axis, is freed after
    forward and gathered again in backward (ZeRO-3, FSDP's ``reshard_after_forward``), not
    held (``autopar.memory.regather``)."""

    @property
    def recompute(self) -> bool:
        """In a checkpointed block: its forward (and its inputs' forward reshards) run again in backward."""
        return self.block is not None

    def version(self, arg: int) -> int:
        return self.read_versions[arg] if self.read_versions else 0


@dataclass
class PlanGraph:
    nodes: dict[str, PlanNode]
    order: list[str]
    loss: str | None
    """Name of the node holding the scalar loss (training steps)."""
    output_names: list[str]
    saved_probes: ProbeMemo = field(default_factory=lambda: ProbeMemo(), repr=False, compare=False)
    """Memo of ``node_saved_tensors`` by op call (or node) and its arguments' ``needs_grad``
    (``saved_activations.cached_probe``; pricing asks once per edge and candidate strategy:
    tens of thousands of times on a 64-device mesh)."""
    edges: EdgeMemo = field(default_factory=EdgeMemo, repr=False, compare=False)
    """What its edges decide (``EdgeMemo``), shared by its copies with other prices: a graph of other edges
    is made anew (``build_plan_graph``), never by ``replace``."""

    def sends_gradient(self, producer: str, consumer: str) -> bool:
        """True when backward sends a gradient from ``consumer`` to ``producer``: both need one
        (not into a ``torch.no_grad()`` block, a ``detach`` or a comparison)."""
        into = self.nodes[consumer]
        return self.nodes[producer].needs_grad and into.needs_grad and into.differentiable

    @functools.cached_property
    def read_once(self) -> frozenset[str]:
        """Parameters read by exactly one op input: their gathers and gradient reduce-scatters may
        join their block's (``cost.groups``); one read twice sums two gradients first, and may share
        a reshard between its readers. Computed once per graph (its copies by ``replace`` keep the
        same reads, and compute it again)."""
        uses: dict[str, int] = {}
        for name in self.order:
            for src, _ in self.nodes[name].args:
                uses[src] = uses.get(src, 0) + 1
        return frozenset(p for p, n in uses.items() if n == 1 and self.nodes[p].kind == PARAM)

    def consumers(self) -> dict[str, list[tuple[str, int, int]]]:
        """node -> [(consumer, consumer arg index, producer output index)]; made once for the graph and
        its copies (``edges``), not to be changed."""
        if self.edges.consumers is None:
            out: dict[str, list[tuple[str, int, int]]] = {n: [] for n in self.order}
            for name in self.order:
                for k, (src, idx) in enumerate(self.nodes[name].args):
                    out[src].append((name, k, idx))
            self.edges.consumers = out
        return self.edges.consumers
