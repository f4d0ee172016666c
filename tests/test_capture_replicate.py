"""capture.replicate: a stack of identical blocks traced 3 deep and copied in the graph must give
exactly the full trace's capture (graph, names, inputs, plans, numbers), and anything off the
pattern must be traced in full with a note saying why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.node import map_arg

import autopar
from autopar.errors import CaptureError
from autopar.capture import CapturedGraph, capture
from autopar.capture.replicate import ENV_SWITCH
from examples import hf_models
from examples.gpt import GPT, GPTConfig
from examples.gpt import lm_loss as gpt_loss
from examples.llama import Llama, LlamaConfig, lm_loss
from test_numerics_pipeline import _Stack  # the residual add is the loop's: ops between blocks

pytestmark = pytest.mark.slow

Step = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]
"""(model, example inputs, the rest of capture's / plan's step arguments)."""


class Block(nn.Module):
    def __init__(self, width: int, hidden: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ScaledBlock(Block):
    """A buffer per block: replicated buffers must come in ``named_buffers()`` order."""

    def __init__(self, width: int, hidden: int = 32) -> None:
        super().__init__(width, hidden)
        self.register_buffer("scale", torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class ConstantBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.tensor(0.5)  # lifted by export: one constant input per block


class CountingBlock(Block):
    def __init__(self, width: int, hidden: int = 32) -> None:
        super().__init__(width, hidden)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # a higher-order op (a subgraph) in each block
            self.calls.add_(1)
        return super().forward(x)


class Residual(nn.Module):
    """Something after the stack reads a value from before it (the embedding)."""

    def __init__(self, layers: int = 5, width: int = 16, widths: list[int] | None = None,
                 block: type[Block] = Block) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(block(width, h) for h in (widths or [32] * layers))
        self.head = nn.Linear(width, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.embed(tokens)
        x = e
        for block in self.blocks:
            x = block(x)
        return self.head(x + e)


class IndexedBlock(Block):
    def __init__(self, width: int, hidden: int, index: int) -> None:
        super().__init__(width, hidden)
        self.layer_idx = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * 0.5 if self.layer_idx == 4 else out  # the last block differs: not among the traced


class BranchesOnIndex(Residual):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(IndexedBlock(16, 32, i) for i in range(5))


class CountsCalls(Residual):
    """A ``torch.no_grad()`` block (a higher-order op and its subgraph) before the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls.add_(1)
        return super().forward(tokens)


class ReadsLength(Residual):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) / len(self.blocks)


class SumsBlocks(Residual):
    """The loss reads every block's output: the suffix is wired to all blocks, not just the last."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return self.head(sum(outs))


def _tokens_loss(out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), tokens.flatten())


def _tokens(model: nn.Module) -> Step:
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 8))
    return model, (tokens,), {"loss_fn": _tokens_loss, "example_targets": (tokens,)}


def llama() -> Step:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=6))
    tokens = torch.randint(0, 512, (4, 16))
    return model, (tokens,), {"loss_fn": lm_loss, "example_targets": (tokens.roll(-1, 1),)}


def gpt() -> Step:
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=6))
    tokens = torch.randint(0, 512, (4, 16))
    return model, (tokens,), {"loss_fn": gpt_loss, "example_targets": (tokens.roll(-1, 1),)}


def hf_llama() -> Step:
    model, inputs, loss_fn, targets, kwargs = hf_models.build_llama(layers=6)
    return model, inputs, {"loss_fn": loss_fn, "example_targets": targets, "example_kwargs": kwargs}


def residual() -> Step:
    torch.manual_seed(0)
    return _tokens(Residual())


def loop_residual() -> Step:
    torch.manual_seed(0)
    return _Stack(), (torch.randn(8, 16),), {"loss_fn": F.mse_loss, "example_targets": (torch.randn(8, 8),)}


def shared_norm() -> Residual:
    model = Residual()
    for block in model.blocks:
        block.norm = model.blocks[0].norm
    return model


REPLICATED: dict[str, Callable[[], Step]] = {
    "llama": llama, "gpt": gpt, "hf_llama": hf_llama, "residual": residual, "loop_residual": loop_residual,
    "buffers": lambda: _tokens(Residual(block=ScaledBlock)), "no_grad_before": lambda: _tokens(CountsCalls())}


def _canonical(captured: CapturedGraph) -> list[tuple[Any, ...]]:
    """Each node as what it computes, nodes named by their index in topological order (and by name)."""
    nodes = list(captured.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}

    def val(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), v.dtype, v.stride()
        if isinstance(v, (tuple, list)):
            return tuple(val(x) for x in v)
        return repr(v)

    out = []
    for n in nodes:
        args = map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")  # type: ignore[arg-type,return-value]
        stack = [path for path, _ in (n.meta.get("nn_module_stack") or {}).values()]
        out.append((n.name, n.op, str(n.target), repr(args), val(n.meta.get("val")), stack))
    return out


def _both(step: Step) -> tuple[CapturedGraph, CapturedGraph]:
    model, inputs, kwargs = step
    return capture(model, inputs, **kwargs), capture(model, inputs, replicate_blocks=False, **kwargs)


def _assert_same(replicated: CapturedGraph, full: CapturedGraph) -> None:
    assert len(replicated.gm.graph.nodes) == len(full.gm.graph.nodes)
    for got, want in zip(_canonical(replicated), _canonical(full)):
        assert got == want
    assert list(replicated.parameters.items()) == list(full.parameters.items())
    assert list(replicated.buffers.items()) == list(full.buffers.items())
    assert replicated.user_inputs == full.user_inputs
    assert replicated.tied == full.tied
    assert list(replicated.constants) == list(full.constants)


def _loss(captured: CapturedGraph, step: Step) -> torch.Tensor:
    """Run the captured graph on the model's own (CPU) weights."""
    model, inputs, kwargs = step
    flat = [*inputs, *kwargs.get("example_kwargs", {}).values(), *kwargs.get("example_targets", ())]
    users = iter(flat)
    values = []
    for node in captured.gm.graph.nodes:
        if node.op != "placeholder":
            break
        if node.name in captured.parameters:
            values.append(model.get_parameter(captured.parameters[node.name]))
        elif node.name in captured.constants:
            values.append(captured.constants[node.name])
        elif node.name in captured.buffers:
            values.append(model.get_buffer(captured.buffers[node.name]))
        else:
            values.append(next(users))
    with torch.no_grad():
        return captured.gm(*values)[0]


