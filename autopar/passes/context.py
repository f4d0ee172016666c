"""What every pass reads: the plan's chosen strategy per node and the mesh shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx

from autopar.cost.model import CostContext
from autopar.rules.strategy import Strategy
from autopar.problem.shared import module_path
from autopar.memory.options import MemoryPlan
from autopar.problem.nodes import PlanGraph

STRATEGY = "autopar.strategy"
"""node.meta key: the Strategy the plan chose for this node."""
PLAN_NAME = "autopar.plan_name"
"""node.meta key: the node's name in the plan (survives nodes being replaced)."""


@dataclass(frozen=True, kw_only=True)
class PassContext:
    graph: PlanGraph
    """The planning graph (producers of each tensor input, node kinds)."""
    chosen: dict[str, Strategy]
    """Node name -> chosen strategy."""
    ctx: CostContext
    """Mesh, precision, train."""
    sync_dims: dict[str, frozenset[int]]
    """Parameter node -> mesh dims its gradient is all-reduced over after backward."""
    input_sharded: bool = False
    """Inputs arrive already split as planned (else every rank passes the whole batch)."""
    device_type: str = "cpu"
    """Device the rank's tensors live on ("cpu", "cuda")."""
    regather: frozenset[str] = frozenset()
    """FQNs of the parameters whose gathers run as ``self.regather`` (ZeRO-3: the plan's
    ``memory.regather``)."""
    memory: MemoryPlan | None = None
    """The plan's memory decisions (which blocks recompute in backward); None: none."""
    master_dtype: torch.dtype | None = None
    """Mixed precision: parameters arrive in this dtype (fp32 masters) and are cast to the
    dtype the step was captured in where used (``cast_parameters``); None: as captured."""

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.ctx.mesh.shape


def strategy_of(node: torch.fx.Node) -> Strategy | None:
    return node.meta.get(STRATEGY)


def plan_name(node: torch.fx.Node) -> str | None:
    return node.meta.get(PLAN_NAME)


def block_owners(graph: torch.fx.Graph, block_at: Callable[[str], str | None]) -> dict[torch.fx.Node, str]:
    """The block each node belongs to (nodes of none are absent): a captured node by its module
    path (``block_at(path)``), one a pass inserted by its users when they all belong to one block."""
    owner: dict[torch.fx.Node, str] = {}
    for node in reversed(graph.nodes):  # users first: inserted nodes inherit from them
        if node.op in ("placeholder", "output"):
            continue
        if "nn_module_stack" in node.meta:
            block = block_at(module_path(node))
        else:
            users = {owner.get(u) for u in node.users}
            block = users.pop() if len(users) == 1 else None
        if block is not None:
            owner[node] = block
    return owner
