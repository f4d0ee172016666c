"""Serving inputs (workload, SLO, cluster, traces), the roofline step times and the candidate deployments."""

from __future__ import annotations

import numpy as np
import pytest

from autopar.cost.collectives import CollectiveCall, collective_time
from autopar.errors import InputError, InputTypeError
from autopar.hardware import PROFILES
from autopar.rules.redistribute import ALL_REDUCE
from autopar.serving.candidates import candidate_deployments, tp_degrees
from autopar.serving.deployment import Deployment, Pool
from autopar.serving.roofline import LLAMA3_8B, RooflineStepTimes, TransformerShape
from autopar.serving.workload import (SLO, Cluster, Empirical, Fixed, LogNormal, Requests, Uniform, Workload,
                                      read_trace)


@pytest.mark.parametrize("dist, low, high", [(Fixed(value=7), 7, 7), (Uniform(low=3, high=9), 3, 9),
                                             (LogNormal(median=200, sigma=1.0, low=10, high=2000), 10, 2000),
                                             (Empirical(samples=(5, 50, 500)), 5, 500)])
def test_distributions_draw_positive_ints_in_range(dist, low: int, high: int) -> None:
    draws = dist.sample(np.random.default_rng(0), 5000)
    assert draws.dtype == np.int64 and draws.min() >= low and draws.max() <= high
    assert draws.mean() == pytest.approx(dist.mean, rel=0.1)


def test_lognormal_median_is_its_median() -> None:
    draws = LogNormal(median=300, sigma=0.8).sample(np.random.default_rng(1), 20_000)
    assert np.median(draws) == pytest.approx(300, rel=0.05)


