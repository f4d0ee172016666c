"""Hand plans (torchtitan-style tp plan dicts) pinned and priced by the same cost model."""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel

import autopar
from examples import gpt, llama
from tiny_models import PairwiseBatch

TP_PLAN, SP_PLAN = llama.TP_PLAN, llama.TP_SP_PLAN


@pytest.fixture(scope="module")
def llama_step():
    cfg = llama.LlamaConfig(hidden=1024, heads=16, kv_heads=8, ffn_hidden=2816, layers=2, vocab_size=8192,
                            max_seq_len=512)
    with torch.device("meta"):
        model = llama.Llama(cfg)
    tokens = torch.zeros(4, 512, dtype=torch.long, device="meta")
    return model, (tokens,), llama.lm_loss, (tokens,)


def on_axis(placements: str, axis: int) -> str:
    """'RS(0)' -> ['R', 'S(0)'][axis]."""
    return re.findall(r"S\(\d+(?:/\d+)?\)|R|P", placements)[axis]


def _plan(step, mesh, **kw):
    model, inputs, loss_fn, targets = step
    return autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **{"pipeline": False, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("axes", [{"tp": 4}, {"dp": 2, "tp": 4}], ids=["tp4", "dp2xtp4"])
def test_pinned_plans_take_their_placements_and_are_never_faster_than_free(llama_step, axes) -> None:
    mesh = autopar.Mesh(axes, "h100")
    tp = list(axes).index("tp")
    free = _plan(llama_step, mesh)
    pinned_tp = _plan(llama_step, mesh, constraints=TP_PLAN)
    pinned_sp = _plan(llama_step, mesh, constraints=SP_PLAN)
    for plan in (pinned_tp, pinned_sp):
        assert on_axis(plan.parameters["layers.1.attention.wq.weight"], tp) == "S(0)"
        assert on_axis(plan.parameters["layers.0.feed_forward.w2.weight"], tp) == "S(1)"
        assert free.predicted.step_time_s <= plan.predicted.step_time_s * (1 + 1e-9)
    norms_tp = [n.outputs[0] for n in pinned_tp.nodes if n.op == "aten.rms_norm.default" and "layers" in n.module]
    norms_sp = [n.outputs[0] for n in pinned_sp.nodes if n.op == "aten.rms_norm.default" and "layers" in n.module]
    assert norms_tp and all(on_axis(o, tp) == "R" for o in norms_tp)  # replicated norms without SP
    assert norms_sp and all(on_axis(o, tp) == "S(1)" for o in norms_sp)  # sequence-sharded norms with SP
    assert pinned_sp.pinned["layers.*.ffn_norm"] == "SequenceParallel"


@pytest.mark.parametrize("plan_name", ["tp", "free"])
def test_fused_qkv_runs_as_interleaved_qkv_without_collectives_in_attention(plan_name: str) -> None:
    """ColwiseParallel on a fused qkv (``qkv(x).split(h)``) is met by a strided shard of its
    output features, so q, k, v and the heads stay local: Megatron's two all-reduces per
    block in forward, none between qkv and proj. With plain Shard(0) the split would
    need the whole qkv back. The free plan, given heads-parallel-friendly sizes (batch 1,
    long sequence) at which a quarter of each matmul still outlasts its dispatch on H100,
    finds the same qkv layout by itself; after the attention it may leave Megatron's layout
    (since a batch-1 sequence split reaches the loss without a collective, it moves the
    attention's output from heads to sequence with one all-to-all, as Ulysses does)."""
    cfg = gpt.GPTConfig(hidden=2048, heads=16, layers=2, vocab_size=8192, max_seq_len=2048)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    tokens = torch.zeros(1, cfg.max_seq_len, dtype=torch.long, device="meta")
    mesh = autopar.Mesh({"tp": 4}, "h100")
    kw = {"constraints": gpt.TP_PLAN} if plan_name == "tp" else {}
    plan = _plan((model, (tokens,), gpt.lm_loss, (tokens,)), mesh, **kw)
    assert plan.parameters["blocks.1.attn.qkv.weight"] == "S(0/3)"
    assert plan.parameters["blocks.1.attn.qkv.bias"] == "S(0/3)"
    # Collectives only where a TP region is entered (a norm's output) or left (a row-parallel output).
    boundaries = {n.name for n in plan.nodes if n.module in ("blocks.1.attn.proj", "blocks.1.mlp.proj")
                  or n.op == "aten.layer_norm.default"}
    block_fwd = [(c.kind, c.tensor) for c in plan.collectives if c.phase == "forward" and c.module.startswith("blocks.1")]
    order = [n.name for n in plan.nodes]
    qkv = next(n.name for n in plan.nodes if n.module == "blocks.1.attn.qkv" and n.op == "aten.linear.default")
    sdpa = next(n.name for n in plan.nodes if n.module.startswith("blocks.1") and "attention" in n.op)
    local = set(order[order.index(qkv):order.index(sdpa)])  # qkv, its split, the heads' views: no collective
    assert not local & {t for _, t in block_fwd}, block_fwd
    if plan_name == "free":
        return
    assert {t for _, t in block_fwd} <= boundaries, block_fwd
    kinds = sorted(k for k, _ in block_fwd)  # Megatron TP, or Megatron SP (which the free plan prefers)
    assert kinds in (["all_reduce"] * 2, ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]), kinds


