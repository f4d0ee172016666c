"""The memory limit decides: plans move to checkpointing, micro-batches and offload as it
shrinks, never predict a faster step at a tighter limit, fit what they promise, and the
plan the search picks runs exactly (every rank rebuilds rank 0's scenario)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.config import PlanConfig
from autopar.runtime.forked import run_ranks
from autopar.search.problem import Place, PricedParts, Problems, Step, priced_under, scenarios
from autopar.memory.scenarios import Scenario, candidates
from autopar.memory.options import MemoryOptions
from examples import gpt, llama
from numerics_harness import check, reference, run_compiled
from tiny_models import BigTable
from tests.planning import H100_STATE_ONCE, assert_one_price, problem_at

MiB = 2**20
LIMITS_MIB = (13, 9, 6, 5)
"""The GPT example on dp=2 (cpu profile) needs 14.2 MiB with nothing saved; these force the search."""


def _plan(limit_mib: float | None, **kwargs: Any) -> autopar.Plan:
    model, inputs, loss_fn, targets = gpt.build()
    return autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                        memory_limit=None if limit_mib is None else limit_mib * MiB, **{"pipeline": False, **kwargs})


@pytest.mark.slow
def test_tighter_limits_never_plan_faster_and_every_plan_fits() -> None:
    free = _plan(None)
    assert free.memory.describe() == "1 micro-batch"  # ample memory: today's plan, one solve
    previous = free.predicted.step_time_s
    chosen = set()
    for limit in LIMITS_MIB:
        plan = _plan(limit)
        assert plan.predicted.peak_memory_bytes <= limit * MiB
        assert_one_price(plan)
        assert sum(plan.predicted.memory_parts.values()) == pytest.approx(plan.predicted.peak_memory_bytes)
        assert plan.predicted.step_time_s >= previous
        previous = plan.predicted.step_time_s
        chosen.add((plan.memory.micro_batches, plan.memory.checkpoint, bool(plan.memory.offload)))
    assert len(chosen) >= 3, chosen  # the plans really move


def test_pinned_choices_are_kept_even_with_memory_to_spare() -> None:
    plan = _plan(None, micro_batches=4, checkpoint="selective", offload=False)
    assert (plan.memory.micro_batches, plan.memory.checkpoint, plan.memory.offload) == (4, "selective", [])
    with pytest.raises(autopar.MemoryLimitError, match="least memory"):
        _plan(6, checkpoint="none", micro_batches=1, offload=False, zero={"dp": 0})


def test_checkpointing_the_first_blocks() -> None:
    """checkpoint_blocks=1 of the GPT's 2 blocks: the first recomputes, the second keeps its
    activations, which backward frees before the first recomputes; so the peak is all-full's
    (one block's worth held either way, by hand) at half its recompute. The search, at
    that peak, finds a plan at least as fast."""
    full = _plan(None, checkpoint="full")
    first = _plan(None, checkpoint="full", checkpoint_blocks=1)
    assert first.memory.checkpoint_blocks == ["blocks.0"] and full.memory.checkpoint_blocks == ["blocks.0", "blocks.1"]
    assert_one_price(first)
    assert first.predicted.step_time_s < full.predicted.step_time_s
    assert first.predicted.peak_memory_bytes == pytest.approx(full.predicted.peak_memory_bytes, rel=0.02)
    searched = _plan(first.predicted.peak_memory_bytes / MiB)
    assert searched.predicted.step_time_s <= first.predicted.step_time_s * (1 + 1e-9)


def test_gathering_again_is_searched_per_block() -> None:
    """Beside each checkpointing choice the search tries holding every gathered parameter,
    gathering again those of every block but the last (only beyond the checkpointed ones: a
    replay gathers again anyway), or every parameter's; a pin of ZeRO-3 with
    ``regather_blocks`` fixes it."""
    def regathers(options: MemoryOptions, checkpoint: str, count: int | None) -> list[tuple[bool, int | None]]:
        return [(s.regather, s.regather_blocks) for s in candidates(options, 1, 8, True)
                if (s.checkpoint, s.checkpoint_blocks, s.offload) == (checkpoint, count, True)]  # offload per parameter
    free = MemoryOptions()
    assert regathers(free, "none", None) == [(False, None), (True, 7), (True, None)]
    assert regathers(free, "full", 2) == [(False, None), (True, 7), (True, None)]
    assert regathers(free, "full", 6) == [(False, None), (True, 7), (True, None)]
    assert regathers(free, "selective", None) == [(False, None), (True, None)]
    pinned = MemoryOptions(zero={"dp": 3}, regather_blocks=3)
    assert {(s.regather, s.regather_blocks) for s in candidates(pinned, 1, 8, True)} == {(True, 3)}
    assert {(s.regather, s.regather_blocks) for s in candidates(MemoryOptions(zero={"dp": 3}, regather_blocks=8), 1, 8,
                                                                   True)} == {(True, None)}  # all of them


def test_zero1_and_offload_are_one_family_of_scenarios_unless_pinned() -> None:
    """Unpinned, every scenario lets the ILP choose ZeRO-1 on the axes or offload, per
    parameter (one of the two per plan), but the first (today's default, solved with memory to
    spare) does not. Pinned stage 1 makes every scenario's ZeRO-1 a pin (no offload), stage 0
    leaves offload alone; ``offload=False`` leaves ZeRO-1 alone; ``offload=True`` pins it."""
    free = candidates(MemoryOptions(), 2, 2, True, ("dp",))
    assert free[0] == Scenario() and free[1] == Scenario(zero1=("dp",), offload=True)
    assert all(s.zero1 == ("dp",) and s.offload and not (s.zero1_pinned or s.offload_pinned) for s in free[1:])
    assert "optimizer state on the host or ZeRO-1 on dp, per parameter" in free[1].describe()
    pinned = candidates(MemoryOptions(zero={"dp": 1}), 2, 2, True, ("dp",))
    assert all(s.zero1 == ("dp",) and s.zero1_pinned and not s.offload for s in pinned)
    stage0 = candidates(MemoryOptions(zero={"dp": 0}), 2, 2, True, ("dp",))
    assert stage0[0] == Scenario() and all(s.zero1 == () and s.offload for s in stage0[1:])
    on_device = candidates(MemoryOptions(offload=False), 2, 2, True, ("dp",))
    assert all(s.zero1 == ("dp",) and not s.offload for s in on_device[1:])
    hosted = candidates(MemoryOptions(offload=True), 2, 2, True, ("dp",))
    assert all(s.offload and s.offload_pinned and s.zero1 == () for s in hosted)


def test_zero1_is_chosen_per_parameter_where_the_limit_needs_it() -> None:
    """A 4096 x 64 table (E = 262,144 elements) beside 4,680 elements of linears (O), on dp=2
    h100s, batch split on dp (parameters replicated there), fp32: DDP keeps 16 bytes per
    element (weights, gradient, Adam m and v), ZeRO-1 on dp 8 + 8 / 2. A limit 2E bytes
    below DDP's peak needs the table's state sharded: that saves 4E, all the linears' 4O =
    18,720 bytes < 2E. ZeRO-1 costs time on h100 with the update moving its state once
    (``H100_STATE_ONCE``: its reduce-scatter and all-gather wait, the all-reduce hides behind
    backward), so the ILP shards the table alone; nothing else
    moves (placements are pinned, nothing to checkpoint, one micro-batch)."""
    torch.manual_seed(0)
    model, tokens, targets = BigTable(), torch.randint(0, 4096, (64, 32)), torch.randint(0, 8, (64,))
    mesh = autopar.Mesh({"dp": 2}, H100_STATE_ONCE)
    kwargs: dict[str, Any] = dict(loss_fn=torch.nn.functional.cross_entropy, example_targets=(targets,),
                                  data_axes=("dp",), precision="fp32", micro_batches=1, offload=False)
    table, linears = 4096 * 64, 64 * 64 + 64 + 8 * 64 + 8
    ddp = autopar.plan(model, mesh, (tokens,), **{"pipeline": False, **kwargs})
    assert ddp.memory.zero1 == {} and ddp.predicted.parameter_memory_bytes == 16 * (table + linears)
    limit = ddp.predicted.peak_memory_bytes - 2 * table
    plan = autopar.plan(model, mesh, (tokens,), memory_limit=limit, **{"pipeline": False, **kwargs})
    assert plan.memory.zero1 == {"emb.weight": "dp"}
    assert plan.memory.describe() == "1 micro-batch, ZeRO-1 on dp for 1 of 5 parameters"
    assert "ZeRO-1 on dp for 1 of 5 parameters" in str(plan)
    assert plan.predicted.parameter_memory_bytes == 16 * linears + 8 * table + 8 * (table // 2)
    assert plan.predicted.activation_memory_bytes == ddp.predicted.activation_memory_bytes
    assert plan.predicted.peak_memory_bytes == ddp.predicted.peak_memory_bytes - 4 * table <= limit
    assert_one_price(plan)
    everything = autopar.plan(model, mesh, (tokens,), zero={"dp": 1},
                              **{"pipeline": False, **kwargs})  # pinned: every parameter
    assert len(everything.memory.zero1) == 5 and everything.memory.describe() == "1 micro-batch, ZeRO-1 on dp"
    assert ddp.predicted.step_time_s < plan.predicted.step_time_s < everything.predicted.step_time_s
    buckets = {(b.kind, tuple(b.params)) for b in plan.shard_buckets}
    assert buckets == {("reduce_scatter", ("p_model_emb_weight",)), ("all_gather", ("p_model_emb_weight",))}


def _train(rank: int, world: int, limit_mib: float, ref: Any) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                         memory_limit=limit_mib * MiB, pipeline=False)
    return {**run_compiled(pm, (*inputs, *targets), ref, step=True), "memory": pm.plan.memory.describe()}


@pytest.mark.parametrize("limit_mib", [9, 5])
def test_the_searched_plan_runs_exactly(limit_mib: float) -> None:
    ref = reference(gpt.build)
    results = run_ranks(_train, 2, limit_mib, ref)
    check(results, ref)
    assert results[0]["memory"] == results[1]["memory"] != "1 micro-batch"


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128, bias=False)
        self.down = torch.nn.Linear(128, 64, bias=False)
        self.down.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("dtype, train, weights, gradients, state", [
    # mixed: fp32 master 4 + grad 4 + Adam 8 for `up`; frozen `down` keeps its fp32 master (4)
    (torch.float32, True, 4 * 8192 + 4 * 8192, 4 * 8192, 8 * 8192),
    (torch.float32, False, 4 * 16384, 0, 0),  # forward-only: the fp32 masters, read through casts
    # a bf16 model: weights 2, gradient 2, Adam m and v in bf16 2 + 2
    (torch.bfloat16, True, 2 * 8192 + 2 * 8192, 2 * 8192, 4 * 8192),
    (torch.bfloat16, False, 2 * 16384, 0, 0),
])
def test_bf16_model_state_by_hand(dtype: torch.dtype, train: bool, weights: int, gradients: int,
                                  state: int) -> None:
    """Model state per parameter element under bf16 compute, counted by hand: mixed precision
    keeps fp32 masters (frozen and forward-only too), a bf16 model keeps bf16 everything."""
    model = _Mlp().to(dtype)
    x = torch.randn(8, 64, dtype=dtype)
    plan = autopar.plan(model, autopar.Mesh({"dp": 1}, "h100"), (x,), train=train,
                        loss_fn=(lambda y: y.float().square().mean()) if train else None, pipeline=False)
    parts = plan.predicted.memory_parts
    assert (parts["weights"], parts["gradients"], parts["optimizer state"]) == (weights, gradients, state)


@pytest.mark.parametrize("policy", ["selective", "selective_op", "full"])
def test_checkpointing_policies_price_what_they_replay(policy: str) -> None:
    """Each checkpointed Llama block's linear layers (q, k, v, o, gate, up, down, in order) pay their
    forward again where the policy recomputes them: none under 'selective', every second one
    (k, o, up) under 'selective_op' (torchtitan's op policy), all under 'full'; attention is kept
    by both selective policies."""
    model, inputs, loss_fn, targets = llama.build()
    problem = problem_at(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                         checkpoint=policy, pipeline=False)
    base = problem.base_graph
    assert base is not None
    replayed = {}
    for name in problem.graph.order:
        node, was = problem.graph.nodes[name], base.nodes[name]
        if node.call is None or not name.startswith(("linear", "scaled_dot_product_attention")) or node.block != "layers.0":
            continue
        again = [c.time - b.time for c, b in zip(node.costs, was.costs)]
        assert all(a == pytest.approx(b.forward) or a == 0.0 for a, b in zip(again, was.costs)), name
        replayed[name] = again[0] > 0.0
    linears = [replayed[n] for n in replayed if n.startswith("linear")]
    attention = [replayed[n] for n in replayed if n.startswith("scaled")]
    assert len(linears) == 7 and len(attention) == 1, replayed
    want = {"selective": [False] * 7, "selective_op": [False, True] * 3 + [False], "full": [True] * 7}[policy]
    assert linears == want
    assert attention == [policy == "full"]


def test_op_policy_replays_an_attention_with_dropout() -> None:
    """An attention drawing dropout runs torch's math path (``bmm``, softmax, dropout: no attention
    kernel), so 'selective_op' keeps none of it: its forward is priced again; without dropout it is kept."""
    def attention_replayed(dropout: float) -> bool:
        model, inputs, loss_fn, targets = gpt.build(gpt.GPTConfig(attn_dropout=dropout))
        problem = problem_at(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                             checkpoint="selective_op", pipeline=False)
        base = problem.base_graph
        assert base is not None
        names = [n for n in problem.graph.order if n.startswith("scaled_dot_product_attention")
                 and problem.graph.nodes[n].block == "blocks.0"]
        assert len(names) == 1, names
        node, was = problem.graph.nodes[names[0]], base.nodes[names[0]]
        return node.costs[0].time > was.costs[0].time
    assert attention_replayed(0.1)
    assert not attention_replayed(0.0)


class _FoldingBlock(torch.nn.Module):
    """A block multiplying by a weight with ``@`` (``aten.matmul``, which runs an ``mm`` or not by its
    operands' layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) @ self.w)


class _FoldingMatmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_FoldingBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_op_policy_refuses_a_block_whose_matmuls_it_cannot_count() -> None:
    model = _FoldingMatmul()
    with pytest.raises(autopar.InputError, match="selective_op.*aten.matmul"):
        autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(4, 3, 8),), checkpoint="selective_op",
                     pipeline=False)
    autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(4, 3, 8),), checkpoint="selective", pipeline=False)