def test_workload_takes_ints_or_distributions_and_poisson_arrivals() -> None:
    w = Workload(prompt_tokens=128, output_tokens=Uniform(low=1, high=4), arrival_rate=50.0, seed=3)
    r = w.sample(20_000)
    assert np.all(r.prompt_tokens == 128) and set(np.unique(r.output_tokens)) == {1, 2, 3, 4}
    gaps = np.diff(r.arrival_s)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: std = mean


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(prompt_tokens=0, output_tokens=1, arrival_rate=1.0), InputError, "prompt_tokens must be >= 1"),
    (dict(prompt_tokens=1.5, output_tokens=1, arrival_rate=1.0), InputTypeError, "must be an int"),
    (dict(prompt_tokens=1, output_tokens=1, arrival_rate=0.0), InputError, "arrival_rate must be a positive"),
    (dict(prompt_tokens=1, output_tokens=1, arrival_rate="fast"), InputTypeError, "arrival_rate must be a number"),
])
def test_bad_workloads_are_refused(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Workload(**kwargs)


def test_bad_distributions_slos_and_clusters_are_refused() -> None:
    with pytest.raises(InputError, match="low <= high"):
        Uniform(low=5, high=2)
    with pytest.raises(InputError, match="at least one sample"):
        Empirical(samples=())
    with pytest.raises(InputError, match="median"):
        LogNormal(median=-1, sigma=1)
    with pytest.raises(InputError, match="percentile"):
        SLO(ttft_s=1, tpot_s=1, percentile=1.5)
    with pytest.raises(InputError, match="latencies must be > 0"):
        SLO(ttft_s=0, tpot_s=1)
    with pytest.raises(InputError, match="unknown hardware 'tpu'"):
        Cluster(devices=8, hardware="tpu")
    with pytest.raises(InputError, match="whole nodes"):
        Cluster(devices=12, devices_per_node=8)
    assert Cluster(devices=16, hardware="h100").profile is PROFILES["h100"]


def test_trace_is_read_sorted_and_bad_rows_name_their_line(tmp_path) -> None:
    good = tmp_path / "trace.csv"
    good.write_text("arrival_s,prompt_tokens,output_tokens,user\n0.5,100,20,a\n0.1,50,10,b\n2,7,1,c\n")
    r = read_trace(good)
    assert list(r.arrival_s) == [0.1, 0.5, 2.0] and list(r.prompt_tokens) == [50, 100, 7]
    assert list(r.output_tokens) == [10, 20, 1]
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens\n0.5,100,20\n0.7,0,3\n")
    with pytest.raises(InputError, match="bad.csv:3"):
        read_trace(bad)
    missing = tmp_path / "missing.csv"
    missing.write_text("arrival_s,prompt_tokens\n0.5,100\n")
    with pytest.raises(InputError, match="missing output_tokens"):
        read_trace(missing)
    with pytest.raises(InputError, match="cannot read trace"):
        read_trace(tmp_path / "absent.csv")


def test_requests_take_lists_and_refuse_unsorted_or_fractional_counts() -> None:
    r = Requests(arrival_s=[0, 1.5], prompt_tokens=[10, 20], output_tokens=[1, 2])
    assert r.arrival_s.dtype == np.float64 and r.prompt_tokens.dtype == np.int64 and r.rate == pytest.approx(1 / 1.5)
    with pytest.raises(InputError, match="non-decreasing"):
        Requests(arrival_s=[1.0, 0.5], prompt_tokens=[1, 1], output_tokens=[1, 1])
    with pytest.raises(InputTypeError, match="must be ints"):
        Requests(arrival_s=[0.0], prompt_tokens=[1.5], output_tokens=[1])
    with pytest.raises(InputError, match="two distinct arrival times"):
        _ = Requests(arrival_s=[0.0], prompt_tokens=[1], output_tokens=[1]).rate


def test_llama3_8b_shape() -> None:
    assert LLAMA3_8B.params == pytest.approx(8.03e9, rel=0.001)
    assert LLAMA3_8B.kv_bytes_per_token == 128 * 1024  # 2 x 32 layers x 8 heads x 128 x 2 bytes


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound() -> None:
    hw = PROFILES["h100"]
    times = RooflineStepTimes(model=LLAMA3_8B, hardware="h100", tp=1)
    weights = (LLAMA3_8B.layer_params * LLAMA3_8B.layers + LLAMA3_8B.hidden * LLAMA3_8B.vocab) * 2
    kv = (1000 + 1) * LLAMA3_8B.kv_bytes_per_token
    assert times.decode_s(1, 1000) == pytest.approx((weights + kv) / (hw.memory_bandwidth * hw.memory_efficiency))
    flops = 2 * LLAMA3_8B.layer_params * 32 * 4096 + 4 * 128 * 32 * 32 * (4096 * 4097 // 2) + 2 * 4096 * 128256
    peak = hw.peak_flops_bf16 * hw.compute_efficiency
    assert times.prefill_s(4096, 4096 * 4097 // 2) == pytest.approx(flops / peak)


def test_roofline_tp_splits_work_and_pays_all_reduces() -> None:
    one, two = (RooflineStepTimes(model=LLAMA3_8B, hardware="h100", tp=tp) for tp in (1, 2))
    all_reduce = collective_time(CollectiveCall(ALL_REDUCE, 0, 4096 * LLAMA3_8B.hidden * 2), two.mesh)
    assert two.prefill_s(4096, 0) == pytest.approx(one.prefill_s(4096, 0) / 2 + 2 * 32 * all_reduce)
    assert two.kv_capacity_tokens > 2 * one.kv_capacity_tokens  # half the weights per device, half the KV
    assert two.kv_transfer_s(2048) < one.kv_transfer_s(2048)


def test_roofline_refuses_uneven_tp_and_kv_heads_replicate_past_their_count() -> None:
    with pytest.raises(InputError, match="does not split"):
        RooflineStepTimes(model=LLAMA3_8B, hardware="h100", tp=3)
    with pytest.raises(InputError, match="spans more than a node"):
        RooflineStepTimes(model=LLAMA3_8B, hardware="h100", tp=16)
    mqa = TransformerShape(layers=2, hidden=256, heads=8, kv_heads=2, intermediate=512, vocab=1000)
    four = RooflineStepTimes(model=mqa, hardware="h100", tp=4)
    assert four.kv_bytes_per_token_per_device == mqa.kv_bytes_per_token / 2  # one of 2 KV heads per device


def test_candidates_cover_aggregated_tp_and_disaggregated_splits() -> None:
    cluster = Cluster(devices=8, hardware="h100")
    assert tp_degrees(cluster, LLAMA3_8B) == [1, 2, 4, 8]
    deployments = candidate_deployments(cluster, LLAMA3_8B)
    assert all(d.devices == 8 for d in deployments)
    names = {d.name for d in deployments}
    assert {"agg tp=1 x8", "agg tp=2 x4", "disagg 4P(tp=1) + 4D(tp=1)", "disagg 2P(tp=2) + 1D(tp=4)"} <= names
    assert len([d for d in deployments if not d.disaggregated]) == 4


def test_deployment_and_pool_refuse_bad_shapes() -> None:
    times = RooflineStepTimes(model=LLAMA3_8B, hardware="h100")
    with pytest.raises(InputError, match="either serve"):
        Deployment(name="x", prefill=Pool(step_times=times, replicas=1))
    with pytest.raises(InputError, match="token_budget .* must be >= max_batch"):
        Pool(step_times=times, replicas=1, max_batch=512, token_budget=256)
    with pytest.raises(InputTypeError, match="StepTimes"):
        Pool(step_times=object(), replicas=1)  # type: ignore[arg-type]
