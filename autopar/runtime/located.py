"""Where in a rank's program an error arose: the node, its module path and its placements,
told in the error raised instead (of the original's type, the original kept as its cause).

The program is generated Python (``torch.fx``): a frame of it in a forward error's traceback
is at the failing node's line (``GraphModule._lineno_map``, as ``torch._utils`` reads it).
Backward runs in torch's autograd engine, whose errors name only the failing autograd
function (``_RedistributeBackward returned an invalid gradient ...``). So every call of one of
the program's runtime ops (its submodules: reshards, gathers, recomputed regions, ...) marks
the autograd node of its output: a pre-hook notes that its backward began, a post-hook that
it ended; an error raised in backward is told with the last runtime op whose backward began
(or, when that one had ended, as raised after it). Aten ops between them are not marked: a
Python call per op would cost more than the step's bookkeeping should.
"""

from __future__ import annotations

import builtins
import sys
from types import CodeType, FrameType
from typing import Any

import torch
import torch.fx
from torch import nn

from autopar.passes.context import STRATEGY
from autopar.rules.strategy import placement_str
from autopar.problem.shared import module_path

_SPECIAL_CONSTRUCTORS = (UnicodeError, *(getattr(builtins, "BaseExceptionGroup", ()),))  # more than a message


def retold(exc: BaseException, note: str) -> BaseException:
    """``exc``'s message with ``note`` added, as an exception of ``exc``'s type where that type
    is made from a message alone (RuntimeError, ValueError, torch.OutOfMemoryError, autopar's
    errors, ...), else a RuntimeError; raise it ``from exc``."""
    kind = type(exc)
    python_made = [k for k in kind.__mro__ if k.__module__ != "builtins"]
    plain = not issubclass(kind, _SPECIAL_CONSTRUCTORS) and not any(
        "__init__" in vars(k) or "__new__" in vars(k) for k in python_made)
    message = f"{exc}\n  {note}"
    return kind(message) if plain else RuntimeError(f"{kind.__name__}: {message}")


