"""An optimizer that steps stand-ins of the module's parameters: the common part of
``OffloadedOptimizer`` (host copies) and ``ShardedStateOptimizer`` (ZeRO-1 chunks).

``param_groups`` hold the module's own parameters (what users, LR schedulers and
``checkpoint`` see); a wrapped ``optimizer_class`` holds, per parameter, its working copy
(``_working_copy``: the parameter itself, or a tensor standing in for it) with the same
hyperparameters, and its state; ``state`` maps each parameter to the wrapped state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer


class WorkingCopyOptimizer(Optimizer, ABC):
    """``optimizer_class`` over working copies of the parameters (see the module docstring).
    Subclasses set what ``_working_copy`` reads before calling this ``__init__``."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[Optimizer], **kwargs: Any) -> None:
        self._class = optimizer_class
        self._kwargs = kwargs
        self._inner: Optimizer | None = None
        self._working: dict[nn.Parameter, torch.Tensor] = {}  # parameter -> what the wrapped optimizer steps
        super().__init__(params, dict(kwargs))  # calls add_param_group per group
        assert self._inner is not None
        self.defaults = self._inner.defaults

    @abstractmethod
    def _working_copy(self, param: nn.Parameter) -> torch.Tensor:
        """What the wrapped optimizer steps for ``param``."""

    @abstractmethod
    def _step_working(self) -> None:
        """Step the wrapped optimizer over the working copies, moving what it needs in and out."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """``closure`` (with gradients on), then the working copies' step (``_step_working``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self._step_working()
        self._refresh_state()
        return loss

    @property
    def inner(self) -> Optimizer:
        """The wrapped optimizer (over the working copies)."""
        assert self._inner is not None
        return self._inner

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to both: the module's parameters here, their working copies in the
        wrapped optimizer, whose filled-in hyperparameters this group takes."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        working = []
        for p in group["params"]:
            self._working[p] = self._working_copy(p)
            working.append(self._working[p])
        inner_group = {**{k: v for k, v in group.items() if k != "params"}, "params": working}
        if self._inner is None:
            self._inner = self._class([inner_group], **self._kwargs)
        else:
            self._inner.add_param_group(inner_group)
        group.update({k: v for k, v in self._inner.param_groups[-1].items() if k != "params"})

    def _sync_hyperparameters(self) -> None:
        """Hyperparameters set on ``param_groups`` (an LR scheduler, by hand) reach the
        wrapped optimizer's groups: this object's groups are the ones users change."""
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    def _refresh_state(self) -> None:
        """``state`` keyed by the module's parameters, sharing the wrapped optimizer's dicts."""
        inner_state = self.inner.state
        self.state = defaultdict(dict, {p: inner_state[w] for p, w in self._working.items() if w in inner_state})

    def _load_inner(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer (which puts each state tensor beside its working
        copy) and take its hyperparameters back."""
        self.inner.load_state_dict(state_dict)
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})
        self._refresh_state()
