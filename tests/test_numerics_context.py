"""Context parallelism (all-gathered keys and values, or ring attention) trains to the
single-device numbers: loss, every gradient and every parameter after 3 AdamW steps, on gloo
ranks forked from this process, with the sequence split on ``cp`` (``context_axes=("cp",)``).

The batch is 1, as where context parallelism is used (a batch that divides would be split
instead: the planner moves the split to the batch with one all-to-all of the tokens, which
is cheaper than gathering keys and values). The 3-D attention takes its queries split on
the sequence and its keys and values whole; a causal one runs on each rank's query rows
(``passes.localize_attention``). Pinned to ring attention (``context_attention="ring"``), queries,
keys and values split, each call runs ``runtime.ring`` (its sends checked against the plan's);
pinned to Ulysses, heads split behind all-to-alls.

The matrix (issue 11): each kind (allgather, ring, Ulysses) on cp=2 and cp=4, causal, bidirectional
and with a padding mask on the tiny attention LM; on the example Llama (causal, rotary, GQA) beside
dp and tp; on HF Llama (its own boolean mask) on cp=2, cp=4 and dp x cp (a pinned ring or all-gather
keeps no heads split on the context axis: HF repeats its kv heads, which would otherwise make Ulysses
the cheaper plan on cp=4). Not here: Ulysses with kv heads that do not divide cp (refused:
``test_context_planning``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics_harness import Reference, planned_counts, reference, run_checked, run_compiled
from test_numerics_attention import VOCAB, TinyAttentionLM
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.rules.attention import held_chunks, query_positions
from autopar.rules.strategy import parse_placements
from autopar.runtime.attention import causal_on_rows
from autopar.runtime.forked import run_ranks
from autopar.runtime.ops import CollectiveLog
from examples import llama

SEQ = 8
SDPA = "aten.scaled_dot_product_attention.default"


def build(heads: int | None, masked: bool, batch: int = 1, causal: bool = True
          ) -> tuple[nn.Module, tuple[torch.Tensor], Callable[..., torch.Tensor], tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyAttentionLM(heads, masked, causal)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, VOCAB, (batch, SEQ), generator=gen)
    tokens[:, SEQ // 2] = 0  # a padding token: a key masked out for every query
    targets = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)

    def loss_fn(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), t.flatten())

    return model, (tokens,), loss_fn, (targets,)


@dataclass(frozen=True)
class Case:
    masked: bool
    """An explicit (padding & causal) boolean mask; else ``is_causal=True``."""
    mesh: tuple[int, ...] = (2,)
    names: tuple[str, ...] = ("cp",)
    heads: int | None = None
    attention: str | None = None
    """``context_attention`` pinned ("ring": keys and values passed around the ring; "ulysses": heads
    split behind all-to-alls); None: the solver's."""
    causal: bool = True
    """False: bidirectional (the padding mask alone where ``masked``, else no mask at all)."""

    @property
    def id(self) -> str:
        kind = ("mask" if self.masked else "causal") if self.causal else ("padding" if self.masked else "full")
        return (f"{kind}-{'x'.join(f'{n}{s}' for n, s in zip(self.names, self.mesh))}"
                + (f"-{self.attention}" if self.attention else ""))

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor], Callable[..., torch.Tensor], tuple[torch.Tensor]]:
        return build(self.heads, self.masked, causal=self.causal)


