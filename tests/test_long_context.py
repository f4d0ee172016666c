"""Issue 11 point 3 on the Llama-3-8B width (2 of its 32 layers, so that planning stays fast):
what the cost model chooses for a long sequence against a short one (``benchmarks/long_context.py``
runs the whole shape). Planning only, on the meta device."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import autopar
from autopar.errors import InputError
from autopar.hardware import HardwareProfile, get_profile
from examples.llama import Llama, LlamaConfig, lm_loss

SDPA = "aten.scaled_dot_product_attention.default"


def _plan(seq: int, batch: int, hardware: str | HardwareProfile = "h100", **options: object) -> autopar.Plan:
    cfg = LlamaConfig(vocab_size=128256, max_seq_len=seq, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                      layers=2, rope_theta=500000.0)
    with torch.device("meta"):
        model = Llama(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    return autopar.plan(model, autopar.Mesh({"cp": 8}, hardware), (tokens,), loss_fn=lm_loss,
                        example_targets=(tokens,), **{"pipeline": False, **options})


def _query_splits(plan: autopar.Plan) -> set[str]:
    return {n.inputs[0] for n in plan.nodes if n.op == SDPA}


def test_short_sequences_split_the_batch() -> None:
    """4k tokens, 8 sequences on 8 ranks: plain data parallelism, even with the sequence pinned
    split on cp (the split moves to the batch by one all-to-all of the tokens)."""
    assert _query_splits(_plan(4096, 8)) == {"S(0)"}
    assert _query_splits(_plan(4096, 8, context_axes=("cp",))) == {"S(0)"}


def test_a_long_sequence_splits_attention_on_the_context_axis() -> None:
    """128k tokens, one sequence: no batch to split; with the sequence pinned split the plan fits
    and every attention call runs split on cp (by ring attention: see the next test)."""
    plan = _plan(131072, 1, context_axes=("cp",))
    assert plan.predicted.peak_memory_bytes <= 0.9 * 80 * 2**30
    assert _query_splits(plan) <= {"S(1)", "S(2)"}


def test_a_long_sequence_runs_ring_attention_where_the_runtime_has_its_kernel() -> None:
    """128k tokens on cp=8, on an H100 profile whose runtime ran ring attention (today's runs it on
    CPU meshes only: ``HardwareProfile.ring_attention``): ring attention on zig-zag chunks (every
    rank exactly a balanced share of the causal pairs, its K/V sends hidden under each step's
    blocks but the last dK/dV's) beats the heads split behind all-to-alls: 373.8 ms a step
    against 377.4 ms (the same 373.3 ms of compute, 0.5 against 4.1 ms of exposed communication).
    The query rows split with gathered K/V loses to heads (391.7 ms for zig-zag rows: (2n+1)/2n of
    the balanced share, explicitly masked, and the gathered K/V's all-gathers and reduce-scatters).
    On the stock profile the plan is the heads split, and a ring pin is refused."""
    plan = _plan(131072, 1, replace(get_profile("h100"), ring_attention=True), context_axes=("cp",))
    assert {tuple(n.inputs) for n in plan.nodes if n.op == SDPA} == {("S(2)", "S(2)", "S(2)")}
    assert plan.mesh.get("zigzag") == ["cp"]
    heads = _plan(131072, 1, context_axes=("cp",))
    assert _query_splits(heads) == {"S(1)"} and plan.predicted.step_time_s < heads.predicted.step_time_s
    with pytest.raises(InputError, match="CPU meshes only"):
        _plan(131072, 1, context_axes=("cp",), context_attention="ring")
