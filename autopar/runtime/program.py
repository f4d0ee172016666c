"""One rank's program and state for an agreed plan: the captured step with the plan
applied (``passes.parallelize_graph``), this rank's shards of the state it reads, and the
signature it is called with. ``compile`` builds a ParallelModule of them, ``runtime.pipeline``
a pipeline's stages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from autopar.capture.step import StepSignature
from autopar.passes import PassContext, parallelize_graph
from autopar.rules.strategy import Strategy
from autopar.runtime.attention import ContextAttention
from autopar.problem.micro_losses import SUM, loss_kind
from autopar.runtime.mixed import compute_buffer
from autopar.runtime.grouped import GatherGroup, attach_grad_groups
from autopar.runtime.moe import ExpertDispatch
from autopar.cost.compute import ring_of
from autopar.runtime.ring import RingAttention, check_ring_device
from autopar.runtime.losses import PartialMeanLoss
from autopar.runtime.ops import Comm, Prefetch, Reshard
from autopar.runtime.parameters import InitFn, ShardInitializer, local_shard
from autopar.runtime.random import RandomOps, RandomSource
from autopar.runtime.recompute import Recompute
from autopar.runtime.regather import BackwardStarts, Regather
from autopar.runtime.vocab import VocabEmbedding
from autopar.problem.nodes import BUFFER, INPUT, PARAM
from autopar.result.build import param_sync_dims
from autopar.search.planned import PlannedStep


def step_loss_kind(step: PlannedStep) -> str | None:
    """How the step's micro-batch losses combine (``runtime.microbatch``); raises for a loss
    no weight per micro-batch makes exact. None for a forward-only step."""
    m = step.plan.memory.micro_batches
    return (loss_kind(step.captured.gm, m) if m > 1 else SUM) if step.ctx.train else None  # m = 1: any kind


def rank_program(step: PlannedStep, mesh: DeviceMesh, comm: Comm, seed: RandomSource, compute_dtype: torch.dtype | None,
                 input_sharded: bool, recompute_replays: bool = False) -> torch.fx.GraphModule:
    """This rank's program: the captured step with the plan applied (``parallelize_graph``).
    ``seed``: the random stream its random ops draw from; ``recompute_replays``: backward runs
    through a checkpointed block twice (``Recompute``)."""
    graph, chosen = step.graph, step.chosen
    if step.captured.batch_symbol is not None:  # a pricing-only capture (``capture.symbolic``): never run
        raise ValueError("a step priced on a symbolic capture cannot be built into a rank's program")
    pc = PassContext(graph=graph, chosen=chosen, ctx=step.ctx, sync_dims=param_sync_dims(graph, chosen, step.ctx),
                     input_sharded=input_sharded, device_type=mesh.device_type,
                     regather=frozenset(step.plan.memory.regather), memory=step.plan.memory,
                     master_dtype=None if compute_dtype is None else torch.float32)
    check_ring_device(mesh.device_type, sum(graph.nodes[n].call is not None and ring_of(graph.nodes[n].call, chosen[n])
                                            is not None for n in graph.order))
    shape, coordinate, zigzag = tuple(mesh.shape), tuple(mesh.get_coordinate()), step.ctx.mesh.zigzag_dims()
    random_ops = RandomOps(shape, coordinate, seed.stream(mesh.device_type), zigzag)
    modules = {"reshard": Reshard(comm), "regather": Regather(comm), "prefetch": Prefetch(comm),
               "gather_group": GatherGroup(comm), "backward_starts": BackwardStarts(),
               "partial_mean_loss": PartialMeanLoss(comm), "vocab_embedding": VocabEmbedding(shape, coordinate),
               "context_attention": ContextAttention(shape, coordinate, zigzag),
               "ring_attention": RingAttention(comm, zigzag), "moe_dispatch_combine": ExpertDispatch(comm),
               "random": random_ops, "recompute": Recompute(comm, random_ops.generator, recompute_replays)}
    gm = parallelize_graph(step.captured.gm, pc, modules)
    attach_grad_groups(comm, gm)
    return gm


@dataclass(kw_only=True)
class RankState:
    """The program's placeholders and this rank's shards of the state they read."""

    placeholders: list[tuple[str, str, str]]
    """(placeholder name, 'param' | 'buffer' | 'constant' | 'input', FQN or name), in program order."""
    local: dict[str, torch.Tensor]
    """Placeholder name -> this rank's shard (state only; only the kept ones)."""
    placements: dict[str, tuple[Placement, ...]]
    """FQN -> placements of each parameter and buffer."""
    frozen: frozenset[str]
    """FQNs of parameters with ``requires_grad=False``."""
    transient: frozenset[str] = frozenset()
    """FQNs of the model's non-persistent buffers (kept out of ``state_dict()``, as the model keeps them)."""


