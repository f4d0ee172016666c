"""What an eager PyTorch step runs beside its ops' own kernels, priced against hand-computed figures
(issue 31.2): the fp32 a model's code upcasts to under mixed precision, ..."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.hardware import get_profile

H100 = get_profile("h100")
BANDWIDTH = H100.memory_bandwidth * H100.memory_efficiency
"""Bytes/s a memory-bound kernel reaches on the h100 profile."""


class Upcast(nn.Module):
    """A linear whose output the model squares in fp32, as an eager RMSNorm does (``h = x.float()``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x).float().pow(2)


def test_plan_prices_a_floats_upcast_at_fp32_as_compile_runs_it() -> None:
    """``autopar.plan`` of an fp32 model in bf16 captures its bf16 compute copy, as ``compile`` does:
    the ``pow`` of ``x.float()`` reads and writes 4096 x 4096 fp32 elements, 2 x 64 MiB, not bf16's
    2 x 32 MiB (its forward: 134.2 MB / 2.98 TB/s = 45.0 us)."""
    d = 4096
    with torch.device("meta"):
        model, x = Upcast(d), torch.zeros(d, d)
    plan = autopar.plan(model, autopar.Mesh({"dp": 1}, "h100"), (x,), loss_fn=lambda y: y.sum(), pipeline=False)
    pow_node = next(n for n in plan.nodes if n.op == "aten.pow.Tensor_Scalar")
    assert pow_node.forward_s == pytest.approx(2 * 4 * d * d / BANDWIDTH, rel=1e-9)
    assert 2 * 4 * d * d / BANDWIDTH == pytest.approx(45.0e-6, rel=1e-3)