CASES = [Case(True), Case(False), Case(True, (4,)), Case(False, (4,)), Case(True, (4,), attention="ring"),
         Case(False, (2,), attention="ring"), Case(True, (4,), heads=4, attention="ulysses"),
         Case(False, (2,), heads=2, attention="ulysses"),
         # bidirectional: nothing to localize, every rank's rows against all keys
         Case(False, (2,), causal=False), Case(True, (4,), heads=4, causal=False),
         Case(True, (2,), causal=False, attention="ring"), Case(False, (4,), causal=False, attention="ring"),
         Case(True, (2,), heads=2, causal=False, attention="ulysses")]


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = case.build()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, context_axes=("cp",),
                         context_attention=case.attention, pipeline=False)
    sdpa = [n for n in pm.plan.nodes if n.op == SDPA]
    return {**run_compiled(pm, (*inputs, *targets), ref), "sdpa_inputs": [n.inputs for n in sdpa],
            "code": pm.program.code}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_context_parallel_attention_matches_single_device(case: Case) -> None:
    ref = reference(case.build)
    results = run_checked(train_on_rank, case.mesh, case, ref)
    (inputs,) = results[0]["sdpa_inputs"]
    code = results[0]["code"]
    seq = "S(1)" if case.heads is None else "S(2)"  # (B, L, E) or (B, H, L, E)
    if case.attention == "ring":  # queries, keys and values split on the sequence, a causal mask on its rows
        mask = [seq if case.causal else "R"] * (len(inputs) - 3)  # a bidirectional one broadcasts on the rows
        assert inputs == [seq] * 3 + mask and "self.ring_attention(" in code, inputs
        return
    if case.attention == "ulysses":  # (B, H, L, E) split on heads behind all-to-alls: a plain SDPA per rank
        assert inputs[:3] == ["S(1)"] * 3 and "context_attention(" not in code and "ring_attention(" not in code
        return
    assert inputs[:3] == [seq, "R", "R"], inputs  # queries split on the sequence, keys and values whole
    assert ("self.context_attention(" in code) == (case.causal and not case.masked)


LLAMA = llama.LlamaConfig(vocab_size=64, max_seq_len=16, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, layers=2)


@dataclass(frozen=True)
class LlamaCase:
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    batch: int = 1
    seq: int = 16
    """Tokens per sequence: below ``max_seq_len``, the rotary tables are sliced first."""
    zero: int = 0
    """ZeRO stage on the cp axis (3: parameters stored split there, FSDP over the context axis)."""
    layout: str | None = None
    """``context_layout`` pinned ("zigzag": rank i holds chunks i and 2n-1-i of 2n); None: the faster."""
    attention: str | None = None
    """``context_attention`` pinned ("ring"); None: the solver's (all-gathered K/V on these shapes)."""
    checkpoint: str | None = None
    """Activation checkpointing pinned: the blocks' forward (a ring's sends too) runs again in backward."""
    heads: tuple[int, int] = (LLAMA.heads, LLAMA.kv_heads)
    """(heads, kv_heads): Ulysses splits both on cp (times tp beside it), so they must divide by it."""

    @property
    def id(self) -> str:
        return ("x".join(f"{n}{s}" for n, s in zip(self.names, self.mesh)) + f"-b{self.batch}-s{self.seq}"
                + (f"-zero{self.zero}" if self.zero else "") + (f"-{self.layout}" if self.layout else "")
                + (f"-{self.attention}" if self.attention else "") + (f"-{self.checkpoint}" if self.checkpoint else "")
                + (f"-h{self.heads[0]}kv{self.heads[1]}" if self.heads != (LLAMA.heads, LLAMA.kv_heads) else ""))

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor], Callable[..., torch.Tensor], tuple[torch.Tensor]]:
        cfg = dataclasses.replace(LLAMA, heads=self.heads[0], kv_heads=self.heads[1])
        model, (tokens,), loss_fn, (targets,) = llama.build(cfg, batch=self.batch)
        return model, (tokens[:, :self.seq],), loss_fn, (targets[:, :self.seq],)


