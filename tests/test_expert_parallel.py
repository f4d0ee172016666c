"""Expert parallelism is planned by cost: ``expert_axes`` leaves stacked expert weights free on a
data axis, and the planner splits them by expert (tokens travelling by all-to-all, priced forward
and backward) when that beats replicated experts. Training exactly: ``test_numerics_moe``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from torch.distributed.tensor import Shard

import autopar
from autopar.api.planning import prepare
from autopar.errors import InputError
from autopar.hardware import get_profile
from autopar.rules.strategy import parse_placements
from autopar.problem.constraints import expert_parameters
from autopar.problem.nodes import PARAM
from examples import hf_models, llama, moe
from tests.planning import assert_one_price

EP4 = autopar.Mesh({"ep": 4}, "h100")


def wide(capacity_factor: float | None) -> Any:
    """``examples/moe.py``'s wide MoE, two layers (the plan is folded: more would only take longer)."""
    return moe.build(wide_config(capacity_factor), batch=8, device="meta")


def wide_config(capacity_factor: float | None) -> moe.MoEConfig:
    return moe.MoEConfig(**{**moe.WIDE.__dict__, "layers": 2, "capacity_factor": capacity_factor})


def plan_wide(capacity_factor: float | None, expert_axes: tuple[str, ...]) -> autopar.Plan:
    model, inputs, loss_fn, targets = wide(capacity_factor)
    return autopar.plan(model, EP4, inputs, loss_fn=loss_fn, example_targets=targets, data_axes=("ep",),
                        expert_axes=expert_axes, pipeline=False)


@pytest.mark.parametrize("capacity_factor", [None, 1.25], ids=["dropless", "capacity"])
def test_expert_weights_are_the_batched_matmul_operands(capacity_factor: float | None) -> None:
    """Only the stacked expert weights (used as bmm operands) are left free; the router, attention
    and embeddings are dense weights."""
    cfg = moe.MoEConfig(vocab_size=32, max_seq_len=8, hidden=16, heads=2, kv_heads=1, ffn_hidden=16, layers=2,
                        capacity_factor=capacity_factor)
    model, inputs, loss_fn, targets = moe.build(cfg, batch=4)
    graph = prepare(model, {"ep": 2}, inputs, loss_fn=loss_fn, example_targets=targets).graph
    found = {graph.nodes[n].fqn for n in expert_parameters(graph)}
    assert found == {f"layers.{i}.moe.experts.w{j}" for i in range(2) for j in (1, 2, 3)}
    assert sum(graph.nodes[n].kind == PARAM for n in graph.order) > len(found)


@pytest.mark.parametrize("capacity_factor", [None, 1.25], ids=["dropless", "capacity"])
def test_wide_moe_plans_expert_parallel_by_cost(capacity_factor: float | None) -> None:
    """On ep=4 the wide MoE's experts split by expert and its tokens travel by all-to-all, both
    ways; the plan is faster than the one with experts pinned replicated (plain data parallelism);
    the ILP's objective is the plan's predicted step time, and each all-to-all is priced by the
    ring formula, (n-1) latencies and (n-1)/n of the local bytes, as written here by hand."""
    ep = plan_wide(capacity_factor, ("ep",))
    experts = {k: parse_placements(v) for k, v in ep.parameters.items() if ".experts." in k}
    assert experts and all(p == (Shard(0),) for p in experts.values()), experts
    # a rank's slots (bf16): E experts x B sequences x C slots x H / ep ranks, C = seq when dropless
    cfg = wide_config(capacity_factor)
    slots = cfg.experts * 8 * cfg.capacity(cfg.max_seq_len) * cfg.hidden * 2 // 4
    dispatch = [c for c in ep.collectives if ".moe" in c.module and c.kind == "all_to_all" and c.bytes == slots]
    # dispatch (into the experts) and combine, each reversed: on whichever edge of the tokens' way into
    # (and out of) the experts the ILP finds cheapest, its reshapes' or the experts' own (equal bytes)
    for layer in ("layers.0.moe", "layers.1.moe"):
        assert sorted(c.phase for c in dispatch if c.module.startswith(layer)) == ["backward"] * 2 + ["forward"] * 2
    assert_one_price(ep)
    link, n = EP4.link(0), 4
    bandwidth = EP4.hardware.bus_bandwidth_of("all_to_all", link.intra_node) or link.bandwidth  # measured, else the link's
    for c in dispatch:
        by_hand = EP4.hardware.collective_overhead + (n - 1) * link.latency + (n - 1) / n * c.bytes / bandwidth
        assert c.time_s == pytest.approx(by_hand, rel=1e-9)
    dense = plan_wide(capacity_factor, ())
    assert all(v == "R" for k, v in dense.parameters.items() if ".experts." in k)
    assert ep.predicted.step_time_s < dense.predicted.step_time_s