def test_scenarios_priced_from_shared_parts_match_each_priced_alone() -> None:
    """A memory search prices many scenarios of one prepared problem from parts priced once (each
    policy's replayed ops, regathered ops, parameters with their state twins: ``priced_under``);
    every node comes out as pricing that scenario alone gives it."""
    model, inputs, loss_fn, targets = llama.build()
    store = Problems(Step(model=model, example_inputs=inputs, loss_fn=loss_fn, example_targets=targets),
                     PlanConfig.from_options(pipeline=False))
    base = store.at(Place(mesh=autopar.Mesh({"dp": 2}, "cpu")))
    wanted = [s for s in scenarios(base) if s.micro_batches == 1]
    assert {s.checkpoint for s in wanted} >= {"none", "selective", "full"} and any(s.regather for s in wanted)
    assert any(s.checkpoint_blocks is not None for s in wanted) and any(s.zero1 or s.offload for s in wanted)
    for scenario in wanted:
        shared = priced_under(base, scenario)
        alone = priced_under(replace(base, parts=PricedParts()), scenario)
        assert shared.graph.order == alone.graph.order
        for name in alone.graph.order:
            a, b = shared.graph.nodes[name], alone.graph.nodes[name]
            assert (a.costs, a.comm_times, a.regather, a.block, a.recompute_memory, a.strategies) == \
                (b.costs, b.comm_times, b.regather, b.block, b.recompute_memory, b.strategies), (scenario, name)
        assert shared.folding.representative == alone.folding.representative