LLAMA_CASES = [LlamaCase((2,), ("cp",), layout="zigzag"), LlamaCase((2,), ("cp",), seq=8),
               LlamaCase((4,), ("cp",), layout="zigzag"), LlamaCase((4,), ("cp",), seq=8, layout="zigzag"),
               LlamaCase((2, 2), ("dp", "cp"), batch=2, layout="zigzag"),
               LlamaCase((2, 2), ("cp", "tp"), layout="zigzag"),
               LlamaCase((2,), ("cp",), zero=3),
               LlamaCase((2,), ("cp",), layout="zigzag", attention="ring", checkpoint="selective"),
               LlamaCase((4,), ("cp",), layout="zigzag", attention="ring"),
               LlamaCase((2, 2), ("dp", "cp"), batch=2, layout="zigzag", attention="ring"),
               LlamaCase((2, 2), ("cp", "tp"), layout="zigzag", attention="ring"),
               LlamaCase((2,), ("cp",), attention="ulysses"),
               LlamaCase((2, 2), ("dp", "cp"), batch=2, attention="ulysses"),
               LlamaCase((4,), ("cp",), attention="ulysses", heads=(4, 4)),
               LlamaCase((2,), ("cp",), layout="zigzag", attention="ulysses", heads=(4, 4)),
               # tp outer, heads dividing tp x cp: TP's heads split further on cp (heads S(1) on both);
               # cp outer, [S(1), S(1)] would be cp-major, not what an all-to-all after TP holds: heads gathered on tp
               LlamaCase((2, 2), ("tp", "cp"), attention="ulysses", heads=(8, 4)),
               LlamaCase((2, 2), ("cp", "tp"), attention="ulysses")]


def train_llama_on_rank(rank: int, world: int, case: LlamaCase, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = case.build()
    data_axes = tuple(n for n in case.names if n == "dp")
    tp = {"constraints": llama.TP_PLAN, "constraint_axis": "tp"} if "tp" in case.names else {}
    zero = {"zero": {"cp": case.zero}} if case.zero else {}
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, context_axes=("cp",),
                         data_axes=data_axes, context_layout=case.layout, context_attention=case.attention,
                         checkpoint=case.checkpoint, **tp, **{"pipeline": False, **zero})
    sdpa = [n for n in pm.plan.nodes if n.op == SDPA]
    return {**run_compiled(pm, (*inputs, *targets), ref), "sdpa_inputs": [n.inputs for n in sdpa],
            "zigzag": pm.plan.mesh.get("zigzag", [])}


@pytest.mark.parametrize("case", LLAMA_CASES, ids=[c.id for c in LLAMA_CASES])
def test_llama_context_parallel_matches_single_device(case: LlamaCase) -> None:
    """Causal grouped-query attention with rotary positions: each rank's tables are those of
    its own positions (the tables split on the sequence with the activations); beside data
    parallelism, and beside Megatron tensor parallelism (heads split on tp). Zig-zag: tokens,
    targets and rotary tables cut alike, each rank's two chunks against their own keys (with
    8 tokens on 4 ranks a chunk is one token, and rank 1's two chunks are adjacent)."""
    ref = reference(case.build)
    results = run_checked(train_llama_on_rank, case.mesh, case, ref)
    assert results[0]["zigzag"] == (["cp"] if case.layout == "zigzag" else []), results[0]["zigzag"]
    cp = case.names.index("cp")
    for inputs in results[0]["sdpa_inputs"]:  # q split on the sequence (dim 2) over cp, k and v whole there
        placed = [parse_placements(p)[cp] for p in inputs]
        if case.attention == "ring":  # keys and values split too, passed around the ring
            assert placed == [Shard(2)] * 3, inputs
        elif case.attention == "ulysses":  # heads split behind all-to-alls
            assert placed == [Shard(1)] * 3, inputs
            if case.names[0] == "tp":  # and on tp, as TP left them: composed, not gathered
                assert [parse_placements(p)[0] for p in inputs] == [Shard(1)] * 3, inputs
        elif case.zero:  # weights gathered anyway: the planner may split attention by heads on cp instead
            assert placed in ([Shard(2), Replicate(), Replicate()], [Shard(1)] * 3), inputs
        else:
            assert placed == [Shard(2), Replicate(), Replicate()], inputs


def small_vocab_llama() -> tuple[nn.Module, tuple[torch.Tensor], Callable[..., torch.Tensor], tuple[torch.Tensor]]:
    """The case's Llama with far fewer tokens in the vocabulary (16) than hidden units (256): gathering the
    logits is then cheaper than an all-to-all of the output layer's input to split it (logits Partial)."""
    return llama.build(dataclasses.replace(LLAMA, vocab_size=16, hidden=256), batch=1)


