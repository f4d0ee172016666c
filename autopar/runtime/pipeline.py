"""A pipelined step: this rank's stages run by a ``torch.distributed.pipelining`` schedule.

The plan (``plan.pipeline``) names the stages; every rank builds the whole program for
its stage mesh (the mesh without the pipeline axis: ``stage_device_mesh``), cuts it into
stages (``passes.split_stages``) and keeps the ones its coordinate on the pipeline axis
holds, with their parameters only. Each is a ``PipelineStage`` on the pipeline axis's
process group; its own collectives (tensor parallelism, ZeRO gathers) run on the stage mesh,
among the ranks holding the same stage.

``pm.step(*inputs, *targets)`` on every rank: the inputs are cut into micro-batches as
``pm.step`` of ``runtime.microbatch`` cuts them (inputs whose leading dim is not the batch go
whole to every micro-batch), and each stage reads the user inputs it needs from the
micro-batch it runs (``runtime.stages.MicroBatchStage``): none is sent from stage to stage,
nor is a value of constants alone, which each later stage reading it computes again
(``passes.split_stages``, priced so: ``pipeline.crossing``). The last stage's loss of each
micro-batch is weighted exactly as ``runtime.microbatch`` weighs it and left as placed
(``runtime.pipeline_loss``). After the schedule, the gradients of this rank's parameters are
all-reduced over the stage mesh's data axes once, bucket by bucket as the plan lists them
(the pieces of each bucket this rank holds), those of weights tied across pp ranks (an
embedding the last stage's output head reuses) are summed with their other copies'
(``runtime.tied``), the last stage's ranks all-reduce the sum of their micro-batches' weighted
losses once, and the step's loss is broadcast from the last stage to every rank.

A forward-only step (``train=False``: a serving step, ``compile_serving``) is ``pm(*inputs)``:
one micro-batch through the stages in order on ``ScheduleGPipe`` built without a loss, which
torch runs forward only (``has_backward`` false: the same ``PipelineStage`` sends, no second
runtime); the last stage's outputs are then broadcast over the pipeline axis, so every rank
returns them, and each rank logs the sends and the broadcast it ran (``CollectiveLog.transfers``)
as the plan lists them (``PipelinePlan.forward_transfers``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor, Placement, Replicate

from autopar.capture.step import StepSignature
from autopar.cost.buckets import GradBucket
from autopar.errors import InputError
from autopar.passes.split_stages import split_stages
from autopar.runtime.module import copy_state_in, set_by_path
from autopar.runtime.grouped import check_grad_groups
from autopar.runtime.microbatch import restore_grads, stash_grads
from autopar.runtime.ops import CollectiveLog, Comm
from autopar.runtime.parameters import InitFn
from autopar.runtime.pipeline_loss import StepLoss, step_loss
from autopar.runtime.program import RankState, rank_program, rank_signature, rank_state, step_loss_kind
from autopar.runtime.random import RandomSource
from autopar.runtime.stages import MicroBatchStage, StageModule, StepDraws, ValueMeta, fake_shard, stage_metas
from autopar.runtime.stream import CounterStream
from autopar.runtime.tied import TiedGradients
from autopar.pipeline.crossing import constant_ops
from autopar.pipeline.spec import STAGE_AXIS, Pipeline
from autopar.result.plan import Plan
from autopar.search.planned import PlannedStep, schedule_refusal

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
                    "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
"""The torch schedule running each of ``pipeline.spec.SCHEDULES``."""


def stage_device_mesh(mesh: DeviceMesh, axis: str) -> DeviceMesh:
    """The mesh a stage's collectives run on: ``mesh`` without ``axis`` (a collective call on
    every rank). With no other axis, a mesh of this rank alone on one axis named ``STAGE_AXIS``."""
    names = tuple(mesh.mesh_dim_names or ())
    rest = tuple(n for n in names if n != axis)
    if rest:
        return mesh[rest]
    whole = DeviceMesh(mesh.device_type, mesh.mesh.unsqueeze(-1), mesh_dim_names=(*names, STAGE_AXIS))
    return whole[STAGE_AXIS]


def carved_device_mesh(mesh: DeviceMesh, axes: dict[str, int]) -> DeviceMesh:
    """``mesh``'s ranks laid out on ``axes`` (``Pipeline.carved``: a pipeline axis taken out of
    the first), rank order kept: a collective call on every rank."""
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(tuple(axes.values())), mesh_dim_names=tuple(axes))


class PipelinedModule(nn.Module):
    """This rank's stages of a pipelined step, trained with ``loss = pm.step(*inputs, *targets)``
    (compiled ``train=False``: outputs of a forward-only step with ``pm(*inputs)``).

    Parameters are this rank's stages' own (their shards on the stage mesh), registered under
    the model's FQNs; ``state_dict()`` gives them as DTensors on the stage mesh (a tied weight
    under each of its names, as the model's ``state_dict()`` has it)."""

    def __init__(self, *, plan: Plan, pipeline: Pipeline, device_mesh: DeviceMesh, stage_mesh: DeviceMesh,
                 comm: Comm, modules: list[StageModule], metas: list[tuple[list[ValueMeta], list[ValueMeta]]],
                 params: dict[str, nn.Parameter], fqns: dict[str, str], buffers: dict[str, torch.Tensor],
                 placements: dict[str, tuple[Placement, ...]], signature: StepSignature, loss: StepLoss | None,
                 loss_out: torch.dtype,
                 tied: TiedGradients, aliases: dict[str, str], transient: frozenset[str] = frozenset(),
                 outputs: list[ValueMeta] | None = None,
                 output_placements: list[tuple[Placement, ...] | None] | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.pipeline = pipeline
        self.device_mesh = device_mesh
        self.stage_mesh = stage_mesh
        self.signature = signature
        self._comm = comm
        self._placements = placements
        self._loss = loss  # None: a forward-only step
        self._loss_out = loss_out
        self._outputs = outputs or []  # a forward-only step's outputs (the last stage's), broadcast to every pp rank
        self._output_placements = output_placements or []
        self._params_by_node = params
        self._tied = tied
        self._aliases = aliases  # another FQN of a tied tensor -> the one it is registered under
        for name, param in params.items():
            set_by_path(self, fqns[name], param, buffer=False)
        for fqn, tensor in buffers.items():
            set_by_path(self, fqn, tensor, buffer=True, persistent=fqn not in transient)
        self.log: CollectiveLog | None = None
        self._build_schedule(modules, metas)

    def _build_schedule(self, modules: list[StageModule], metas: list[tuple[list[ValueMeta], list[ValueMeta]]]
                        ) -> None:
        axis = self.pipeline.axis
        group = self.device_mesh.get_group(axis)
        p = self.device_mesh.size(self.device_mesh.mesh_dim_names.index(axis))
        count = self.pipeline.stages(p)
        device = torch.device(self.device_mesh.device_type)
        object.__setattr__(self, "_modules_run", modules)  # not submodules: parameters keep the model's FQNs
        self._stages = [MicroBatchStage(m, m.index, count, device, input_args=tuple(x.example(device) for x in i),
                                        output_args=tuple(x.example(device) for x in o), group=group,
                                        after_backward=functools.partial(check_grad_groups, self._comm))
                        for m, (i, o) in zip(modules, metas)]
        cls = SCHEDULE_CLASSES[self.pipeline.schedule]
        single = self.pipeline.schedule in ("gpipe", "1f1b")
        # no loss function: torch's schedule runs forward only (``has_backward`` False; a serving step)
        self._schedule = cls(self._stages[0] if single else self._stages, n_microbatches=self.pipeline.micro_batches,
                             loss_fn=self._weigh if self._loss is not None else None, scale_grads=False)
        self._last_rank = self.pipeline.stage_rank(count - 1, p)
        self._group = group

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """A forward-only step (compiled ``train=False``, one micro-batch: a serving step): the
        stages in order, each stage's values sent point to point to the next stage's ranks by the
        schedule, then the last stage's outputs broadcast over the pipeline axis, so that every rank
        returns them: DTensors on the stage mesh, placed as planned (as ``ParallelModule`` returns)."""
        if self._loss is not None:
            raise InputError("a pipelined module trains with loss = pm.step(*inputs, *targets, **kwargs): a call of "
                             "one rank's stages is not the step")
        self._hand_inputs(inputs, kwargs)
        try:
            out = self._schedule.step(return_outputs=True)
        finally:
            self._drop_inputs()
        self._log_sends()
        wrapped = [DTensor.from_local(o, self.stage_mesh, p or (Replicate(),) * self.stage_mesh.ndim, run_check=False)
                   for o, p in zip(self._broadcast_outputs(out), self._output_placements)]
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def _hand_inputs(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Hand each of this rank's stages the step's user inputs, cut into micro-batches (every
        value checked on every rank); the schedule itself is handed none."""
        micro = self.signature.split(inputs, kwargs)  # checks every value as ParallelModule.step does
        if len(micro) != self.pipeline.micro_batches:
            raise RuntimeError(f"the step's inputs were cut into {len(micro)} micro-batches, the pipeline runs "
                               f"{self.pipeline.micro_batches}")
        for module in self._modules_run:
            module.set_inputs(micro)
            module.sent_bytes.clear()

    def _drop_inputs(self) -> None:
        """The step's inputs are not kept past it (the stages held its micro-batches)."""
        for module in self._modules_run:
            module.set_inputs([])

    def _log_sends(self) -> None:
        """Log each send this rank's stages ran to another rank (what each call returned)."""
        if self.log is None:
            return
        p = self.device_mesh.size(self.device_mesh.mesh_dim_names.index(self.pipeline.axis))
        for module in self._modules_run:
            after = module.index + 1
            if after < self.pipeline.stages(p) and self.pipeline.stage_rank(after, p) != \
                    self.pipeline.stage_rank(module.index, p):
                self.log.transfers.extend(("send", module.index, b) for b in module.sent_bytes)

    def _broadcast_outputs(self, out: Any) -> list[torch.Tensor]:
        """The last stage's outputs on every rank, broadcast from its rank over the pipeline axis
        (each rank receives the shard of the rank at its own place on the stage mesh)."""
        p = self.device_mesh.size(self.device_mesh.mesh_dim_names.index(self.pipeline.axis))
        last = self.pipeline.stages(p) - 1
        device = torch.device(self.device_mesh.device_type)
        if any(m.index == last for m in self._modules_run):
            values = [o.detach() for o in (out if isinstance(out, (tuple, list)) else [out])]
        else:
            values = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in self._outputs]
        for value in values:
            if self.log is not None and self.device_mesh.get_local_rank(self.pipeline.axis) == self._last_rank:
                self.log.transfers.append(("broadcast", last, value.numel() * value.element_size()))
            dist.broadcast(value, group=self._group, group_src=self._last_rank)
        return values

    def _weigh(self, output: Any, micro_batch: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss as the step weighs it (``runtime.pipeline_loss``); called by the
        schedule on the last stage right after that micro-batch's forward."""
        assert self._loss is not None
        loss = output[0] if isinstance(output, (tuple, list)) else output
        return self._loss.weigh(loss, self._last_count)

    def _last_count(self) -> torch.Tensor | None:
        """The count the last stage's loss divided by in the micro-batch it ran last."""
        return self._modules_run[-1].program.get_submodule("partial_mean_loss").last_count

    def step(self, *inputs: Any, **kwargs: Any) -> DTensor:
        """One training step on the whole batch: forward and backward of every micro-batch
        by the schedule, gradients added to ``.grad`` (as ``backward`` would) and synchronized
        over the data axes once; returns the step's loss on every rank (replicated, detached)."""
        if self._loss is None:
            raise InputError("pm.step trains: this module was compiled with train=False (call pm(...) for outputs)")
        self._hand_inputs(inputs, kwargs)
        params = [p for p in self.parameters() if p.requires_grad]
        stashed = stash_grads(params)
        self._loss.begin()
        losses: list[torch.Tensor] = []
        try:
            self._schedule.step(target=torch.arange(self.pipeline.micro_batches), losses=losses, return_outputs=False)
        finally:
            self._drop_inputs()
        self._comm.settle()  # gloo: nothing of the stages' left running beside the buckets (``runtime.ops``)
        reduce_buckets(self.plan.grad_buckets, self._params_by_node, self.stage_mesh, self.log)
        self._tied.reduce(self.log)
        shared = self._loss.shared(losses, self.log)
        dist.broadcast(shared, group=self._group, group_src=self._last_rank)
        restore_grads(stashed, shared[1])
        loss = self._loss.value(shared).to(self._loss_out)
        return DTensor.from_local(loss, self.device_mesh, (Replicate(),) * self.device_mesh.ndim, run_check=False)

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Any = None, **kwargs: Any
                  ) -> torch.optim.Optimizer:
        """``optimizer_class`` over this rank's parameters (its stages')."""
        return optimizer_class(self.parameters() if params is None else params, **kwargs)

    @property
    def stage_modules(self) -> list[StageModule]:
        """This rank's stages (what each sent in the last step: ``StageModule.sent_bytes``)."""
        return list(self._modules_run)

    def attach_log(self, log: CollectiveLog | None) -> None:
        """Record the stages' collectives and the gradient buckets' all-reduces."""
        self._comm.log = log
        self.log = log

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This rank's stages' parameters and (persistent) buffers, DTensors on the stage mesh."""
        out: dict[str, Any] = {}
        for fqn, tensor in nn.Module.state_dict(self, keep_vars=True).items():
            out[fqn] = DTensor.from_local(tensor.detach(), self.stage_mesh, self._placements[fqn], run_check=False)
        for alias, fqn in self._aliases.items():
            if fqn in out:
                out[alias] = out[fqn]
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> Any:
        """Copy this rank's stages' values in (other keys are other ranks'); DTensors are
        redistributed to this module's placements on the stage mesh first."""
        copy_state_in(self, state_dict, self.stage_mesh, self._placements, strict)
        return None


def reduce_buckets(buckets: list[GradBucket], params: dict[str, nn.Parameter], mesh: DeviceMesh,
                   log: CollectiveLog | None) -> None:
    """All-reduce (sum) the gradients this rank holds of each of the plan's buckets, one
    collective per bucket on its mesh dim (in fp32 at least, as ``GradSync`` reduces them).
    The ranks of one stage hold the same parameters, so they run the same collectives. A
    gradient the bucket holds whole, in its own dtype, becomes its region of the bucket (as
    ``GradSync`` hands them out: no copy back); a piece of one is copied back into it."""
    for bucket in buckets:
        pieces = [(params[s.param], s.start, s.stop) for s in bucket.slices if s.param in params]
        pieces = [(p, a, b) for p, a, b in pieces if p.grad is not None]
        if not pieces or mesh.size(bucket.mesh_dim) == 1:
            continue
        dtype = torch.promote_types(pieces[0][0].grad.dtype, torch.float32)
        flat = torch.cat([p.grad.reshape(-1)[a:b].to(dtype) for p, a, b in pieces])
        if log is not None:
            log.entries.append(("backward", "all_reduce", bucket.mesh_dim, flat.numel() * flat.element_size()))
        dist.all_reduce(flat, group=mesh.get_group(bucket.mesh_dim))
        offset = 0
        for p, a, b in pieces:
            region = flat[offset:offset + b - a]
            if b - a == p.numel() and p.grad.dtype == dtype:
                p.grad = region.view(p.shape)
            else:
                p.grad.view(-1)[a:b].copy_(region)
            offset += b - a


def build_pipelined_module(model: nn.Module, mesh: DeviceMesh, stage_mesh: DeviceMesh, step: PlannedStep,
                           pipeline: Pipeline, init_fn: InitFn | None, input_sharded: bool, init_seed: int,
                           seed: RandomSource, compute_dtype: torch.dtype | None, batch_leaves: frozenset[int],
                           shared: dict[str, torch.Tensor] | None = None) -> PipelinedModule:
    """This rank's stages of an agreed pipelined plan (module docstring); ``stage_mesh``:
    ``stage_device_mesh(mesh, pipeline.axis)``; other arguments as ``build_rank_module``'s
    (``shared``: state taken from another module, ``compile_serving``'s)."""
    pp = step.plan.pipeline
    assert pp is not None
    if step.plan.shard_buckets or step.plan.memory.offload:  # the memory search may choose them unpinned
        raise InputError("this pipelined plan shards optimizer state (ZeRO-1) or offloads it to the host, which a "
                         "pipelined step does not run yet: raise memory_limit, or pin zero= with stage 0, 2 or 3")
    kind = step_loss_kind(step)
    if kind is None and (pipeline.schedule != "gpipe" or pipeline.micro_batches != 1):
        raise InputError(f"a forward-only pipelined step (train=False) runs one micro-batch through the stages in "
                         f"order: pin Pipeline(schedule='gpipe', micro_batches=1), got {pipeline.schedule!r} with "
                         f"{pipeline.micro_batches} micro-batches")
    p = mesh.size(mesh.mesh_dim_names.index(pipeline.axis))
    count = pipeline.stages(p)
    mine = [s for s in range(count) if pipeline.stage_rank(s, p) == mesh.get_local_rank(pipeline.axis)]
    user_inputs = list(step.captured.user_inputs)
    comm = Comm(stage_mesh, step.ctx.mesh.zigzag_dims())
    refused = schedule_refusal(pipeline, step.plan.memory)
    if refused:
        raise InputError(f"this plan pipelines with {pipeline.schedule!r}, but {refused}")
    comm.weight_pass = pipeline.splits_backward
    program = rank_program(step, stage_mesh, comm, seed, compute_dtype, input_sharded, comm.weight_pass)
    constants = constant_ops(step.graph, step.chosen, step.ctx)
    programs = split_stages(program, pp.stage_of, count, user_inputs, constants)
    keep = {name for s in mine for name in programs[s].state}
    state = rank_state(model, stage_mesh, step, init_fn, init_seed, compute_dtype, keep=keep.__contains__,
                       shared=shared)
    signature = rank_signature(step, stage_mesh, input_sharded, batch_leaves)
    missing = [k for k in range(len(user_inputs)) if k not in signature.tensors]
    if missing:
        raise InputError(f"a pipelined step takes tensors only: inputs {missing} (in the order of pm.step's values) "
                         "are not")
    metas, draws = _metas(step, stage_mesh, len(programs), state, signature, seed, compute_dtype, input_sharded,
                          user_inputs, constants)
    stream = program.get_submodule("random").generator
    if not isinstance(stream, CounterStream) and _draws_random(program):
        raise InputError("a pipelined step with random ops (dropout) runs each stage's draws where the schedule puts "
                         "them, so only the counter stream draws them as one device does: leave random_stream at "
                         "'counter' (the default), or pin pipeline=False")
    step_draws = StepDraws(stream, sum(draws)) if isinstance(stream, CounterStream) and sum(draws) else None
    kinds = {name: (kind_, fqn) for name, kind_, fqn in state.placeholders}
    params = {n: _parameter(state.local[n], kinds[n][1] not in state.frozen) for n in keep if kinds[n][0] == "param"}
    modules = []
    for s in mine:
        tensors = [params[n] if n in params else state.local[n] for n in programs[s].state]
        regathers = any(n.op == "call_module" and n.target == "regather" for n in programs[s].gm.graph.nodes)
        slots = [user_inputs.index(name) for name in programs[s].user_inputs]  # one placeholder per leaf, in order
        starts = (step_draws, sum(draws[:s])) if step_draws is not None and draws[s] else None
        modules.append(StageModule(programs[s], tensors, slots, regathers, starts))
    loss_meta = step.graph.nodes[step.graph.loss].outputs[0] if step.graph.loss is not None else None
    loss = None if kind is None else step_loss(step, kind, pipeline.micro_batches, compute_dtype, stage_mesh)
    return PipelinedModule(
        plan=step.plan, pipeline=pipeline, device_mesh=mesh, stage_mesh=stage_mesh, comm=comm, modules=modules,
        metas=[metas[s] for s in mine], params=params, fqns={n: kinds[n][1] for n in params},
        buffers={kinds[n][1]: state.local[n] for n in keep if kinds[n][0] == "buffer"},
        placements=state.placements, transient=state.transient, signature=signature, loss=loss,
        tied=TiedGradients(pp.tied, mesh, pipeline.axis, params), aliases=step.captured.tied,
        loss_out=torch.float32 if compute_dtype is not None or loss_meta is None else loss_meta.dtype,
        outputs=metas[-1][1], output_placements=[step.chosen[n].outputs[0] if n in step.chosen else None
                                                 for n in step.graph.output_names])


def _draws_random(program: nn.Module) -> bool:
    """Whether the program (its checkpointed regions too) calls a random op."""
    return any(node.op == "call_module" and node.target == "random" for module in program.modules()
               if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes)


def _parameter(tensor: torch.Tensor, trains: bool) -> nn.Parameter:
    """A stage's parameter: a shared module's Parameter itself (``shared=``), else a new one."""
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=trains)


def _metas(step: PlannedStep, mesh: DeviceMesh, count: int, state: RankState, signature: StepSignature,
           seed: RandomSource, compute_dtype: torch.dtype | None, input_sharded: bool, user_inputs: list[str],
           constants: frozenset[str]) -> tuple[list[tuple[list[ValueMeta], list[ValueMeta]]], list[int]]:
    """Every stage's received and sent values and its random draws of one micro-batch
    (``runtime.stages.stage_metas``), found on a copy of the program built for the purpose (its
    modules' state is left behind)."""
    comm = Comm(mesh, step.ctx.mesh.zigzag_dims())
    program = rank_program(step, mesh, comm, seed, compute_dtype, input_sharded)
    stream = program.get_submodule("random").generator
    shapes = split_stages(program, step.plan.pipeline.stage_of, count, user_inputs, constants)
    fake: dict[str, Any] = {}
    for name, kind, fqn in state.placeholders:
        if kind == "input":
            continue
        if kind == "constant":
            value = step.captured.constants[name]
            shape, dtype = tuple(value.shape), value.dtype
        else:
            meta = step.graph.nodes[name].outputs[0]
            shape, dtype = meta.shape, meta.dtype
            if kind == "param" and compute_dtype is not None:
                dtype = torch.float32  # fp32 masters, cast where read
        placements = step.chosen[name].outputs[0] if name in step.chosen else None
        trains = kind == "param" and fqn not in state.frozen and step.ctx.train
        fake[name] = fake_shard(shape, dtype, placements, mesh, trains)
    inputs = {name: ValueMeta(shape=signature.tensors[k][0], dtype=signature.tensors[k][1], requires_grad=False)
              for k, name in enumerate(user_inputs)}
    return stage_metas(shapes, fake, inputs, torch.device(mesh.device_type),
                       lambda: stream.draws if isinstance(stream, CounterStream) else 0)
