"""Buffers updated under ``torch.no_grad()`` inside forward (an EMA of activations, a step
counter, per-unit hit counts as MoE load balancing keeps them) compiled on gloo ranks
forked from this process train to the single-device numbers: loss, every gradient (whole
tensors), every parameter AND buffer after 3 AdamW steps.

torch.export puts a no_grad block into the higher-order op ``wrap_with_set_grad_enabled``
whose subgraph writes the buffers in place; nothing uses its result, so a plain dead-code
elimination used to delete it and the compiled step never updated them. The planning-level
tests below check what capture keeps, what the aliasing analysis sees inside blocks
(nested ones, views, a parameter returned as itself), how blocks are placed (replicated,
without gradients) and what the passes rewrite inside them.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import autopar
from autopar.api.planning import plan_step
from autopar.errors import CaptureError
from autopar.capture import CapturedGraph, capture
from autopar.capture.aliasing import as_produced_args, read_versions, storage_root, viewed_arg, written_args
from autopar.passes import PassContext, parallelize_graph
from autopar.rules import NO_RULE
from autopar.rules.strategy import Strategy
from autopar.runtime.forked import run_ranks
from autopar.result.build import param_sync_dims
from numerics_harness import STEPS, Reference, check, reference, run_compiled

DIM, HIDDEN, BATCH, SEED = 8, 16, 8, 1234


class EmaCounters(nn.Module):
    """Centers its hidden activations by their running mean, which it updates itself under
    no_grad (the EMA reads the whole batch: ``mean(0)``), and counts steps and how often each
    hidden unit fired (an integer counter, as MoE routers count tokens per expert). The EMA
    takes a little noise: a draw inside the block, from the module's generator in its turn."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.register_buffer("ema", torch.zeros(HIDDEN))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("hits", torch.zeros(HIDDEN, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # a block whose result the step uses
            self.steps += 1
            center = self.ema.clone()
        h = torch.relu(self.fc1(x))
        with torch.no_grad():  # nothing of this block is used: it only writes the buffers
            self.ema.mul_(0.9).add_(h.mean(0) + 0.01 * torch.rand_like(self.ema), alpha=0.1)
            self.hits.add_((h > 0).sum(0))
        return self.fc2(h - center)


def build() -> tuple[nn.Module, tuple[torch.Tensor], Any, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = EmaCounters()
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, DIM, (BATCH,), generator=gen)
    return model, (torch.randn(BATCH, DIM, generator=gen),), F.cross_entropy, (labels,)


MESHES = {"dp2": ((2,), ("dp",)), "2x2": ((2, 2), ("dp", "tp"))}
CASES = [(mesh, data) for mesh in MESHES for data in (False, True)]


def train_on_rank(rank: int, world: int, mesh: str, data: bool, ref: Reference) -> dict[str, Any]:
    shape, names = MESHES[mesh]
    device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model, inputs, loss_fn, targets = build()
    pm = autopar.compile(model, device_mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                         data_axes=("dp",) if data else (), seed=SEED, pipeline=False)
    return run_compiled(pm, (*inputs, *targets), ref)


@pytest.mark.parametrize(("mesh", "data"), CASES, ids=[f"{m}-{'dp' if d else 'free'}" for m, d in CASES])
def test_no_grad_buffer_updates_match_single_device(mesh: str, data: bool) -> None:
    ref = reference(build, seed=SEED)  # the compiled module's generator: compile(..., seed=SEED)
    assert int(ref.state["steps"]) == STEPS and ref.state["ema"].abs().sum() > 0 and ref.state["hits"].sum() > 0
    check(run_ranks(train_on_rank, math.prod(MESHES[mesh][0]), mesh, data, ref), ref)


# --- planning level: what capture keeps, what the aliasing analysis sees, how blocks are placed


