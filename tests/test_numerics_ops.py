"""Masking, in-place, scan, pad and gather ops (T5's and HF's) compiled on gloo ranks forked
from this process train to the single-device numbers: loss, every gradient (whole
tensors), every parameter after 3 AdamW steps; and the collectives a step runs are the
plan's.

In-place ops are kept by export's training IR. The plan must write where the
single-device program writes: into the tensor as produced (a reshard before a write
would write a copy, and T5's shift would lose its labels), and a tensor read again after
a write must not reuse a reshard made of it before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics_harness import Reference, reference, run_compiled, run_checked
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar

VOCAB, BATCH, SEQ = 32, 4, 8


class MaskedOps(nn.Module):
    """where / masked_fill (scalar and in place) / diff / pad / index / copy_ into a view /
    fill_ through a view, on activations that stay batch-split under data parallelism."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        keep = tokens != 0
        h = self.fc(self.embed(tokens))
        h = h + torch.diff(h, dim=1, prepend=h[:, :1])
        h = torch.where(keep[..., None], h, 0.0)
        h = F.pad(h, (0, 0, 1, 0))[:, :-1]
        y = h + h[:, torch.arange(s - 1, -1, -1, device=h.device)]  # index.Tensor(h, [None, rev])
        y.masked_fill_(~keep[..., None], 0.0)
        out = y.clone()
        out[:, 1:].copy_(y[:, :-1])  # copy_ into a view of an activation
        out[:, 0].fill_(0.5)  # fill_ through another view of it
        return self.head(out)


class ShiftRight(nn.Module):
    """T5's ``_shift_right``: decoder inputs built in place in a fresh tensor."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        shifted = tokens.new_zeros(tokens.shape)
        shifted[..., 1:] = tokens[..., :-1].clone()
        shifted[..., 0] = 2
        shifted.masked_fill_(shifted == 5, 1)
        return self.head(self.embed(shifted))


class ReadWriteRead(nn.Module):
    """Reads an activation in a way that needs a reshard, writes into it through a view,
    and reads it again the same way: the second read needs a reshard of its own."""

    def __init__(self, dim: int = 512) -> None:  # wide enough that the planner splits the fc
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        buf = self.fc(self.embed(tokens))
        before = buf.cumsum(0)  # needs the batch dim whole
        buf[:, 0].fill_(0.0)
        after = buf.cumsum(0)
        return self.head(before + after)


class T5Step(nn.Module):
    """HF's T5 (tiny, no dropout) reconstructing its input: the labels go through T5's own
    ``_shift_right`` (copy_ into a slice, fill_, masked_fill_) and the decoder attention
    concatenates its empty KV cache (a legacy (0,) tensor) to k and v."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration  # a dev dependency

        cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                       num_heads=4, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
        self.t5 = T5ForConditionalGeneration(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=tokens, labels=tokens).logits


MODELS: dict[str, tuple[Callable[[], nn.Module], int, int]] = {
    "masked_ops": (MaskedOps, BATCH, SEQ), "shift_right": (ShiftRight, BATCH, SEQ),
    "read_write_read": (ReadWriteRead, 8, 32), "hf_t5": (T5Step, BATCH, SEQ),
}


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor], Callable[..., torch.Tensor], tuple[torch.Tensor]]:
    make, batch, seq = MODELS[name]
    torch.manual_seed(0)
    model = make()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    tokens[:, 0] = 3
    tokens[0, -2:] = 0  # padding: masked positions
    targets = torch.randint(0, VOCAB, (batch, seq), generator=gen)

    def loss_fn(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), t.flatten())

    return model, (tokens,), loss_fn, (targets,)


@dataclass(frozen=True)
class Case:
    model: str
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    data_parallel: bool = True
    """Pin data parallelism on 'dp' (else a free plan)."""

    @property
    def id(self) -> str:
        return f"{self.model}-{'x'.join(map(str, self.mesh))}-{'dp' if self.data_parallel else 'free'}"


CASES = [
    Case("masked_ops", (2,), ("dp",)), Case("masked_ops", (2, 2), ("dp", "tp")),
    Case("masked_ops", (2, 2), ("dp", "tp"), data_parallel=False),
    Case("shift_right", (2,), ("dp",)), Case("shift_right", (2, 2), ("dp", "tp")),
    Case("read_write_read", (2,), ("dp",)), Case("hf_t5", (2, 2), ("dp", "tp")),
]


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = build(case.model)
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                         data_axes=("dp",) if case.data_parallel else (), pipeline=False)
    in_place = {n.name: n.outputs[0] for n in pm.plan.nodes
                if n.op.startswith("aten.") and n.op.split(".")[1].endswith("_")}
    return {**run_compiled(pm, (*inputs, *targets), ref), "in_place": in_place}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_compiled_ops_match_single_device(case: Case) -> None:
    ref = reference(lambda: build(case.model))
    results = run_checked(train_on_rank, case.mesh, case, ref)
    if case.model == "masked_ops" and case.data_parallel:  # the in-place ops really ran batch-split
        assert all(p.startswith("S(0)") for p in results[0]["in_place"].values()), results[0]["in_place"]


def _plan(name: str, mesh: dict[str, int]) -> Any:
    model, inputs, loss_fn, targets = build(name)
    return autopar.plan(model, autopar.Mesh(mesh, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                        data_axes=("dp",), pipeline=False)


def test_written_tensors_are_never_resharded() -> None:
    """T5's shift writes into a fresh tensor through views: each view and in-place op takes
    its input as produced, so the writes land in the tensor later reads see."""
    plan = _plan("shift_right", {"dp": 2})
    assert plan.fallbacks == []
    placed = {n.name: n for n in plan.nodes}
    chain = {"slice_2": "new_zeros", "copy_": "slice_2", "select": "new_zeros", "fill_": "select",
             "masked_fill_": "new_zeros"}
    for consumer, producer in chain.items():
        assert placed[consumer].inputs[0] == placed[producer].outputs[0], (consumer, producer)
    # no reshard on the written tensors (the data copied in may be gathered: they are replicated)
    assert not [c for c in plan.collectives if chain.get(c.consumer) == c.tensor], plan.collectives


def test_t5_plans_with_no_fallback() -> None:
    plan = _plan("hf_t5", {"dp": 2, "tp": 2})
    assert plan.fallbacks == []


def test_reads_after_a_write_get_their_own_reshard() -> None:
    """Both cumsums read ``buf``, one before and one after a write into it: one shared
    reshard would give the second the old values, so the plan lists (and prices) two."""
    plan = _plan("read_write_read", {"dp": 2})
    fc = next(n.name for n in plan.nodes if n.op == "aten.linear.default")
    reads = [c for c in plan.collectives if c.phase == "forward" and c.tensor == fc]
    assert sorted(c.consumer for c in reads) == ["cumsum", "cumsum_1"], reads