class ProgramLocator:
    """Says which node of ``program`` (or of the regions it calls) an error arose in."""

    def __init__(self, program: torch.fx.GraphModule) -> None:
        self._program = program
        self._programs: dict[int, tuple[CodeType, torch.fx.GraphModule, list[torch.fx.Node]]] = {}
        """id of a forward's code -> that code (kept, so the id stays its own), its program or region,
        and that one's nodes in order. Keyed by id: hashing a code object hashes its bytecode and
        constants on every lookup (1.4 us for a 400-line program's), several per runtime-op call."""
        self._sites: dict[tuple[int, int], torch.fx.Node | None] = {}
        """(id of a program's code, bytecode offset) -> the node of that call site: a frame's line
        number is found by scanning its code's line table from the start, long in a long program."""
        self._last: tuple[torch.fx.Node, bool] | None = None  # the last runtime op of a backward: (node, ended)
        for child in program.children():
            if not isinstance(child, torch.fx.GraphModule):
                child.register_forward_hook(self._called)

    def forward(self, program: torch.fx.GraphModule, values: list[Any]) -> Any:
        """``program(*values)``, an error told with its node. Called as a module, not through fx's
        wrapper, which drops the traceback of an error raised on a line of the program."""
        try:
            return nn.Module.__call__(program, *values)
        except Exception as exc:  # noqa: BLE001 - raised again, told where
            told = self.forward_error(exc)
            if told is None:
                raise
            raise told from exc

    def backward(self, loss: torch.Tensor, seed: torch.Tensor) -> None:
        """``loss.backward(seed)``, an error told with the last runtime op whose backward began."""
        self._last = None
        try:
            loss.backward(seed)
        except Exception as exc:  # noqa: BLE001 - raised again, told where
            told = self.backward_error(exc)
            if told is None:
                raise
            raise told from exc

    def forward_error(self, exc: BaseException) -> BaseException | None:
        """``exc``, raised running the program forward, told with its node (None: raised outside it)."""
        frames = [tb.tb_frame for tb in _tracebacks(exc)]
        nodes = [n for n in map(self._node_of, frames) if n is not None]
        return retold(exc, f"(raised in forward at {describe(nodes[-1])})") if nodes else None

    def backward_error(self, exc: BaseException) -> BaseException | None:
        """``exc``, raised in backward, told with the last runtime op whose backward began (None:
        none began in this backward)."""
        if self._last is None:
            return None
        node, ended = self._last
        where = f"after the backward of {describe(node)}" if ended else f"in the backward of {describe(node)}"
        return retold(exc, f"(raised in backward, {where})")

    def _called(self, module: nn.Module, args: Any, output: Any) -> None:
        """A runtime op ran: mark the autograd nodes of its outputs with the program's node."""
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        grad_fns = {t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        if not grad_fns:
            return
        node = self._calling_node(sys._getframe(1))
        if node is None:
            return
        for grad_fn in grad_fns:
            grad_fn.register_prehook(lambda grads, node=node: self._note(node, False))
            grad_fn.register_hook(lambda inputs, grads, node=node: self._note(node, True))

    def _note(self, node: torch.fx.Node, ended: bool) -> None:
        self._last = (node, ended)

    def _calling_node(self, frame: FrameType | None) -> torch.fx.Node | None:
        """The node of the innermost program frame at or above ``frame``."""
        while frame is not None:
            node = self._node_of(frame)
            if node is not None:
                return node
            frame = frame.f_back
        return None

    def _node_of(self, frame: FrameType) -> torch.fx.Node | None:
        code = frame.f_code
        found = self._programs.get(id(code))
        if found is None and code.co_name == "forward":  # a program recompiled since: its new code
            self._programs = {id(c): (c, m, list(m.graph.nodes)) for m in self._program.modules()
                              if isinstance(m, torch.fx.GraphModule) for c in (type(m).forward.__code__,)}
            self._sites = {}  # the ids of codes no longer held may be reused
            found = self._programs.get(id(code))
        if found is None:
            return None
        site = (id(code), frame.f_lasti)
        if site not in self._sites:
            _, program, nodes = found
            index = program._lineno_map.get(frame.f_lineno - program._prologue_start)  # type: ignore[union-attr]
            self._sites[site] = nodes[index] if index is not None and index < len(nodes) else None
        return self._sites[site]


def _tracebacks(exc: BaseException) -> list[Any]:
    """``exc``'s traceback entries, outermost first."""
    out = []
    tb = exc.__traceback__
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def describe(node: torch.fx.Node) -> str:
    """A node as the program's code writes it, with its placements and its model module."""
    args = ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in node.args)
    target = f"self.{node.target}" if node.op == "call_module" else str(node.target)
    text = f"node {node.name} = {target}({args})"
    strategy = node.meta.get(STRATEGY)
    if strategy is not None:
        inputs = ", ".join(placement_str(p) for p in strategy.inputs)
        text += f", placed {' '.join(placement_str(p) for p in strategy.outputs)} from ({inputs})"
    own = module_path(node)
    if own:
        return f"{text}, in module {own!r}"
    # a node a pass inserted has no module: say between which modules' nodes it runs
    source, reader = _nearest_path(node, lambda n: n.all_input_nodes), _nearest_path(node, lambda n: list(n.users))
    return text + (f", from module {source!r}" if source else "") + (f", read in module {reader!r}" if reader else "")


def _nearest_path(node: torch.fx.Node, step: Any) -> str:
    """The module paths of the nearest nodes (``step``: a node's inputs or users) that have one."""
    level, seen = [node], {node}
    for _ in range(4):
        level = [m for n in level for m in step(n) if m not in seen]
        seen.update(level)
        paths = sorted({p for n in level if (p := module_path(n))})
        if paths:
            return ", ".join(paths)
    return ""

