"""Expert-parallel replicas in ``autopar.plan_serving`` (``serving.planned.EXPERT_PARALLEL``): a mixture of
experts served with its decode batch split on ep and its experts split by expert there, searched beside TP
replicas; planning only (the same layout on ranks: ``tests/test_serving_runtime.py``)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import InputError
from autopar.hardware import get_profile
from autopar.serving import Uniform
from autopar.serving.planned import plan_step_times
from autopar.serving.replicas import ReplicaOptions, _expert_degrees, replica_times
from examples import moe
from examples.llama import Llama, LlamaConfig

pytestmark = pytest.mark.slow

H100 = get_profile("h100")
WORKLOAD = autopar.Workload(prompt_tokens=Uniform(low=256, high=1024), output_tokens=Uniform(low=64, high=256),
                            arrival_rate=4.0, seed=0)
SLO = autopar.SLO(ttft_s=0.1, tpot_s=0.01)
FAST = {"max_batch": 16, "token_budget": 1024, "rel_tol": 0.05}
CFG = moe.MoEConfig(vocab_size=32000, max_seq_len=2048, hidden=2048, heads=16, kv_heads=4, ffn_hidden=1408,
                    layers=2, experts=64, top_k=6)
"""A DeepSeek-MoE-like layer (64 fine-grained experts, 6 chosen): reading every expert per decode step costs
more than the all-to-alls of its tokens, so the planner splits them by expert on ep."""


def _model() -> moe.MoETransformer:
    with torch.device("meta"):
        return moe.MoETransformer(CFG)


def test_expert_parallel_replicas_are_searched_beside_tensor_parallel_ones() -> None:
    """A mixture of experts on 2 devices: tp=1, tp=2 and ep=2 replicas planned. The ep replica's decode steps split
    every stacked expert weight by expert (S(0)) and keep the rest whole, the cache too, so a token's KV bytes per
    device are the replica's (2 layers x keys and values x 4 KV heads x 128 dims x 4 bytes, counted by hand). A
    dense model (no stacked expert weights) gets no ep replica, nor does a search whose TP degrees are pinned;
    ``ep_degrees`` names them."""
    cluster = autopar.Cluster(devices=2, hardware=H100)
    options = ReplicaOptions(longest=1280, mean_tokens=800, max_batch=16, token_budget=1024, step_overhead_s=0.0,
                             max_positions=2048)
    times, skipped = replica_times(_model(), cluster, 2, options, None, None)
    assert set(times) == {(1, 1, 1), (2, 1, 1), (1, 1, 2)} and not skipped
    ep = times[1, 1, 2]
    assert ep.devices == 2 and ep.kv_bytes_per_token_device == 2 * 2 * 4 * 128 * 4  # whole: layers x k, v x heads x dims
    for point in ep.decode_points:  # every stacked expert weight split by expert, the rest whole
        assert {v for k, v in point.parameters.items() if ".moe.experts." in k} == {"S(0)"}, point.parameters
        assert all(v == "R" for k, v in point.parameters.items() if ".moe.experts." not in k)
    with pytest.raises(InputError, match="expert-parallel replica"):
        plan_step_times(_model(), H100, 8, 2, max_context=1024, token_budget=1024, max_positions=2048,
                        transfer_intra_node=True, ep=2)
    with torch.device("meta"):
        dense = Llama(LlamaConfig(vocab_size=512, max_seq_len=2048, hidden=256, heads=4, kv_heads=2, ffn_hidden=512))
    assert _expert_degrees(dense, [1, 2], None, pinned=False) == []
    assert _expert_degrees(_model(), [1, 2], None, pinned=True) == []
    assert _expert_degrees(_model(), [1, 2, 4], (4,), pinned=True) == [4]
    with pytest.raises(InputError, match="no stacked expert weights"):
        _expert_degrees(dense, [1, 2, 4], (4,), pinned=False)
    with pytest.raises(InputError, match="planned decode batches"):
        _expert_degrees(_model(), [1, 2, 3, 6], (3,), pinned=False)
    with pytest.raises(InputError, match="ep_degrees"):
        autopar.plan_serving(_model(), cluster, WORKLOAD, SLO, ep_degrees=(3,))


def test_a_serving_plan_of_expert_parallel_replicas_says_so() -> None:
    """Only ep=2 replicas allowed (``tp_degrees=()``): the pool is one, shown and saved as expert parallel."""
    plan = autopar.plan_serving(_model(), autopar.Cluster(devices=2, hardware=H100), WORKLOAD, SLO,
                                disaggregated=False, tp_degrees=(), ep_degrees=(2,), **FAST)
    (pool,) = plan.pools
    assert (pool.tp, pool.pp, pool.ep, pool.replicas) == (1, 1, 2, 1) and plan.goodput_rps > 0
    assert plan.to_json()["pools"][0]["ep"] == 2
    assert "ep=2 (experts by expert, attention data parallel)" in str(plan)
