"""Optimizer state in host memory: any torch optimizer stepping host copies of the
parameters a plan offloads (``MemoryPlan.offload``), as DeepSpeed's ZeRO-Offload and
FSDP2's ``CPUOffloadPolicy`` do.

``pm.optimizer(torch.optim.AdamW, lr=1e-3)`` (or ``offloaded_optimizer(pm, ...)``) returns an
``OffloadedOptimizer`` whatever the plan offloads, so one training loop serves every plan:

    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    loss = pm(tokens, targets); loss.backward(); opt.step(); opt.zero_grad()

Each offloaded parameter has a host master copy (fp32 by default: a bf16 model's update
runs in fp32, ZeRO-Offload's mixed-precision scheme) and a host gradient buffer; the
wrapped optimizer steps the host copies, so every state tensor it creates (Adam's m and v)
is allocated on the host, like them. A step copies each gradient device -> host, waits
for those copies, steps, and copies the updated weights host -> device (asynchronous:
the host buffers are pinned when CUDA is present, and the next step's wait on its own
device -> host copies orders them before the buffers change again). Parameters the plan
keeps on the device are stepped in place by the same wrapped optimizer.

``param_groups`` hold the module's own parameters, ``state`` maps each of them to the
wrapped optimizer's state of its working copy (host tensors for offloaded ones), so
``state_dict``/``load_state_dict`` have the wrapped optimizer's layout and
``autopar.runtime.checkpoint.save/load`` and torch's ``get/set_optimizer_state_dict``
key it by parameter FQN as for a plain optimizer: a checkpoint moves between offloaded
and plain runs. On a CPU mesh the host copies are separate CPU tensors, so the code path
is the one a GPU runs, without pinning.

The master copy is what an update starts from: writes to an offloaded parameter in place
under ``no_grad`` (the module's ``load_state_dict``, a checkpoint load) are noticed by the
tensor's version counter and taken into the master copy at the next step; writes through
``param.data`` bypass that counter and are lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from autopar.runtime.wrapped_optimizer import WorkingCopyOptimizer

HOST = torch.device("cpu")


class _HostCopy:
    """One offloaded parameter's host tensors: master weights (the wrapped optimizer's
    parameter), its gradient, and staging buffers in the device dtype when that differs."""

    def __init__(self, param: nn.Parameter, master_dtype: torch.dtype | None, pin: bool) -> None:
        dtype = master_dtype if master_dtype is not None and param.is_floating_point() else param.dtype
        self.param = param
        self.master = _host_empty(param, dtype, pin)
        with torch.no_grad():
            self.master.copy_(param.detach())
        self.master.requires_grad_(param.requires_grad)
        self.grad = _host_empty(param, dtype, pin)
        # device-dtype staging: copies over the link carry the device's bytes (bf16), the
        # cast to and from the master dtype runs on the host
        self.staging = _host_empty(param, param.dtype, pin) if dtype != param.dtype else None
        self.non_blocking = pin
        self.version = param._version  # the device weights the master copy was last in step with

    def refresh_if_changed(self) -> None:
        """Take the device weights into the master copy when something wrote them in place
        since the last step (``load_state_dict`` of the module, a checkpoint load, manual
        re-initialization under ``no_grad``): the master copy, not the device tensor, is
        what the update starts from."""
        if self.param._version != self.version:
            self.master.detach().copy_(self.param.detach())
            self.version = self.param._version

    def to_host(self) -> bool:
        """Start copying the gradient to the host; False when the parameter has none."""
        grad = self.param.grad
        if grad is None:
            self.master.grad = None
            return False
        (self.staging if self.staging is not None else self.grad).copy_(grad, non_blocking=self.non_blocking)
        self.master.grad = self.grad
        return True

    def after_wait(self) -> None:
        """The gradient is on the host: cast it to the master dtype where it was staged."""
        if self.staging is not None and self.master.grad is not None:
            self.grad.copy_(self.staging)

    def to_device(self) -> None:
        """Start copying the updated master weights back into the device parameter."""
        source = self.master.detach()
        if self.staging is not None:
            self.staging.copy_(source)
            source = self.staging
        with torch.no_grad():
            self.param.copy_(source, non_blocking=self.non_blocking)
        self.version = self.param._version


def _host_empty(like: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=dtype, device=HOST, pin_memory=pin)


class OffloadedOptimizer(WorkingCopyOptimizer):
    """``optimizer_class(params, **kwargs)`` with the state of the ``offload`` parameters
    (and their master weights, in ``master_dtype``; None: the parameter's dtype) in host
    memory, stepped there. ``pin_memory`` (default: CUDA is present) pins the host buffers
    so the copies run asynchronously."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[Optimizer], *,
                 offload: Iterable[nn.Parameter] = (), master_dtype: torch.dtype | None = torch.float32,
                 pin_memory: bool | None = None, **kwargs: Any) -> None:
        self._offload_ids = {id(p) for p in offload}
        self._master_dtype = master_dtype
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._host: dict[nn.Parameter, _HostCopy] = {}  # offloaded parameter -> its host tensors
        super().__init__(params, optimizer_class, **kwargs)

    @property
    def offloaded(self) -> list[nn.Parameter]:
        """The parameters whose state lives in host memory."""
        return list(self._host)

    def host_copy(self, param: nn.Parameter) -> torch.Tensor | None:
        """The host master copy the wrapped optimizer steps for ``param`` (None: kept on device)."""
        copy = self._host.get(param)
        return copy.master if copy is not None else None

    def _working_copy(self, param: nn.Parameter) -> torch.Tensor:
        if id(param) in self._offload_ids and param.requires_grad:
            self._host[param] = _HostCopy(param, self._master_dtype, self._pin)
            return self._host[param].master
        return param

    def _step_working(self) -> None:
        """Gradients to the host, the wrapped optimizer's step, weights back to the device."""
        for copy in self._host.values():
            copy.refresh_if_changed()
        moved = [copy for copy in self._host.values() if copy.to_host()]
        self._wait_for_copies(moved)
        for copy in moved:
            copy.after_wait()
        self.inner.step()
        for copy in moved:
            copy.to_device()

    def _wait_for_copies(self, moved: list[_HostCopy]) -> None:
        """Block until the device -> host gradient copies have landed (non-blocking copies
        return before the data does); on a CPU mesh they are already done."""
        devices = {c.param.device for c in moved if c.param.device.type == "cuda"}
        for device in devices:
            torch.cuda.current_stream(device).synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The module's gradients, as the wrapped optimizer would (host buffers are
        overwritten by the next step, and unused while the device gradient is None)."""
        super().zero_grad(set_to_none=set_to_none)
        for copy in self._host.values():
            copy.master.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict with this object's hyperparameters: the same
        layout (parameters numbered in group order) as the optimizer run without offload."""
        self._sync_hyperparameters()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer, which puts each state tensor beside its working
        copy: on the host, in the master dtype, for offloaded parameters."""
        self._load_inner(state_dict)


def offloaded_optimizer(module: nn.Module, planned: list[str], tied: dict[str, str],
                        optimizer_class: type[Optimizer], params: Iterable[Any] | None = None,
                        *, offload: Iterable[str] | None = None, **kwargs: Any) -> OffloadedOptimizer:
    """An optimizer over ``params`` (default: ``module``'s parameters) that keeps the state of
    the parameters named in ``offload`` (default: ``planned``, the plan's ``memory.offload``; a tied
    name as ``tied`` maps it) in host memory. ``kwargs`` go to ``optimizer_class`` (and
    ``master_dtype``/``pin_memory`` to ``OffloadedOptimizer``)."""
    names = planned if offload is None else list(offload)
    chosen = [module.get_parameter(tied.get(fqn, fqn)) for fqn in names]
    return OffloadedOptimizer(module.parameters() if params is None else params, optimizer_class,
                              offload=chosen, **kwargs)