@pytest.mark.slow
def test_free_plan_is_no_slower_than_megatron_sequence_parallelism_in_its_memory() -> None:
    """Batch 1 cannot be split: under the memory of the TP+SP hand plan, the free plan is at
    least as fast as it. (It used to have to copy SP's sequence-split norms; since a consumer
    that saves a resharded input is priced holding the resharded copy, SP's column linears
    hold their all-gathered inputs, and a plan with replicated norms fits in less.)"""
    cfg = llama.LlamaConfig(hidden=1024, heads=16, kv_heads=8, ffn_hidden=2816, layers=2, vocab_size=8192,
                            max_seq_len=2048)
    with torch.device("meta"):
        model = llama.Llama(cfg)
    tokens = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    step = (model, (tokens,), llama.lm_loss, (tokens,))
    mesh = autopar.Mesh({"tp": 4}, "h100")
    pinned_tp = _plan(step, mesh, constraints=TP_PLAN)
    pinned_sp = _plan(step, mesh, constraints=SP_PLAN)
    assert pinned_sp.predicted.peak_memory_bytes < pinned_tp.predicted.peak_memory_bytes
    free = _plan(step, mesh, memory_limit=pinned_sp.predicted.peak_memory_bytes)
    assert free.predicted.step_time_s <= pinned_sp.predicted.step_time_s * (1 + 1e-9)
    assert free.predicted.peak_memory_bytes <= pinned_sp.predicted.peak_memory_bytes