def test_expert_axes_must_be_data_axes_of_a_model_with_experts() -> None:
    """An expert axis splits the batch too; naming one outside ``data_axes`` (or a bare string) is refused,
    and so is one for a model without stacked expert weights (it would change nothing)."""
    model, inputs, loss_fn, targets = moe.build(moe.MoEConfig(vocab_size=32, max_seq_len=8, hidden=16, heads=2,
                                                              kv_heads=1, ffn_hidden=16, layers=1), batch=4)
    options: dict[str, Any] = {"loss_fn": loss_fn, "example_targets": targets}
    with pytest.raises(InputError, match=r"expert_axes \('ep',\) names 'ep', not in data_axes \('dp',\)"):
        autopar.plan(model, {"dp": 2, "ep": 2}, inputs, data_axes=("dp",), expert_axes=("ep",), **options)
    with pytest.raises(InputError, match=r"write \('ep',\)"):
        autopar.plan(model, {"ep": 2}, inputs, data_axes=("ep",), expert_axes="ep", **options)
    dense, dense_inputs, dense_loss, dense_targets = llama.build()
    with pytest.raises(InputError, match=r"expert_axes \('ep',\): no parameter of the model is a stack of expert"):
        autopar.plan(dense, {"ep": 2}, dense_inputs, loss_fn=dense_loss, example_targets=dense_targets,
                     data_axes=("ep",), expert_axes=("ep",))


def test_dp2ep_syncs_expert_gradients_over_dp_only() -> None:
    """dp x ep with both data axes (torchtitan's dp2ep): experts split on ep and replicated on dp, so
    their gradients are all-reduced in dp's buckets only; dense weights' in both axes' buckets (but the
    output layer's, which the plan may run row-parallel on ep, its logits reduce-scattered, as cheap)."""
    model, inputs, loss_fn, targets = wide(1.25)
    plan = autopar.plan(model, autopar.Mesh({"dp": 2, "ep": 4}, "h100"), inputs, loss_fn=loss_fn,
                        example_targets=targets, data_axes=("dp", "ep"), expert_axes=("ep",), pipeline=False)
    experts = {k: v for k, v in plan.parameters.items() if ".experts." in k}
    assert set(experts.values()) == {"RS(0)"}, experts
    synced = {dim: {p for b in plan.grad_buckets if b.mesh_dim == dim for p in b.params} for dim in (0, 1)}
    params = {n.name for n in plan.nodes if n.op == "parameter"}
    expert_nodes = {n for n in params if "_experts_" in n}
    assert len(expert_nodes) == len(experts)
    assert expert_nodes <= synced[0] and not expert_nodes & synced[1], synced
    assert synced[0] - synced[1] - expert_nodes <= {"p_model_output_weight"}, synced
    assert_one_price(plan)


def wide_mixtral() -> Any:
    """HF Mixtral with its default experts (captured as one ``autopar::moe_experts`` op), 2 layers of
    8 experts (H 1024, F 4096), top-2, 8 x 512 tokens, on the meta device."""
    return hf_models.build_mixtral_step(batch=8, layers=2, hidden=1024, heads=8, kv_heads=2, intermediate=4096,
                                        vocab=1024, seq=512, experts=8, top_k=2, device="meta")


