"""What capture hands to the later stages: an aten graph with shapes and names."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autopar.errors import CaptureError
from autopar.capture.step import StepSignature


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor in the graph (all the planner needs of a FakeTensor)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    ragged: frozenset[int] = frozenset()
    """Dims whose size the data decides (torch.export's unbacked sizes, planned at their hint in
    ``shape``): never split, a rank's share of them is no contiguous shard (``capture.unbacked``)."""

    @functools.cached_property
    def numel(self) -> int:  # cached: pricing asks for it per placement pair
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @classmethod
    def of(cls, value: object, hints: "dict[sympy.Symbol, int] | None" = None) -> "TensorMeta | None":
        """``value``'s meta; a symbolic size is its value at ``hints`` (``CapturedGraph.size_hints``)."""
        if not isinstance(value, torch.Tensor):
            return None
        if not any(isinstance(s, torch.SymInt) for s in value.shape):
            return cls(tuple(int(s) for s in value.shape), value.dtype)
        shape: list[int] = []
        ragged: set[int] = set()
        for d, s in enumerate(value.shape):
            if isinstance(s, torch.SymInt) and free_unbacked_symbols(s):
                shape.append(hinted(s, hints or {}))
                ragged.add(d)
            else:
                shape.append(hinted(s, hints or {}) if isinstance(s, torch.SymInt) else int(s))
        return cls(tuple(shape), value.dtype, frozenset(ragged))


def hinted(size: torch.SymInt, hints: "dict[sympy.Symbol, int]") -> int:
    """``size`` at the sizes ``hints`` give its symbols: an unbacked one's planning size, or the
    micro-batch size a symbolic capture is priced at (``capture.symbolic``). A backed size whose
    symbols have no hint is its size on the example inputs (torch's own hint)."""
    free = size.node.expr.free_symbols
    if not free_unbacked_symbols(size) and not free & hints.keys():
        return int(size)
    expr = sympy.sympify(size.node.expr).xreplace({k: sympy.Integer(v) for k, v in hints.items()})
    if not expr.is_number:
        kind = "data-dependent size" if free_unbacked_symbols(size) else "size"
        raise CaptureError(f"{kind} {size.node.expr} has no planning size (capture.unbacked and capture.symbolic "
                           f"hints for {sorted(map(str, hints))})")
    return int(expr)


@dataclass
class CapturedGraph:
    """An exported training (or forward) step.

    ``gm`` is an aten-level FX graph (torch.export's training IR: ``aten.linear``,
    ``aten.layer_norm``, ``aten.scaled_dot_product_attention`` kept whole). Every node
    that produces tensors has ``node.meta["val"]`` (FakeTensor) and, for ops,
    ``node.meta["nn_module_stack"]``.
    """

    gm: torch.fx.GraphModule
    parameters: dict[str, str]
    """Placeholder name -> parameter FQN in the user's model."""
    buffers: dict[str, str]
    """Placeholder name -> buffer or constant FQN in the user's model."""
    user_inputs: list[str]
    """Placeholder names of the step's inputs: model args, kwargs, then loss targets."""
    train: bool
    """True when the graph ends in the scalar loss and a backward pass will follow."""
    signature: StepSignature
    """How the step is called (positional inputs, keyword inputs, targets); one user-input
    placeholder per leaf of its values, in order."""
    capture_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    """Alias FQN -> FQN of the parameter (or buffer) it is the same tensor as, e.g.
    ``{"lm_head.weight": "transformer.wte.weight"}``; an alias has no placeholder of its own."""
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    """Placeholder name -> value of tensors the model creates inside forward (lifted by export)."""
    size_hints: dict[sympy.Symbol, int] = field(default_factory=dict)
    """Unbacked (data-dependent) size symbol -> the size planning prices it at: its size when the
    graph ran on the example inputs (``capture.unbacked``). The graph itself keeps them symbolic.
    A symbolic capture's micro-batch symbol -> the micro-batch size it is priced at."""
    batch_symbol: sympy.Symbol | None = None
    """The micro-batch size's symbol in a step captured symbolic (``capture.symbolic``): its graph is
    priced, never run; None for a concrete capture."""
    trained: frozenset[str] | None = field(default=None, repr=False, compare=False)
    """FQNs of the parameters autograd gives a gradient, once asked (``runtime.gradient_check``)."""

    def nodes(self) -> list[torch.fx.Node]:
        return list(self.gm.graph.nodes)