def rank_state(model: nn.Module, mesh: DeviceMesh, step: PlannedStep, init_fn: InitFn | None, init_seed: int,
               compute_dtype: torch.dtype | None, keep: Callable[[str], bool] | None = None,
               shared: dict[str, torch.Tensor] | None = None) -> RankState:
    """Placeholders and shards; ``keep`` (placeholder name -> bool) limits which state this
    rank materializes (a pipeline stage holds its own parameters only); ``shared`` (FQN ->
    local shard, placed as this plan places it) is another program's state, taken as it is."""
    captured, graph, chosen = step.captured, step.graph, step.chosen
    model_state = dict(model.named_parameters()) | dict(model.named_buffers())
    shards = ShardInitializer(model, mesh, init_fn, init_seed)
    placeholders: list[tuple[str, str, str]] = []
    local: dict[str, torch.Tensor] = {}
    placements = {}
    frozen = frozenset(n.fqn or n.name for n in graph.nodes.values() if n.frozen)
    for node in captured.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = node.name
        plan_node = graph.nodes.get(name)
        strategy_out = chosen[name].outputs[0] if name in chosen else None
        kept = keep is None or keep(name)
        if name in captured.constants:
            placeholders.append((name, "constant", name))
            if kept:
                local[name] = local_shard(captured.constants[name], strategy_out, mesh).clone()
        elif plan_node is not None and plan_node.kind in (PARAM, BUFFER):
            fqn = plan_node.fqn or name
            placeholders.append((name, "param" if plan_node.kind == PARAM else "buffer", fqn))
            if kept and shared is not None and fqn in shared:
                local[name] = shared[fqn]  # the very tensor: writes to a cache buffer reach both programs
            elif kept:
                local[name] = shards.local(fqn, model_state[fqn], strategy_out)
                if plan_node.kind == BUFFER:
                    local[name] = compute_buffer(local[name], compute_dtype)
            if kept:
                placements[fqn] = strategy_out
        else:
            assert plan_node is None or plan_node.kind == INPUT
            placeholders.append((name, "input", name))
    shards.release()
    transient = frozenset(f"{prefix}.{b}" if prefix else b for prefix, m in model.named_modules()
                          for b in m._non_persistent_buffers_set)
    return RankState(placeholders=placeholders, local=local, placements=placements, frozen=frozen,
                     transient=transient)


def rank_signature(step: PlannedStep, mesh: DeviceMesh, input_sharded: bool, batch_leaves: frozenset[int]
                   ) -> StepSignature:
    """How this rank's module is called: the captured signature, this rank's shard of each
    input with ``input_sharded``, cut into the plan's micro-batches."""
    signature = step.captured.signature
    if input_sharded:
        signature = _sharded_signature(signature, step.captured.user_inputs, step.chosen, mesh)
    m = step.plan.memory.micro_batches
    return signature.micro_batched(m, batch_leaves) if m > 1 else signature


def _sharded_signature(signature: StepSignature, user_inputs: list[str], chosen: dict[str, Strategy],
                       mesh: DeviceMesh) -> StepSignature:
    """The calls of a module whose ranks pass their own shards: each tensor input's shape is
    this rank's block of the captured (global) one under the input's planned placement,
    sliced as the program reads it."""
    shapes: dict[int, tuple[int, ...]] = {}
    for index, name in enumerate(user_inputs):  # one input placeholder per leaf, in order
        if index in signature.tensors and name in chosen:
            shape, dtype = signature.tensors[index]
            whole = torch.empty(shape, dtype=dtype, device="meta")
            shapes[index] = tuple(local_shard(whole, chosen[name].outputs[0], mesh).shape)
    return signature.sharded(shapes, " (this rank's shard of the global batch: input_sharded=True)")
