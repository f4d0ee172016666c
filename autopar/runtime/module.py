"""ParallelModule: one rank's program, its parameter shards under the model's own names."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from autopar.capture.step import StepSignature
from autopar.runtime.ops import CollectiveLog, Comm
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.parameters import local_shard
from autopar.runtime.regather import regather_hooks
from autopar.solver.plan import Plan


def _set_by_path(root: nn.Module, fqn: str, value: nn.Parameter | torch.Tensor, *, buffer: bool) -> None:
    """Register ``value`` at ``fqn``, creating empty modules on the way."""
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if buffer:
        module.register_buffer(leaf, value, persistent=True)
    else:
        module.register_parameter(leaf, value)  # type: ignore[arg-type]


class ParallelModule(nn.Module):
    """Runs the compiled step on this rank.

    ``pm(*inputs, *targets, **kwargs)`` (the model's positional inputs, the loss targets, and
    the model's keyword inputs by name, as compiled) returns the loss as a replicated DTensor
    (training) or the model's outputs as DTensors placed as planned (``train=False``). Each
    tensor has the shape and dtype compiled (this rank's shard with ``input_sharded``): the
    program is specialized on them, and another shape is refused by name.
    Parameters are this rank's shards, registered under the original FQNs; ``state_dict()``
    returns DTensors. In mixed precision they are the fp32 masters (the program reads bf16
    casts), floating buffers are kept in bf16, and the loss comes back in fp32.
    """

    def __init__(self, *, gm: torch.fx.GraphModule, plan: Plan, device_mesh: DeviceMesh, comm: Comm,
                 placeholders: list[tuple[str, str, str]], local: dict[str, torch.Tensor],
                 placements: dict[str, tuple[Placement, ...]], tied: dict[str, str],
                 output_placements: list[tuple[Placement, ...] | None], input_sharded: bool,
                 frozen: frozenset[str], signature: StepSignature, loss_dtype: torch.dtype | None = None) -> None:
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
        self._loss_dtype = loss_dtype  # mixed precision: the bf16 loss returned as fp32, as the fp32 model's
        params_by_node: dict[str, nn.Parameter] = {}
        self._constants: dict[str, torch.Tensor] = {}
        for name, kind, fqn in placeholders:
            if kind == "param":
                param = nn.Parameter(local[name], requires_grad=fqn not in frozen)
                _set_by_path(self, fqn, param, buffer=False)
                params_by_node[name] = param
            elif kind == "buffer":
                _set_by_path(self, fqn, local[name], buffer=True)
            elif kind == "constant":
                self._constants[name] = local[name]
        self._params_by_node = params_by_node
        # ZeRO-3: saved gathered parameters are swapped for handles and gathered again in backward
        self._regathers = any(n.op == "call_module" and n.target == "regather" for n in gm.graph.nodes)
        self.grad_sync = GradSync(plan.grad_buckets, params_by_node, device_mesh)

    @property
    def generator(self) -> torch.Generator:
        """The generator the step's random ops draw from, in the same state on every rank
        (``get_state``/``set_state`` it to save or restore the random stream)."""
        return self.program.get_submodule("random").generator

    def attach_log(self, log: CollectiveLog | None) -> None:
        """Record every collective this module runs (for checking them against the plan)."""
        self._comm.log = log
        self.grad_sync.log = log

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        user = iter(self.signature.bind(inputs, kwargs))  # one value per input placeholder, in order
        values: list[Any] = []
        for name, kind, fqn in self._placeholders:
            if kind == "input":
                values.append(next(user))
            elif kind == "constant":
                values.append(self._constants[name])
            else:
                values.append(self.get_parameter(fqn) if kind == "param" else self.get_buffer(fqn))
        with regather_hooks() if self._regathers else contextlib.nullcontext():
            outputs = self.program(*values)
        if self._loss_dtype is not None:
            outputs = [outputs[0].to(self._loss_dtype), *outputs[1:]]
        wrapped = [DTensor.from_local(o, self.device_mesh, placements or (Replicate(),) * self.device_mesh.ndim,
                                      run_check=False) if isinstance(o, torch.Tensor) else o
                   for o, placements in zip(outputs, self._outputs)]
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """DTensors under the original model's keys (tied aliases included)."""
        out: dict[str, Any] = {}
        for fqn, tensor in list(self.named_parameters()) + list(self.named_buffers()):
            out[fqn] = DTensor.from_local(tensor.detach() if isinstance(tensor, nn.Parameter) else tensor,
                                          self.device_mesh, self._placements[fqn], run_check=False)
        for alias, fqn in self._tied.items():
            if fqn in out:
                out[alias] = out[fqn]
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Copy values in; DTensors are redistributed to this module's placements first."""
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        missing = [k for k in own if k not in state_dict]
        if strict and missing:
            raise KeyError(f"missing keys: {missing}")
        with torch.no_grad():
            for fqn, tensor in own.items():
                if fqn not in state_dict:
                    continue
                value = state_dict[fqn]
                if isinstance(value, DTensor):
                    value = value.redistribute(self.device_mesh, self._placements[fqn]).to_local()
                elif value.shape != tensor.shape:
                    value = local_shard(value, self._placements[fqn], self.device_mesh)
                tensor.copy_(value)
        return None