def test_axis_that_does_not_divide_a_pinned_dim_is_a_clear_error() -> None:
    model, inputs, loss_fn, targets = gpt.build(gpt.GPTConfig(hidden=96, heads=3))
    with pytest.raises(ValueError, match=r"does not divide by mesh axis tp=5"):
        autopar.plan(model, autopar.Mesh({"tp": 5}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     constraints={"blocks.*.mlp.fc": ColwiseParallel()}, pipeline=False)


def test_constraint_matching_nothing_or_missing_axis_is_an_error() -> None:
    model, inputs, loss_fn, targets = gpt.build()
    with pytest.raises(ValueError, match="matches no module"):
        autopar.plan(model, autopar.Mesh({"tp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     constraints={"nope.*": ColwiseParallel()}, pipeline=False)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     constraints={"blocks.*.mlp.fc": ColwiseParallel()}, pipeline=False)


@pytest.mark.parametrize("input_sharded", [False, True])
def test_data_parallel_inputs_passed_split_are_contiguous_shards(input_sharded: bool) -> None:
    """A data-parallel pin on an input the user passes already split must be exactly Shard(0):
    a strided batch shard would need rows the rank was never given."""
    x = torch.randn(64, 64)
    mesh = autopar.Mesh({"dp": 2}, "cpu")
    plan = autopar.plan(PairwiseBatch(), mesh, (x,), loss_fn=None, data_axes=("dp",), input_sharded=input_sharded,
                        pipeline=False)
    (placement,) = [n.outputs[0] for n in plan.nodes if n.op == "input"]
    if input_sharded:
        assert placement == "S(0)"
    else:  # every rank has the whole batch and slices what the plan wants: the local split wins
        assert placement == "S(0/2)"


def test_linear_styles_on_a_module_without_a_linear_are_refused() -> None:
    """HF GPT-2's Conv1D (addmm with a transposed weight) is not what ColwiseParallel splits."""
    from examples import hf_models

    model, inputs, loss_fn, targets = hf_models.build_gpt2_step()
    with pytest.raises(ValueError, match="no linear or embedding op"):
        autopar.plan(model, autopar.Mesh({"tp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     constraints={"transformer.h.*.attn.c_attn": ColwiseParallel()}, pipeline=False)


def test_colwise_embedding_splits_the_embedding_dim_as_torch_does() -> None:
    """torch's ColwiseParallel shards an nn.Embedding's table on dim 1 (its output's last
    dim): the table is pinned there, so neither forward nor backward moves it."""
    model, inputs, loss_fn, targets = gpt.build()
    plan = autopar.plan(model, autopar.Mesh({"tp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                        constraints={"wte": ColwiseParallel()}, pipeline=False)
    assert plan.parameters["wte.weight"] == "S(1)"
    assert [c for c in plan.collectives if c.tensor == "p_model_wte_weight"] == []
    embedding = next(n for n in plan.nodes if n.name == "embedding")
    assert embedding.inputs == ["S(1)", "R"] and embedding.outputs == ["S(2)"]


@pytest.mark.parametrize("hardware", ["h100", "cpu"])
@pytest.mark.parametrize("axes", [{"dp": 2}, {"dp": 2, "tp": 2}], ids=["dp2", "dp2xtp2"])
def test_data_axes_keep_the_batch_split_and_synchronize_gradients(axes: dict[str, int], hardware: str) -> None:
    """Pinned data parallelism runs every op on its part of the batch: nothing computed from
    the inputs is gathered on the data axis, and the gradients are all-reduced there."""
    model, inputs, loss_fn, targets = gpt.build()
    plan = autopar.plan(model, autopar.Mesh(axes, hardware), inputs, loss_fn=loss_fn, example_targets=targets,
                        data_axes=("dp",), pipeline=False)
    assert not [c for c in plan.collectives if c.axis == "dp" and c.kind in ("all_gather", "all_to_all")]
    assert {b.mesh_dim for b in plan.grad_buckets} >= {0}
    linears = [n for n in plan.nodes if n.op == "aten.linear.default"]
    assert linears and all(on_axis(n.inputs[0], 0).startswith("S(0") for n in linears)
    assert all(on_axis(p, 0) == "R" for p in plan.parameters.values())


class _Biased(torch.nn.Module):
    """An MLP that also takes a per-feature input (not data: no batch dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + shift


@pytest.mark.parametrize("hardware", ["h100", "cpu"])
def test_data_axes_never_gather_the_batch_into_a_matmul(hardware: str) -> None:
    """A Partial output does not make a split: the linear must take its batch split, not all
    of it gathered against a zero-padded (Partial) weight."""
    plan = autopar.plan(_Biased(), autopar.Mesh({"dp": 2}, hardware), (torch.randn(8, 16), torch.randn(16)),
                        loss_fn=lambda y: y.sum(), data_axes=("dp",), pipeline=False)
    linear = next(n for n in plan.nodes if n.op == "aten.linear.default")
    assert linear.inputs == ["S(0)", "R", "R"] and linear.outputs == ["S(0)"]
    assert not [c for c in plan.collectives if c.phase == "forward" and c.kind == "all_gather"]
    shift = next(n for n in plan.nodes if n.op == "input" and n.shapes == [[16]])
    assert shift.outputs == ["R"]  # not batch: not split on the data axis