class Blocks(nn.Module):
    """Each form of block the analysis must see through: a parameter clamped in place (the
    block returns the parameter itself), a buffer written inside a nested block and through
    a view, a view of the buffer returned and used, reads before and after the write, and a
    block that writes nothing and whose result is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.clamp_(-1, 1)
        h = self.fc(x)
        before = h * self.ema
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                self.ema.mul_(0.5)
            self.ema.view(2, 2)[0].add_(h.mean(0)[:2])
            pair = self.ema.view(2, 2)
        after = h * self.ema
        with torch.no_grad():
            h.max()
        return before + after + pair.flatten()


def _capture_blocks() -> tuple[CapturedGraph, dict[str, torch.fx.Node]]:
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    captured = capture(Blocks(), (x,), loss_fn=F.cross_entropy, example_targets=(torch.randint(0, 4, (4,)),))
    by_fqn = {fqn: node for node in captured.gm.graph.nodes
              if (fqn := captured.parameters.get(node.name) or captured.buffers.get(node.name))}
    return captured, by_fqn


def _blocks(captured: CapturedGraph) -> list[torch.fx.Node]:
    return [n for n in captured.gm.graph.nodes if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled]


def test_capture_keeps_blocks_that_write() -> None:
    """Dead-code elimination keeps the blocks that write (their results unused) and drops
    the one that only computes an unused value; the parameter the first block returns is
    read from its placeholder (it is that tensor), and nested blocks survive inside."""
    captured, by_fqn = _capture_blocks()
    clamp, update = _blocks(captured)
    weight, ema = by_fqn["fc.weight"], by_fqn["ema"]
    assert not clamp.users and written_args(clamp) == [weight]
    assert written_args(update) == [ema]  # through the nested autocast block and through a view
    (linear,) = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linear.args[1] is weight
    sub = captured.gm.get_submodule(update.args[1].target)
    assert [n.target for n in sub.graph.nodes if n.op == "call_function"][0] is torch.ops.higher_order.wrap_with_autocast


def test_aliasing_sees_writes_inside_blocks() -> None:
    """The block writes the buffer, so it takes it as produced; the view it returns is a view
    of the buffer (written through, so taken as produced too); reads after a block's write
    are a new version, reads before are not."""
    captured, by_fqn = _capture_blocks()
    clamp, update = _blocks(captured)
    weight, ema = by_fqn["fc.weight"], by_fqn["ema"]
    (pair,) = [n for n in captured.gm.graph.nodes if n.target is operator.getitem and n.args[0] is update]
    assert viewed_arg(pair) is ema and storage_root(pair) is ema
    pinned = as_produced_args(captured.gm.graph)
    assert pinned[clamp] == {weight} and pinned[update] == {ema} and pinned[pair] == {update}
    versions = read_versions(captured.gm.graph)
    (linear,) = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    before, after = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor and ema in n.args]
    assert versions[(linear, weight)] == 1 and (before, ema) not in versions and versions[(after, ema)] == 1


def test_blocks_run_replicated_without_gradients() -> None:
    """A block has no rule: its only strategy is all-Replicate (listed as a fallback), no
    gradient flows through it, and the parameter it clamps still gets its gradient (from
    the linear that reads it) synchronized on the data axis."""
    torch.manual_seed(0)
    x, t = torch.randn(4, 4), torch.randint(0, 4, (4,))
    step = plan_step(Blocks(), autopar.Mesh({"dp": 2}, "cpu"), (x,), loss_fn=F.cross_entropy, example_targets=(t,),
                     data_axes=("dp",))
    blocks = [n for n in step.graph.order if step.graph.nodes[n].op == "wrap_with_set_grad_enabled"]
    assert len(blocks) == 2
    for name in blocks:
        node = step.graph.nodes[name]
        assert node.fallback == NO_RULE and not node.needs_grad
        assert [all(p.is_replicate() for pl in (*s.inputs, *s.outputs) if pl for p in pl) for s in node.strategies] == [True]
    assert [(f.op, len(f.nodes)) for f in step.plan.fallbacks if "wrap" in f.op] == [("wrap_with_set_grad_enabled", 2)]
    weight = next(n for n in step.graph.order if step.graph.nodes[n].fqn == "fc.weight")
    assert step.graph.nodes[weight].needs_grad and param_sync_dims(step.graph, step.chosen, step.ctx)[weight] == {0}


class InferenceModeEma(EmaCounters):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        with torch.inference_mode():  # export drops this block: the add_ would be recorded for autograd
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.fc2(h - self.ema)


def test_buffer_written_from_values_needing_gradient_is_refused() -> None:
    _, inputs, loss_fn, targets = build()
    with pytest.raises(CaptureError, match="buffer 'ema' is written in place .* torch.no_grad"):
        autopar.plan(InferenceModeEma(), autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                     example_targets=targets)


class MetaNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        with torch.no_grad():
            self.ema.add_(torch.rand(4, device=x.device) * h.mean(0))
        return h


def _rank_program(split: bool = False) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """A meta-device model's captured step and one rank's program (passes only: no ranks);
    with ``split``, the block placed batch-split instead of replicated."""
    with torch.device("meta"):
        model = MetaNoise()
    x, t = torch.randn(4, 4), torch.randint(0, 4, (4,))
    step = plan_step(model, autopar.Mesh({"dp": 2}, "cpu"), (x,), loss_fn=F.cross_entropy, example_targets=(t,),
                     data_axes=("dp",))
    chosen = dict(step.chosen)
    if split:
        (block,) = [n for n in step.graph.order if step.graph.nodes[n].op == "wrap_with_set_grad_enabled"]
        chosen[block] = Strategy(outputs=(), inputs=tuple((Shard(0),) for _ in step.graph.nodes[block].args))
    pc = PassContext(graph=step.graph, chosen=chosen, ctx=step.ctx,
                     sync_dims=param_sync_dims(step.graph, chosen, step.ctx), device_type="cpu")
    modules = {name: nn.Module() for name in ("reshard", "partial_mean_loss", "random")}
    return step.captured.gm, parallelize_graph(step.captured.gm, pc, modules)


def test_passes_rewrite_draws_and_devices_inside_blocks() -> None:
    """The rank's program draws inside a block from the module's generator, on the rank's
    device; the captured step's subgraph is left as it was."""
    captured, program = _rank_program()
    (block,) = [n for n in program.graph.nodes if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled]
    code = program.get_submodule(block.args[1].target).code
    assert "self.random('aten.rand.default', 'R', (4,)" in code and "meta" not in code
    original = captured.get_submodule(block.args[1].target).code
    assert "aten.rand.default" in original and "device(type='meta')" in original


def test_a_block_placed_split_is_refused() -> None:
    """A block's subgraph is written for whole tensors: a plan splitting it would be wrong."""
    with pytest.raises(RuntimeError, match="runs a subgraph written for whole tensors"):
        _rank_program(split=True)
