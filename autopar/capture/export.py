"""Capture a model's step with torch.export (non-strict) into an aten FX graph."""

from __future__ import annotations

import contextlib
import operator
import os
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.config
from torch import nn
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, OutputKind

from autopar.capture.aliasing import returned_operand, written_args
from autopar.capture.kept import keep, kept
from autopar.capture.graph import CapturedGraph
from autopar.capture.moe_region import collapse_moe_regions
from autopar.capture.replicate import TRACED, Stack, enabled, find_stack, replicate, shortened
from autopar.errors import CaptureError
from autopar.capture.step import StepSignature, TrainStep, check_step_arguments
from autopar.capture.subgraphs import is_higher_order, nested_graph_modules
from autopar.capture.symbolic import SymbolicRefused, at_rows, batch_rows, batch_shapes, batch_symbol
from autopar.capture.unbacked import hint_or_refuse, placeholder_values, unbacked_nodes

# Frames from these packages are the tracer, not the user's model.
_LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep  # type: ignore[arg-type]
    for m in (torch, __import__("autopar"))
)


def _user_frame(exc: BaseException) -> str | None:
    """``file:line: source`` of the innermost frame that is the user's code, not torch's."""
    frames = traceback.extract_tb(exc.__traceback__)
    cause = exc.__cause__ or exc.__context__
    while cause is not None:  # export re-raises; the user's frame may sit in the cause
        frames += traceback.extract_tb(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__
    for frame in reversed(frames):
        if not frame.filename.startswith(_LIBRARY_DIRS) and not frame.filename.startswith("<"):
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return None


def capture(model: nn.Module, example_inputs: tuple[Any, ...], *,
            loss_fn: Callable[..., torch.Tensor] | None = None,
            example_kwargs: dict[str, Any] | None = None,
            example_targets: tuple[Any, ...] = (), train: bool = True,
            replicate_blocks: bool = True, symbolic_batch: bool = False) -> CapturedGraph:
    """Export ``loss_fn(model(*example_inputs, **example_kwargs), *example_targets)``.

    Works on meta-device models: export fakifies parameters, so no weight memory is
    touched. Raises TypeError for arguments of the wrong kind and CaptureError naming the
    source line that could not be traced. A stack of at least ``replicate.MIN_BLOCKS``
    identical blocks is traced ``replicate.TRACED`` blocks deep and the rest copied in the
    graph (the same graph as a full trace, in a fraction of the time); ``replicate_blocks=False``
    (or ``AUTOPAR_REPLICATE_BLOCKS=0``) traces every block. ``notes`` say which happened.
    ``symbolic_batch``: the leading dim of the inputs with as many rows as the first is one symbol
    (``capture.symbolic``; for pricing only, raising ``SymbolicRefused`` where it cannot be); inside
    ``reuse_captures`` one such capture serves every batch size.
    """
    check_step_arguments(model, example_inputs, loss_fn, {} if example_kwargs is None else example_kwargs,
                         example_targets)
    kwargs = dict(example_kwargs or {})
    flat = _distinct((*example_inputs, *kwargs.values(), *example_targets))
    rows = batch_rows(flat) if symbolic_batch else None
    key = _reuse_key(model, example_inputs, kwargs, example_targets, loss_fn, train, rows)
    if key is not None and _REUSED is not None and key in _REUSED:
        found = _REUSED[key][1]
        if isinstance(found, SymbolicRefused):  # refused once, refused for every size: not exported again
            raise found
        return at_rows(found, rows)
    again = None if key is None or rows is not None else kept(model, (key[1:], replicate_blocks))
    if again is not None:  # captured before in this process, the model unchanged since (``capture.kept``)
        return again
    step = TrainStep(model, loss_fn, len(example_inputs), tuple(kwargs), train)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        # A meta-device model is planned on shapes alone: inputs follow it onto meta.
        flat = tuple(v.to("meta") if isinstance(v, torch.Tensor) else v for v in flat)
    try:
        captured = _captured(model, step, flat, StepSignature.of(example_inputs, kwargs, example_targets), train,
                             replicate_blocks, rows)
    except SymbolicRefused as exc:
        if key is not None and _REUSED is not None:
            _REUSED[key] = (model, exc)
        raise
    if key is not None and _REUSED is not None:
        _REUSED[key] = (model, captured)  # the model kept alive: its id stays its own
    if key is not None and rows is None:
        keep(model, (key[1:], replicate_blocks), captured)
    return captured


def _captured(model: nn.Module, step: TrainStep, flat: tuple[Any, ...], signature: StepSignature, train: bool,
              replicate_blocks: bool, rows: int | None) -> CapturedGraph:
    """``capture`` uncached; ``rows``: a symbolic capture's micro-batch size, every failure past the
    plain capture's then a ``SymbolicRefused`` (a capture for pricing only: the search solves instead)."""
    dynamic = None if rows is None else batch_shapes(flat, rows)
    start = time.perf_counter()
    stack, note = find_stack(model) if enabled(replicate_blocks) else (None, None)
    notes = [note] if note else []
    try:
        program, inputs = _export_replicated(step, flat, stack, notes, dynamic) if stack is not None else (None, None)
        if program is None:
            program = _export(step, flat, dynamic)
        captured = _to_captured(program, train, time.perf_counter() - start, signature, inputs)
    except CaptureError as exc:
        if dynamic is None:
            raise
        raise SymbolicRefused(f"export could not keep the micro-batch symbolic: {exc}") from exc
    captured.notes.extend(notes)
    if dynamic is not None:
        captured.batch_symbol = batch_symbol(captured.gm, captured.user_inputs, dynamic)
        captured.size_hints[captured.batch_symbol] = rows  # type: ignore[assignment]
    if unbacked_nodes(captured.gm):
        values = placeholder_values(captured.gm, model, captured.parameters, captured.buffers, captured.constants,
                                    captured.user_inputs, flat)
        captured.size_hints, source = hint_or_refuse(captured.gm, values)
        captured.notes.append(f"data-dependent sizes planned at {source}: "
                              + ", ".join(f"{k}={v}" for k, v in sorted(captured.size_hints.items(), key=str)))
    return captured


def _export(step: TrainStep, flat: tuple[Any, ...], dynamic: tuple[Any, ...] | None = None) -> ExportedProgram:
    try:
        with lean_tracing():
            program = torch.export.export(step, flat, strict=False,
                                          dynamic_shapes=None if dynamic is None else {"flat": dynamic})
        return program
    except CaptureError:
        raise
    except Exception as exc:  # noqa: BLE001 - every tracer failure becomes one clear error
        where = _user_frame(exc)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        at = f"\n  at {where}" if where else ""
        raise CaptureError(f"could not capture the model with torch.export: {type(exc).__name__}: {first}{at}"
                           + _data_dependent_hint(exc, step)) from exc


def _data_dependent_hint(exc: Exception, step: TrainStep) -> str:
    """What to do where the model branches or loops on values (a guard on a size computed from data):
    Hugging Face's "eager" experts loop over the experts a batch routes to, which no graph can hold."""
    if "data-dependent" not in str(exc):
        return ""
    if any(_eager_experts(module) for module in step.model.modules()):
        return ("\n  the model's experts run as a Python loop over the experts the batch routes to "
                "(experts_implementation='eager'): build it with transformers' default ('grouped_mm', captured "
                "as one expert op) or 'batched_mm'")
    return ("\n  the model branches or loops on values computed from its inputs (a trip count or an if on a "
            "tensor's contents), which one captured graph cannot hold")


def _eager_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face experts module (a class under transformers'
    ``use_experts_implementation``, which gives its instances ``has_gate`` and ``is_transposed``)
    run in the "eager" loop. Transformers sets ``config._experts_implementation`` on every model,
    experts or not, so the config alone does not say."""
    if not (hasattr(module, "has_gate") and hasattr(module, "is_transposed")):
        return False
    config = getattr(module, "config", None)
    return getattr(config, "_experts_implementation", None) == "eager"


_Inputs = tuple[list[InputSpec], dict[str, torch.Tensor]]
"""A replicated program's input specs, and the tensors of the inputs its trace did not have."""


def _export_replicated(step: TrainStep, flat: tuple[Any, ...], stack: Stack, notes: list[str],
                       dynamic: tuple[Any, ...] | None = None) -> tuple[ExportedProgram | None, _Inputs | None]:
    """The step traced with ``stack`` cut short and its graph replicated to full depth, or
    (None, None) with a note saying why not (the caller then traces it in full)."""
    try:
        with shortened(stack) as index_uses:
            program = _export(step, flat, dynamic)
    except CaptureError as exc:  # the full trace says what is wrong, if anything is
        notes.append(f"blocks not replicated: {stack.label}: tracing {TRACED} blocks failed ({exc.__cause__!r:.200})")
        return None, None
    if unbacked_nodes(program.graph_module):  # each block's copy would need its own data-dependent sizes
        notes.append(f"blocks not replicated: {stack.label}: the blocks make data-dependent sizes (torch.export's "
                     "unbacked sizes, e.g. tokens routed to an expert)")
        return None, None
    if index_uses:
        names = ", ".join(".".join(filter(None, key)) for key in stack.indexed)
        notes.append(f"blocks not replicated: {stack.label}: the blocks' forward uses their index ({names}: "
                     f"{index_uses[0]})")
        return None, None
    result = replicate(program, stack, step)
    if isinstance(result, str):
        notes.append(f"blocks not replicated: {stack.label}: {result}")
        return None, None
    notes.append(stack.note())
    return program, result


_REUSED: dict[tuple[Any, ...], tuple[nn.Module, CapturedGraph | SymbolicRefused]] | None = None
"""Captures ``reuse_captures`` keeps, and symbolic captures refused (None: outside it, every call traces)."""


@contextlib.contextmanager
def reuse_captures() -> Iterator[None]:
    """Inside, ``capture`` of the same model object with the same loss function and arguments of the
    same shapes, dtypes and devices (export traces shapes, never values) returns the graph captured
    first rather than tracing again: for planning one model under many configurations (a 175B GPT's
    stage-mesh plan is 70% capture; ``benchmarks/hand_plan_grid.py`` plans hundreds). The model and
    the loss function must not change inside; arguments other than tensors and plain scalars are
    traced every time."""
    global _REUSED
    outer = _REUSED
    _REUSED = {} if outer is None else outer
    try:
        yield
    finally:
        _REUSED = outer


def _reuse_key(model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: tuple[Any, ...],
               loss_fn: Callable[..., torch.Tensor] | None, train: bool, rows: int | None = None
               ) -> tuple[Any, ...] | None:
    """What a capture depends on: the model and loss function objects, the step's arguments' shapes,
    dtypes, devices and which of them are one tensor (``_distinct``); None when an argument is neither
    a tensor nor a plain scalar. ``rows``: a symbolic capture's micro-batch size, left out of the
    shapes (a leading dim of that many rows is the symbol)."""
    first: dict[int, int] = {}
    parts: list[object] = [rows is not None]
    for value in (*inputs, *kwargs.values(), *targets):
        if isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
            if rows is not None and shape and shape[0] == rows:
                shape = (None, *shape[1:])
            parts.append((shape, value.dtype, value.device, first.setdefault(id(value), len(first))))
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts.append((type(value), value))
        else:
            return None
    return (id(model), loss_fn, train, len(inputs), tuple(kwargs), len(targets), tuple(parts))


@contextlib.contextmanager
def lean_tracing() -> Iterator[None]:
    """Export without the bookkeeping nothing here reads, restored afterwards.

    Stack traces: FX records one per node (``CapturedTraceback.extract`` and symbolization,
    a good part of a large model's capture); autopar never reads ``node.stack_trace`` (errors name
    the user's line from the exception, ``_user_frame``). ``torch.fx.config`` documents the
    switch. Lazy graph modules: export's own passes regenerate the Python code of the whole
    graph after each rewrite (six times); lazily, code is generated only when some module
    is run or printed (the exported program's final module is a plain one, compiled once).
    """
    previous = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        with _use_lazy_graph_module(True):
            yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = previous


def _distinct(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """A fresh view (no copy) for each repeat of a tensor object among the step's inputs.

    Export folds a tensor passed twice (HF's ``labels=input_ids``) into one placeholder and
    leaves the other dead; with a view each argument keeps its own placeholder and uses.
    """
    seen: set[int] = set()
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                value = value.view_as(value)
            seen.add(id(value))
        out.append(value)
    return tuple(out)


def _to_captured(program: ExportedProgram, train: bool, seconds: float, signature: StepSignature,
                 inputs: _Inputs | None = None) -> CapturedGraph:
    """The program as a CapturedGraph; ``inputs``: its input specs and new inputs' tensors when
    ``capture.replicate`` rewrote its graph (the program's own signature no longer matches)."""
    # The training IR keeps in-place updates (batch norm's running statistics) inside the
    # graph and returns the step's outputs only; later stages rely on that (the first
    # output is the loss, buffers are updated where they live). A functionalized program
    # would return mutated buffers as extra outputs that nothing writes back.
    extra = [f"{spec.kind.name} {spec.target}" for spec in program.graph_signature.output_specs
             if spec.kind != OutputKind.USER_OUTPUT]
    if extra:
        raise CaptureError(f"the exported step returns more than its outputs ({', '.join(extra)}); autopar "
                           "needs torch.export's training IR, where in-place updates stay in the graph")
    gm = program.graph_module
    specs = program.graph_signature.input_specs if inputs is None else inputs[0]
    added = {} if inputs is None else inputs[1]
    _use_returned_operands(gm.graph)
    _eliminate_dead_code(gm)
    collapsed = collapse_moe_regions(gm)  # before planning: the planner chooses expert parallelism for the op
    tied = _merge_tied(gm.graph, specs, lambda target: program.state_dict.get(
        target, program.constants.get(target, added.get(target))))  # type: ignore[arg-type]
    gm.recompile()  # the top module once, after every rewrite (``_eliminate_dead_code`` leaves it)
    parameters: dict[str, str] = {}
    buffers: dict[str, str] = {}
    user_inputs: list[str] = []
    constants: dict[str, torch.Tensor] = {}
    alive = {node.name for node in gm.graph.nodes if node.op == "placeholder"}
    for spec in specs:
        name = spec.arg.name  # type: ignore[union-attr]
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and _strip_step_prefix(spec.target) in tied:
            continue
        if spec.kind == InputKind.CONSTANT_TENSOR and name not in alive:
            continue  # a buffer's tensor, read from the buffer (``_merge_constant``)
        if spec.kind == InputKind.PARAMETER:
            parameters[name] = _strip_step_prefix(spec.target)
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            buffers[name] = _strip_step_prefix(spec.target)
            if spec.kind == InputKind.CONSTANT_TENSOR:  # made inside forward: not on the model
                constants[name] = program.constants[spec.target]  # type: ignore[index]
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(name)
    captured = CapturedGraph(gm=gm, parameters=parameters, buffers=buffers, user_inputs=user_inputs,
                             train=train, capture_seconds=seconds, tied=tied, constants=constants,
                             signature=signature)
    if collapsed:
        captured.notes.append(f"{collapsed} sorted dropless expert regions (grouped matmuls) captured as one "
                              "autopar::moe_experts op each (capture.moe_region)")
    return captured


def _use_returned_operands(graph: torch.fx.Graph) -> None:
    """Read an operand that a block returns as itself (``self.w.clamp_(-1, 1)`` under
    no_grad returns the parameter) from the operand, not from the block's output.

    It is the same tensor at run time, so gradients reach it through its later uses; planned
    through the block (which runs without gradients), the parameter would seem to get none.
    The reads still come after the block's write (``capture.aliasing`` versions them).
    """
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is operator.getitem and \
                isinstance(node.args[0], torch.fx.Node) and is_higher_order(node.args[0]):
            operand = returned_operand(node.args[0], node.args[1])
            if operand is not None:
                node.replace_all_uses_with(operand)


def _eliminate_dead_code(gm: torch.fx.GraphModule) -> None:
    """Erase runtime dtype asserts (no data, no sharding decision; their device is the one
    captured on) and unused nodes without side effects, in ``gm`` and every subgraph.

    A side effect includes a higher-order op whose subgraph writes in place (a
    ``torch.no_grad()`` block updating a buffer, its result unused), which FX's purity test
    misses. ``Graph.eliminate_dead_code(is_impure_node=...)`` takes a better test, but then
    sweeps the subgraphs with its default one, which erases a nested block: so this is its
    sweep, graph by graph.
    """
    for module in (gm, *nested_graph_modules(gm)):
        graph = module.graph
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
                graph.erase_node(node)
        for node in reversed(graph.nodes):  # users first: their inputs may become dead in turn
            if not node.users and not node.is_impure() and not written_args(node):
                graph.erase_node(node)
        graph.lint()
        if module is not gm:  # the caller recompiles ``gm`` after its own rewrites
            module.recompile()


def _merge_tied(graph: torch.fx.Graph, specs: list[InputSpec],
                tensor_of: Callable[[str], torch.Tensor | None]) -> dict[str, str]:
    """One placeholder per tensor: export gives a tied tensor (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) one placeholder per name, and only one of them has users.

    Keeps the first name (the one ``named_parameters()`` reports), points every use of the
    others at it and erases them. Returns alias FQN -> kept FQN.
    """
    placeholders = {node.name: node for node in graph.nodes if node.op == "placeholder"}
    first: dict[int, tuple[str, str]] = {}  # id(tensor) -> (placeholder, FQN) of its first name
    tied: dict[str, str] = {}
    for spec in specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            continue
        tensor = tensor_of(spec.target)  # type: ignore[arg-type]
        if tensor is None:
            continue
        name, fqn = spec.arg.name, _strip_step_prefix(spec.target)  # type: ignore[union-attr]
        if spec.kind == InputKind.CONSTANT_TENSOR:
            _merge_constant(graph, placeholders, name, first.get(id(tensor)))
            continue
        kept_name, kept_fqn = first.setdefault(id(tensor), (name, fqn))
        if kept_name != name:
            placeholders[name].replace_all_uses_with(placeholders[kept_name])
            graph.erase_node(placeholders[name])
            tied[fqn] = kept_fqn
    return tied


def _merge_constant(graph: torch.fx.Graph, placeholders: dict[str, torch.fx.Node], name: str,
                    buffer: tuple[str, str] | None) -> None:
    """A lifted constant that is a registered buffer's very tensor (Hugging Face's export wrapper
    registers its ``StaticCache`` tensors as buffers, but the attention reaches them through the
    cache object, so export lifts them again as constants) is that buffer: read from its placeholder,
    so the cache is the module's state, written in place where it lives, not a per-program copy."""
    if buffer is not None:
        placeholders[name].replace_all_uses_with(placeholders[buffer[0]])
        graph.erase_node(placeholders[name])


def _strip_step_prefix(fqn: str | None) -> str:
    """``model.layers.0.w`` -> ``layers.0.w``: FQNs as the user's model names them."""
    fqn = fqn or ""
    return fqn[len("model."):] if fqn.startswith("model.") else fqn