@pytest.mark.parametrize("name", list(REPLICATED))
def test_replicated_capture_is_the_full_capture(name: str) -> None:
    step = REPLICATED[name]()
    replicated, full = _both(step)
    assert any("traced 3 of" in n for n in replicated.notes), replicated.notes
    assert not full.notes
    _assert_same(replicated, full)
    want = _loss(full, step)
    assert torch.isfinite(want)
    assert torch.equal(_loss(replicated, step), want)


@pytest.mark.parametrize("name", ["llama", "hf_llama"])
def test_replicated_plan_is_the_full_plan(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs, kwargs = REPLICATED[name]()
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, "cpu")
    replicated = autopar.plan(model, mesh, inputs, **{"pipeline": False, **kwargs})
    monkeypatch.setenv(ENV_SWITCH, "0")
    full = autopar.plan(model, mesh, inputs, **{"pipeline": False, **kwargs})
    assert replicated.plan_hash() == full.plan_hash()
    assert replicated.predicted.step_time_s == full.predicted.step_time_s


@pytest.mark.parametrize("model, note", [
    (Residual(widths=[32, 32, 48, 32, 32]), "block 2 differs from block 0 in up.weight"),
    (Residual(layers=3), "has 3 blocks, fewer than 4"),
    (ReadsLength(), "reads len(self.blocks)"),
    (BranchesOnIndex(), "the blocks' forward uses their index (layer_idx: __eq__)"),
    (SumsBlocks(), "after the blocks, reads a block other than the last"),
    (Residual(block=ConstantBlock), "reads c_model_blocks_1_lifted_tensor_1 where block 0's wiring says"),
    (Residual(block=CountingBlock), "not a plain op"),
    (shared_norm(), "blocks share parameters or buffers"),
], ids=["unlike-blocks", "too-few", "reads-length", "branches-on-index", "sums-blocks", "constants", "no-grad",
        "shared"])
def test_off_pattern_models_are_traced_in_full(model: nn.Module, note: str) -> None:
    step = _tokens(model)
    replicated, full = _both(step)
    assert len(replicated.notes) == 1 and note in replicated.notes[0] and "not replicated" in replicated.notes[0]
    _assert_same(replicated, full)


def test_env_switch_traces_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs, kwargs = residual()
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert capture(model, inputs, **kwargs).notes == []


def test_list_is_restored_when_tracing_fails() -> None:
    model, inputs, kwargs = residual()
    blocks = list(model.blocks)
    with pytest.raises(CaptureError):
        capture(model, inputs, loss_fn=lambda out, t: out.nonexistent(), example_targets=kwargs["example_targets"])
    assert list(model.blocks) == blocks


class _Helper(nn.Module):
    """A stateless module a block keeps in a plain dict (as Hugging Face keeps kernel functions)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale


def test_per_block_helper_modules_compare_by_class_and_attributes() -> None:
    from autopar.capture.replicate import find_stack
    model = Residual()
    for block in model.blocks:
        block.__dict__["_helpers"] = {"rope": _Helper(1.0)}
    stack, why = find_stack(model)
    assert stack is not None and stack.count == 5, why
    model.blocks[3].__dict__["_helpers"] = {"rope": _Helper(2.0)}
    stack, why = find_stack(model)
    assert stack is None and "block 3 differs from block 0 in _helpers" in str(why)