def test_wide_hf_mixtral_plans_expert_parallel_with_variable_all_to_alls(imbalance: float = 1.2) -> None:
    """On ep=4 the wide HF Mixtral's experts split by expert: per layer and step, the counts (8 int64s)
    and two row all-to-alls forward (dispatch, combine) and two backward, each of the busiest rank's
    rows, ``moe_imbalance`` times k * T_local * H bf16 bytes (data dependent: the runtime's differ),
    priced by the ring formula; the ILP's objective is the predicted step, faster than replicated
    experts' (the profile's imbalance set to 1.2, not its default, to see it priced)."""
    hardware = dataclasses.replace(get_profile("h100"), moe_imbalance=imbalance)
    mesh = autopar.Mesh({"ep": 4}, hardware)
    model, inputs, loss_fn, targets = wide_mixtral()
    plan = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, data_axes=("ep",),
                        expert_axes=("ep",), pipeline=False)
    assert {v for k, v in plan.parameters.items() if ".experts." in k} == {"S(0)"}
    assert "expert parallel (2 layers on ep): priced at an expert load imbalance of 1.2" in " ".join(plan.notes)
    rows = int(imbalance * 2 * (8 * 512 // 4) * 1024 * 2)
    link, n = mesh.link(0), 4
    bandwidth = mesh.hardware.bus_bandwidth_of("all_to_all", link.intra_node) or link.bandwidth
    for layer in (0, 1):
        calls = [c for c in plan.collectives if c.module == f"model.layers.{layer}.mlp.experts"]
        assert sorted((c.phase, c.kind, c.bytes, c.data_dependent) for c in calls) == [
            ("backward", "all_to_all", rows, True)] * 2 + [("forward", "all_to_all", 64, False)] + [
            ("forward", "all_to_all", rows, True)] * 2
        for c in calls:
            by_hand = (mesh.hardware.collective_overhead + (n - 1) * link.latency
                       + (n - 1) / n * c.bytes / bandwidth)
            assert c.time_s == pytest.approx(by_hand, rel=1e-9)
    assert_one_price(plan)
    dense = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, data_axes=("ep",),
                         pipeline=False)
    assert {v for k, v in dense.parameters.items() if ".experts." in k} == {"R"}
    assert plan.predicted.step_time_s < dense.predicted.step_time_s


def _dispatch_on_rank(rank: int, world: int) -> Any:
    """``runtime.moe.ExpertDispatch`` on this rank's 8 of 16 tokens and 2 of 4 experts, against the
    one-device op on everything: the gradients' relative errors (tokens, router weights, expert
    weights) and the collectives logged; then the error when rank 1 routes a token to expert 7 (of 4)."""
    import torch
    import transformers.integrations.moe  # noqa: F401 - registers transformers::grouped_mm_fallback
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.capture.moe import MOE_EXPERTS
    from autopar.runtime.moe import ExpertDispatch
    from autopar.runtime.ops import CollectiveLog, Comm

    comm = Comm(init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    comm.log = CollectiveLog()
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(16, 8, generator=gen), torch.rand(16, 2, generator=gen),
               torch.randn(4, 16, 8, generator=gen), torch.randn(4, 8, 8, generator=gen)]
    ids = torch.rand(16, 4, generator=gen).argsort(dim=1)[:, :2]
    full = [t.clone().requires_grad_() for t in tensors]
    x, w, gate_up, down = full
    MOE_EXPERTS(x, ids, w, gate_up, down, "transformers::grouped_mm_fallback").sum().backward()
    tokens, experts = slice(8 * rank, 8 * rank + 8), slice(2 * rank, 2 * rank + 2)
    local = [t[tokens].clone().requires_grad_() for t in tensors[:2]] + \
        [t[experts].clone().requires_grad_() for t in tensors[2:]]
    layer = ExpertDispatch(comm)
    layer(local[0], ids[tokens], local[1], *local[2:], "transformers::grouped_mm_fallback", 0).sum().backward()
    wanted = [f.grad[tokens] for f in full[:2]] + [f.grad[experts] for f in full[2:]]
    errors = [float((a.grad - b).abs().max() / b.abs().max()) for a, b in zip(local, wanted)]  # relative
    if rank == 1:
        ids[8, 0] = 7
    try:
        layer(local[0], ids[tokens], local[1], *local[2:], "transformers::grouped_mm_fallback", 0)
    except ValueError as exc:
        return errors, list(comm.log.entries[:5]), str(exc)
    return errors, list(comm.log.entries[:5]), None


def test_expert_dispatch_matches_one_device_and_refuses_bad_ids_on_every_rank() -> None:
    """Two ranks, each with its tokens and its experts, compute what one device computes, gradients
    too (the all-to-alls' backward is the reverse all-to-all); they log the counts all-to-all (4
    int64s) and the rows' dispatch and combine (data-dependent bytes) forward and backward. An expert
    id out of range on one rank is refused on both (the other would wait for it in the all-to-all)."""
    from autopar.runtime.forked import run_ranks
    from autopar.runtime.ops import DATA_DEPENDENT

    for errors, log, refused in run_ranks(_dispatch_on_rank, 2):
        assert max(errors) < 1e-6, errors  # fp32: the weight gradients sum their rows in another order
        assert sorted(log) == sorted([("forward", "all_to_all", 0, 32)] + [
            (p, "all_to_all", 0, DATA_DEPENDENT) for p in ("forward", "forward", "backward", "backward")])
        assert refused is not None and "expert id outside [0, 4)" in refused