def eval_llama_on_rank(rank: int, world: int, expected: list[float]) -> tuple[list[str], float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model, inputs, _, _ = small_vocab_llama()
    pm = autopar.compile(model, mesh, inputs, train=False, context_axes=("cp",), context_layout="zigzag",
                         pipeline=False)
    log = CollectiveLog()
    pm.attach_log(log)
    logits = pm(*inputs)
    gap = (logits.full_tensor() - torch.tensor(expected).reshape(logits.shape)).abs().max().item()
    names = mesh.mesh_dim_names
    ran = sorted(Counter((p, k, names[d], b) for p, k, d, b in log.entries).items())
    return [str(p) for p in pm._outputs[0]] + [str(p) for p in logits.placements], gap, ran, \
        sorted(planned_counts(pm.plan).items()), (pm.plan.solver["objective_s"], pm.plan.predicted.step_time_s)


def test_zigzag_outputs_come_back_in_order() -> None:
    """A forward step's logits, planned split on the sequence over a zig-zag axis, are
    returned gathered there, in the sequence's order: the user never sees the zig-zag layout. The
    plan lists (and prices) that gather with the step's other collectives: what ran is what it lists."""
    model, inputs, _, _ = small_vocab_llama()
    with torch.no_grad():
        expected = model(*inputs).flatten().tolist()
    placements, gap, ran, planned, (objective, predicted) = run_ranks(eval_llama_on_rank, 2, expected)[0]
    assert objective == pytest.approx(predicted, rel=1e-9)
    assert placements == ["S(1)", "R"] and gap < 1e-5, (placements, gap)
    logits_bytes = math.prod((1, LLAMA.max_seq_len, 16)) * 4  # an all-gather's bytes: the gathered tensor's
    assert (("forward", "all_gather", "cp", logits_bytes), 1) in planned, planned
    assert ran == planned, (ran, planned)


@pytest.mark.parametrize("op,mask", [("sdpa", None), ("sdpa", "bool"), ("sdpa", "rows"), ("cpu_flash", None),
                                     ("cpu_flash", "float")])
def test_zigzag_rows_equal_the_whole_causal_call(op: str, mask: str | None) -> None:
    """Each zig-zag rank's rows (two runs, each against its keys; the middle rank's runs
    adjacent) equal those rows of the causal call on the whole sequence: with a padding mask
    of the call's own (broadcast on L), a mask per row (split with the rows), and the CPU
    kernel's (out, logsumexp)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 4, generator=gen) for _ in range(3))
    target = torch.ops.aten.scaled_dot_product_attention.default if op == "sdpa" else \
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    keep = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    keep[..., 5] = False
    per_row = (torch.rand(1, 1, 16, 16, generator=gen) > 0.3) | torch.eye(16, dtype=torch.bool)
    own = {None: None, "bool": keep, "float": torch.zeros(keep.shape).masked_fill(~keep, float("-inf")),
           "rows": per_row}[mask]
    zigzag = frozenset({0})
    for i in range(4):
        positions = query_positions(4, 2, (Shard(2),), (4,), (i,), zigzag)
        mine = own.index_select(2, positions) if mask == "rows" else own
        rows = q.index_select(2, positions)
        if op == "sdpa":
            whole = (target(q, k, v, own, 0.0, True),)
            out = causal_on_rows(target, (rows, k, v, mine, 0.0, True), {}, positions, {}, "rows",
                                 held_chunks(2, (Shard(2),), zigzag))
        else:
            whole = target(q, k, v, 0.0, True, attn_mask=own)
            out = causal_on_rows(target, (rows, k, v, 0.0, True), {"attn_mask": mine}, positions, {}, "rows",
                                 held_chunks(2, (Shard(2),), zigzag))
        for got, want in zip(out if isinstance(out, tuple) else (out,), whole):
            torch.testing.assert_close(got, want.index_select(2, positions))  # out [.., L, E], logsumexp [.., L]


def _hf_llama(batch: int = 1) -> tuple[nn.Module, tuple[torch.Tensor], Callable[..., torch.Tensor],
                                      tuple[torch.Tensor]]:
    from examples import hf_models
    return hf_models.build_llama_step(batch=batch, seq=16)


HF_CASES = [LlamaCase((2,), ("cp",), attention="ring"), LlamaCase((2,), ("cp",), attention="allgather"),
            LlamaCase((2,), ("cp",), attention="ulysses"),
            LlamaCase((2, 2), ("dp", "cp"), batch=2, attention="ulysses"),
            LlamaCase((2, 2), ("dp", "cp"), batch=2, attention="allgather"),
            LlamaCase((4,), ("cp",), attention="allgather"), LlamaCase((4,), ("cp",), attention="ulysses"),
            LlamaCase((4,), ("cp",), attention="ring")]
"""Hugging Face's Llama: 4 heads, 2 key/value heads repeated to 4 before attention (``repeat_kv``), so
Ulysses splits them on cp=4 too (a pinned ring or all-gather keeps no heads split on cp)."""


def train_hf_llama_on_rank(rank: int, world: int, case: LlamaCase, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = _hf_llama(case.batch)
    data_axes = tuple(n for n in case.names if n == "dp")
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, context_axes=("cp",),
                         data_axes=data_axes, context_attention=case.attention, pipeline=False)
    return {**run_compiled(pm, (*inputs, *targets), ref),
            "sdpa_inputs": [n.inputs for n in pm.plan.nodes if n.op == SDPA]}


@pytest.mark.parametrize("case", HF_CASES, ids=[c.id for c in HF_CASES])
def test_hf_llama_context_parallel_matches_single_device(case: LlamaCase) -> None:
    """Hugging Face's Llama (its own boolean causal mask, split on its rows and read by the
    ring's blocks at their keys' columns; grouped-query attention) under each kind of context
    parallel attention, beside data parallelism too."""
    pytest.importorskip("transformers")
    results = run_checked(train_hf_llama_on_rank, case.mesh, case, reference(lambda: _hf_llama(case.batch)))
    cp = case.names.index("cp")
    want = {"ring": [Shard(2)] * 4, "allgather": [Shard(2), Replicate(), Replicate(), Shard(2)],
            "ulysses": [Shard(1)] * 3 + [Replicate()]}[case.attention or ""]
    assert results[0]["sdpa_inputs"]
    for inputs in results[0]["sdpa_inputs"]:  # (q, k, v, mask (B, 1, L, L)) on cp
        assert [parse_placements(p)[cp] for p in inputs] == want, inputs


def _hf_gpt2_eager() -> tuple[nn.Module, tuple[torch.Tensor], Callable[..., torch.Tensor], tuple[torch.Tensor]]:
    """HF GPT-2 with its attention written out (``attn_implementation="eager"``: matmul, causal
    ``where``, softmax, matmul), dropout off, one sequence (so cp can only split the sequence)."""
    from examples import hf_models
    model, inputs, loss_fn, targets = hf_models.build_gpt2_step(batch=1, seq=16, attn_implementation="eager")
    model.eval()
    return model, inputs, loss_fn, targets


def train_gpt2_eager_on_rank(rank: int, world: int, case: None, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model, inputs, loss_fn, targets = _hf_gpt2_eager()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, context_axes=("cp",),
                         pipeline=False)
    return {**run_compiled(pm, (*inputs, *targets), ref),
            "scores": [(n.inputs, n.outputs) for n in pm.plan.nodes if n.op == "aten.matmul.default"
                       and n.module.endswith(".attn")]}


def test_attention_written_out_splits_its_sequence() -> None:
    """Attention written as matmul-softmax-matmul has no attention op to replace: the per-op rules
    split it on the sequence as the all-gather kind does (queries' rows split, keys and values
    whole on each rank, the scores and softmax split by rows), equal to single device."""
    pytest.importorskip("transformers")
    results = run_checked(train_gpt2_eager_on_rank, (2,), None, reference(_hf_gpt2_eager))
    assert results[0]["scores"] and all(inputs == ["S(2)", "R"] and outputs == ["S(2)"]
                                        for inputs, outputs in results[0]["scores"]), results[0]["scores"]
