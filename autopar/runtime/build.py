"""This rank's module for a finished plan: its program (``runtime.program``), its parameter shards
(``runtime.parameters``) and the step's signature, with no collectives (usable under a fake process
group to inspect the generated program)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_leaves

from autopar.problem.batch import example_batch
from autopar.runtime.module import ParallelModule
from autopar.runtime.ops import Comm
from autopar.runtime.parameters import InitFn
from autopar.runtime.program import rank_program, rank_signature, rank_state, step_loss_kind
from autopar.runtime.random import RandomSource
from autopar.search.planned import PlannedStep


def build_rank_module(model: nn.Module, mesh: DeviceMesh, step: PlannedStep, init_fn: InitFn | None = None,
                      input_sharded: bool = False, init_seed: int = 0, seed: RandomSource = RandomSource(0),
                      compute_dtype: torch.dtype | None = None, batch_leaves: frozenset[int] = frozenset(),
                      shared: dict[str, torch.Tensor] | None = None) -> ParallelModule:
    """This rank's ParallelModule for an agreed plan (no collectives: usable under a fake
    process group to inspect the generated program). With ``compute_dtype`` (mixed
    precision; the step captured from ``mixed.compute_copy``) the parameters stay
    ``model``'s fp32 masters and the program reads them cast (``passes.cast_parameters``).
    ``batch_leaves``: the step's input leaves cut into micro-batches (``whole_batch_leaves``);
    ``shared``: state taken from another module (``rank_state``)."""
    kind = step_loss_kind(step)  # refused before anything is built
    comm = Comm(mesh, step.ctx.mesh.zigzag_dims())
    program = rank_program(step, mesh, comm, seed, compute_dtype, input_sharded)
    state = rank_state(model, mesh, step, init_fn, init_seed, compute_dtype, shared=shared)
    outputs = []
    for out_name in step.graph.output_names:
        strategy = step.chosen.get(out_name)
        outputs.append(None if step.ctx.train or strategy is None else strategy.outputs[0])
    return ParallelModule(gm=program, plan=step.plan, device_mesh=mesh, comm=comm, placeholders=state.placeholders,
                          local=state.local, placements=state.placements, tied=step.captured.tied,
                          output_placements=outputs, input_sharded=input_sharded, frozen=state.frozen,
                          signature=rank_signature(step, mesh, input_sharded, batch_leaves), loss_kind=kind,
                          loss_dtype=torch.float32 if compute_dtype is not None and step.ctx.train else None,
                          transient=state.transient)


def whole_batch_leaves(inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: tuple[Any, ...]) -> frozenset[int]:
    """The step's leaves (in ``StepSignature`` order) whose leading dim is the batch: those
    ``micro_batches`` cuts (as ``memory.options.slice_batch`` cut the examples)."""
    batch = example_batch((inputs, kwargs, targets))
    leaves = tree_leaves((*inputs, *kwargs.values(), *targets))
    return frozenset(i for i, leaf in enumerate(leaves)
                     if isinstance(leaf, torch.Tensor) and leaf.ndim and leaf.shape[0] == batch)
