"""Tensors made by a factory (``zeros_like``, ``new_empty``) and then written in place, and
complex rotary embeddings (``view_as_complex`` / ``view_as_real``), compiled on gloo ranks
forked from this process, train to the single-device numbers: loss, every gradient (whole
tensors), every parameter after 3 AdamW steps.

Autograd differentiates through a write into a fresh buffer (``out[:, t] = f(w, x)``, a slice
``copy_``, ``index_put_``): the buffer's readers depend on the written values, so a parameter
reached only through such writes gets a gradient, and the plan must sync it. Complex tensors
carry gradients as floating ones do.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.api.planning import plan_step
from autopar.capture import capture
from autopar.runtime.forked import run_ranks
from autopar.errors import GradientPlanError
from autopar.runtime.gradient_check import autograd_trained, check_trained_parameters
from autopar.problem.nodes import PARAM
from numerics_harness import Reference, check, reference, run_compiled

DIM, SEQ, BATCH, CLASSES = 8, 4, 4, 4


class Scan(nn.Module):
    """A recurrent scan (RWKV's time mixing): each step's state written into a ``zeros_like``
    buffer, the only path by which ``k`` and ``decay`` reach the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(DIM, DIM)
        self.decay = nn.Parameter(torch.rand(DIM))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.k(x)
        out = torch.zeros_like(k)
        state = torch.zeros_like(k[:, 0])
        for t in range(x.shape[1]):
            state = state * torch.sigmoid(self.decay) + k[:, t]
            out[:, t] = state
        return self.head(out).mean(1)


class CopyExpand(nn.Module):
    """DeepSeek-V3's key expansion: a ``new_empty`` buffer filled by slice ``copy_`` from
    two projections, ``v`` reaching the loss only through the copies."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, DIM // 2)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, v = self.q(x), self.v(x)
        out = q.new_empty(q.shape)
        out[..., : DIM // 2].copy_(v)
        out[..., DIM // 2:].copy_(torch.tanh(v))
        return self.head(out * q).mean(1)


class IndexPut(nn.Module):
    """A buffer written through ``index_put_`` at fixed positions (a scatter of token states)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)
        self.register_buffer("at", torch.tensor([0, 2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], SEQ, DIM)
        out.zero_()
        out[:, self.at] = self.w(x[:, : len(self.at)])
        return self.head(out).mean(1)


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Llama's complex rotary embedding: pairs of features as complex numbers, rotated."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(-2).type_as(x)


class ComplexRotary(nn.Module):
    """Rotary embeddings as torchtitan's Llama, Llama-4 and DeepSeek-V2 write them: the angles
    made with ``torch.polar`` in forward, the queries rotated as complex numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.kv = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, DIM, 2).float() / DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), self.inv_freq)
        freqs = torch.polar(torch.ones_like(angles), angles)
        q, k = rotate(self.q(x), freqs), rotate(self.kv(x), freqs)
        scores = (q @ k.transpose(-1, -2)).softmax(-1)
        return self.head(scores @ x).mean(1)


MODELS = {"scan": Scan, "copy": CopyExpand, "index_put": IndexPut, "rotary": ComplexRotary}


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor], Any, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = MODELS[name]()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM, generator=gen)
    return model, (x,), F.cross_entropy, (torch.randint(0, CLASSES, (BATCH,), generator=gen),)


MESHES = {"dp2": ((2,), ("dp",)), "2x2": ((2, 2), ("dp", "tp"))}
CASES = [(model, mesh) for model in MODELS for mesh in MESHES]


def train_on_rank(rank: int, world: int, name: str, mesh: str, ref: Reference) -> dict[str, Any]:
    shape, names = MESHES[mesh]
    model, inputs, loss_fn, targets = build(name)
    pm = autopar.compile(model, init_device_mesh("cpu", shape, mesh_dim_names=names), inputs, loss_fn=loss_fn,
                         example_targets=targets, data_axes=("dp",), pipeline=False)
    return run_compiled(pm, (*inputs, *targets), ref)


@pytest.mark.parametrize(("name", "mesh"), CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_writes_into_fresh_buffers_match_single_device(name: str, mesh: str) -> None:
    ref = reference(lambda: build(name))
    check(run_ranks(train_on_rank, math.prod(MESHES[mesh][0]), name, mesh, ref), ref)


@pytest.mark.parametrize("name", list(MODELS))
def test_plan_trains_every_parameter_autograd_reaches(name: str) -> None:
    """Every parameter gets a gradient on one device, so the plan trains (and syncs) all of them."""
    model, inputs, loss_fn, targets = build(name)
    step = plan_step(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     data_axes=("dp",))
    trainable = {n.fqn for n in step.graph.nodes.values() if n.kind == PARAM and n.needs_grad}
    assert trainable == {k for k, _ in model.named_parameters()}
    complex_ops = ("view_as_complex", "view_as_real", "polar")
    assert not [f.op for f in step.plan.fallbacks if any(op in f.op for op in complex_ops)], "complex ops have rules"


class Detached(nn.Module):
    """Parameters that autograd gives no gradient: one reached through ``detach`` only, one frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)
        self.b.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.a(x).detach() + self.b(x)).mean(1)


def test_autograd_trained_follows_writes_and_skips_detached() -> None:
    model, inputs, loss_fn, targets = build("scan")
    assert autograd_trained(capture(model, inputs, loss_fn=loss_fn, example_targets=targets)) == \
        {k for k, _ in model.named_parameters()}
    model = Detached()
    assert autograd_trained(capture(model, inputs, loss_fn=loss_fn, example_targets=targets)) == \
        {"head.weight", "head.bias"}


def test_a_parameter_the_plan_does_not_sync_is_an_error() -> None:
    """Where the gradient analysis misses a path autograd takes, compile refuses the plan
    instead of leaving that parameter's replicas to drift apart."""
    model, inputs, loss_fn, targets = build("scan")
    step = plan_step(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     data_axes=("dp",))
    check_trained_parameters(step.captured, step.graph)
    decay = next(n for n in step.graph.nodes.values() if n.fqn == "decay")
    decay.needs_grad = False  # as main's analysis had it
    with pytest.raises(GradientPlanError, match="plan does not sync: decay"):
        check_trained_parameters(step.captured, step.graph)
