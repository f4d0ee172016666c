"""ParallelModule: one rank's program, its parameter shards under the model's own names."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from autopar.runtime.random import Stream
from autopar.capture.step import StepSignature
from autopar.errors import InputError
from autopar.runtime.microbatch import run_micro_batches
from autopar.runtime.offload import offloaded_optimizer
from autopar.runtime.ops import CollectiveLog, Comm
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.located import ProgramLocator
from autopar.runtime.parameters import local_shard
from autopar.runtime.regather import regather_hooks
from autopar.runtime.zero1 import ZeroOneShards
from autopar.runtime.zero1_optimizer import ShardedStateOptimizer
from autopar.rules.redistribute import redistribute_steps
from autopar.result.plan import Plan


def set_by_path(root: nn.Module, fqn: str, value: nn.Parameter | torch.Tensor, *, buffer: bool,
                persistent: bool = True) -> None:
    """Register ``value`` at ``fqn``, creating empty modules on the way (a buffer in ``state_dict()``
    only if ``persistent``, as the model registered it)."""
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if buffer:
        module.register_buffer(leaf, value, persistent=persistent)
    else:
        module.register_parameter(leaf, value)  # type: ignore[arg-type]


class ParallelModule(nn.Module):
    """Runs the compiled step on this rank.

    ``pm(*inputs, *targets, **kwargs)`` (the model's positional inputs, the loss targets, and
    the model's keyword inputs by name, as compiled) returns the loss as a replicated DTensor
    (training) or the model's outputs as DTensors placed as planned (``train=False``). Each
    tensor has the shape and dtype compiled (this rank's shard with ``input_sharded``): the
    program is specialized on them, and another shape is refused by name.
    ``pm.step(...)`` (training) takes the same values and runs a whole step: forward and
    backward of each of the plan's micro-batches, gradients synchronized once; it is the
    only way to run a module compiled with ``micro_batches > 1`` (see ``step``).
    Parameters are this rank's shards, registered under the original FQNs; ``state_dict()``
    returns DTensors. In mixed precision they are the fp32 masters (the program reads bf16
    casts), floating buffers are kept in bf16, and the loss comes back in fp32.
    """

    def __init__(self, *, gm: torch.fx.GraphModule, plan: Plan, device_mesh: DeviceMesh, comm: Comm,
                 placeholders: list[tuple[str, str, str]], local: dict[str, torch.Tensor],
                 placements: dict[str, tuple[Placement, ...]], tied: dict[str, str],
                 output_placements: list[tuple[Placement, ...] | None], input_sharded: bool,
                 frozen: frozenset[str], signature: StepSignature, loss_kind: str | None,
                 loss_dtype: torch.dtype | None = None, transient: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.plan = plan
        self.device_mesh = device_mesh
        self.input_sharded = input_sharded
        object.__setattr__(self, "program", gm)  # not a submodule: keeps parameter names the model's own
        self._comm = comm
        self._placeholders = placeholders  # (placeholder name, kind, fqn)
        self._placements = placements  # FQN -> placements
        self._tied = tied
        self._outputs = output_placements
        self.signature = signature
        self._loss_kind = loss_kind  # how micro-batch losses combine (microbatch.py); None: no training step
        self._loss_dtype = loss_dtype  # mixed precision: the bf16 loss returned as fp32, as the fp32 model's
        params_by_node: dict[str, nn.Parameter] = {}
        self._constants: dict[str, torch.Tensor] = {}
        for name, kind, fqn in placeholders:
            if kind == "param":
                param = nn.Parameter(local[name], requires_grad=fqn not in frozen)
                set_by_path(self, fqn, param, buffer=False)
                params_by_node[name] = param
            elif kind == "buffer":
                set_by_path(self, fqn, local[name], buffer=True, persistent=fqn not in transient)
            elif kind == "constant":
                self._constants[name] = local[name]
        self._params_by_node = params_by_node
        self._locator = ProgramLocator(gm)  # errors of the program told with the node they arose at
        # ZeRO-3: saved gathered parameters are swapped for handles and gathered again in backward
        self._regathers = any(n.op == "call_module" and n.target == "regather" for n in gm.graph.nodes)
        self.grad_sync = GradSync(plan.grad_buckets, params_by_node, device_mesh, comm)
        self.zero1 = ZeroOneShards(plan.shard_buckets, params_by_node, device_mesh, comm.settle,
                                   reduced_elsewhere=(n for b in plan.grad_buckets for n in b.params))
        self._zero1_stepper = False  # pm.optimizer made a ZeRO-1 optimizer: the only one that syncs those gradients

    @property
    def generator(self) -> Stream:
        """The stream the step's random ops draw from (``runtime.random``: a ``CounterStream``,
        or with ``random_stream='torch'`` a torch generator), in the same state on every rank
        (``get_state``/``set_state`` it to save or restore the random stream)."""
        return self.program.get_submodule("random").generator

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Any = None, **kwargs: Any
                  ) -> torch.optim.Optimizer:
        """``optimizer_class(params or self.parameters(), **kwargs)`` with the optimizer state of
        the parameters the plan offloads (``plan.memory.offload``) in host memory, stepped
        there, or, for ZeRO-1 parameters (``plan.memory.zero1``), of this rank's chunk only,
        their gradients reduce-scattered and chunks all-gathered by its step; the same
        training loop runs whatever the plan (``autopar.runtime.offload``, ``runtime.zero1``)."""
        if not self.zero1.chunks:
            return offloaded_optimizer(self, self.plan.memory.offload, self._tied, optimizer_class,
                                       params, **kwargs)
        if kwargs.get("offload"):
            raise InputError("this plan shards optimizer state (ZeRO-1, plan.memory.zero1): it does not also "
                             "offload it to the host")
        kwargs.pop("offload", None)
        optimizer = ShardedStateOptimizer(self.parameters() if params is None else params, optimizer_class,
                                          shards=self.zero1, **kwargs)
        self._zero1_stepper = True
        return optimizer

    def attach_log(self, log: CollectiveLog | None) -> None:
        """Record every collective this module runs (for checking them against the plan)."""
        self._comm.log = log
        self.grad_sync.log = log
        self.zero1.log = log

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        m = self.signature.micro_batches
        if m > 1:  # a call would run one micro-batch, with a loss that is not the step's
            raise InputError(f"this module was compiled with micro_batches={m}: a call would run one micro-batch "
                             "of the step, not the step; train with loss = pm.step(*inputs, *targets, **kwargs), "
                             "which takes the whole batch and runs forward and backward of every micro-batch")
        return self._wrap(self._run(self.signature.bind(inputs, kwargs)))

    def step(self, *inputs: Any, **kwargs: Any) -> DTensor:
        """One training step on the whole batch (this rank's data shard with ``input_sharded``),
        called as ``pm(...)``: every tensor whose leading dim is the batch is cut into the
        plan's micro-batches (``plan.memory.micro_batches``; other values go whole to each),
        each runs forward and backward in turn, gradients accumulate and are synchronized
        once, after the last (gradients already in ``.grad`` are added to, as by
        ``backward``). Loss and gradients are the whole batch's (a mean loss weighs each
        micro-batch by its share of the counted elements). Returns the step's loss, a
        replicated DTensor, detached: call ``opt.step()`` next, not ``backward``."""
        if self._loss_kind is None:
            raise InputError("pm.step trains: this module was compiled with train=False (call pm(...) for outputs)")
        params = [p for p in self.parameters() if p.requires_grad]
        counter = self.program.get_submodule("partial_mean_loss")
        loss = run_micro_batches(lambda leaves: self._run(leaves)[0], self.signature.split(inputs, kwargs),
                                 self._loss_kind, self.grad_sync, params, lambda: counter.last_count,
                                 self._locator.backward)
        return self._wrap([loss])

    def _run(self, user: list[Any]) -> list[Any]:
        """The program on the leaves of one call (one per input placeholder, in order): local outputs."""
        if self.zero1.chunks and not self._zero1_stepper:
            raise InputError("this plan shards the optimizer state of some parameters (ZeRO-1, plan.memory.zero1): "
                             "their gradients are reduced by the optimizer's step, so create it with "
                             "pm.optimizer(torch.optim.AdamW, ...) before training (a plain optimizer would "
                             "step unreduced gradients)")
        leaves = iter(user)
        values: list[Any] = []
        for name, kind, fqn in self._placeholders:
            if kind == "input":
                values.append(next(leaves))
            elif kind == "constant":
                values.append(self._constants[name])
            else:
                values.append(self.get_parameter(fqn) if kind == "param" else self.get_buffer(fqn))
        with regather_hooks() if self._regathers else contextlib.nullcontext():
            outputs = list(self._locator.forward(self.program, values))
        if self._loss_dtype is not None:
            outputs = [outputs[0].to(self._loss_dtype), *outputs[1:]]
        return outputs

    def _wrap(self, outputs: list[Any]) -> Any:
        """Local outputs as DTensors placed as planned (the loss: replicated); an output split
        on a zig-zag axis (``Mesh.zigzag``) is gathered there first, as a DTensor's shards are
        contiguous chunks (the step's last forward collective, as the plan lists and prices it:
        ``problem.graph.zigzag_output_gathers``)."""
        wrapped = []
        for o, placements in zip(outputs, self._outputs):
            if not isinstance(o, torch.Tensor):
                wrapped.append(o)
                continue
            placements = placements or (Replicate(),) * self.device_mesh.ndim
            whole = tuple(Replicate() if i in self._comm.zigzag and p.is_shard() else p
                          for i, p in enumerate(placements))
            if whole != tuple(placements):
                o = self._comm.run(o, redistribute_steps(tuple(placements), whole), "forward")
            wrapped.append(DTensor.from_local(o, self.device_mesh, whole, run_check=False))
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """DTensors under the original model's keys (tied aliases included; non-persistent
        buffers left out, as the model's ``state_dict()`` leaves them out)."""
        out: dict[str, Any] = {}
        for fqn, tensor in nn.Module.state_dict(self, keep_vars=True).items():
            out[fqn] = DTensor.from_local(tensor.detach() if isinstance(tensor, nn.Parameter) else tensor,
                                          self.device_mesh, self._placements[fqn], run_check=False)
        for alias, fqn in self._tied.items():
            if fqn in out:
                out[alias] = out[fqn]
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Copy values in; DTensors are redistributed to this module's placements first."""
        copy_state_in(self, state_dict, self.device_mesh, self._placements, strict)
        return None


def copy_state_in(module: nn.Module, state_dict: dict[str, Any], mesh: DeviceMesh,
                  placements: dict[str, tuple[Placement, ...]], strict: bool) -> None:
    """Copy ``state_dict``'s values into ``module``'s local shards (parameters and buffers by
    FQN; persistent buffers only, as ``state_dict()`` gives them), each DTensor redistributed to
    ``placements[fqn]`` on ``mesh`` and each whole tensor cut to this rank's shard; keys
    ``module`` does not hold are left alone (another rank's)."""
    own = nn.Module.state_dict(module, keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    if strict and missing:
        raise KeyError(f"missing keys: {missing}")
    with torch.no_grad():
        for fqn, tensor in own.items():
            if fqn not in state_dict:
                continue
            value = state_dict[fqn]
            if isinstance(value, DTensor):
                value = value.redistribute(mesh, placements[fqn]).to_local()
            elif value.shape != tensor.shape:
                value = local_shard(value, placements[fqn], mesh)
            tensor.copy_(value)
