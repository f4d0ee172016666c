"""The pipeline search (``autopar.search.pipeline``) and each pp rank's memory under its
schedule (``pipeline.stage_memory``); planning only, no ranks."""

from __future__ import annotations

import math
from typing import Any

import pytest

import autopar
from autopar.errors import MemoryLimitError
from autopar.search.ilp import solve
from autopar.api.planning import plan_step
from autopar.pipeline.stages import PipelinePlan
from autopar.search.planned import PlannedStep, finish
from autopar.search.problem import scenarios
from autopar.pipeline.schedule_sim import WEIGHT_GRAD, replays, torch_order
from autopar.pipeline.spec import SCHEDULES, VIRTUAL_CHOICES, Pipeline, as_pipeline
from autopar.memory.backward import op_working_sets
from autopar.pipeline.stage_memory import MemoryShares, rank_peaks, rank_working_sets
from examples import llama

from tests.planning import problem_at

BYTES_PER_PARAM = 16
"""fp32 AdamW per parameter: weight 4, gradient 4, two moments 8 (``cost.precision`` FP32)."""


def _plan(pipeline: autopar.Pipeline, mesh: dict[str, int] | None = None, **options: Any) -> autopar.Plan:
    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=4))
    return autopar.plan(model, autopar.Mesh(mesh or {"pp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                        example_targets=targets, pipeline=pipeline, **options)


def _pinned(schedule: str, m: int, v: int = 1) -> autopar.Pipeline:
    return autopar.Pipeline(axis="pp", schedule=schedule, micro_batches=m, virtual_stages=v)


def test_stage_state_is_every_parameter_once() -> None:
    """On a pp-only mesh every stage holds its parameters whole: the stages' state adds up to
    16 bytes per parameter of the model (counted by hand from the module)."""
    model, _, _, _ = llama.build(llama.LlamaConfig(layers=4))
    params = sum(p.numel() for p in model.parameters())
    p = _plan(_pinned("1f1b", 4))
    assert sum(s.state_bytes for s in p.pipeline.stages) == params * BYTES_PER_PARAM
    assert all(s.activation_bytes > 0 for s in p.pipeline.stages)


def test_in_flight_micro_batches_by_schedule() -> None:
    """GPipe keeps all m micro-batches' activations; 1F1B's rank r at most p - r (Narayanan et
    al. 2021 §2.2.1); what the step adds besides (buffers several stages read, held reshards, the rank's own
    backward working set: ``memory.backward``) is the same on both, a stage's own buffers on its rank."""
    gpipe, one = _plan(_pinned("gpipe", 4)).pipeline, _plan(_pinned("1f1b", 4)).pipeline
    extras: dict[int, list[float]] = {}
    for pipe, in_flight in ((gpipe, [4, 4]), (one, [2, 1])):
        for s, k in zip(pipe.stages, in_flight):
            extras.setdefault(s.rank, []).append(
                pipe.rank_memory_bytes[s.rank] - s.state_bytes - s.buffer_bytes - k * s.activation_bytes)
    assert all(g == pytest.approx(o, rel=1e-9) for g, o in extras.values())
    assert one.rank_memory_bytes[0] < gpipe.rank_memory_bytes[0]


def test_pipelined_peak_is_the_busiest_rank() -> None:
    p = _plan(_pinned("1f1b", 4))
    assert p.predicted.peak_memory_bytes == max(p.pipeline.rank_memory_bytes)
    assert sum(p.predicted.memory_parts.values()) == pytest.approx(p.predicted.peak_memory_bytes)


@pytest.mark.slow
def test_search_picks_the_fastest_pinned_choice() -> None:
    """Every choice the search prices, pinned and planned alone, is no faster than its pick."""
    chosen = _plan(autopar.Pipeline(axis="pp"))
    pick = chosen.pipeline
    times = {}
    for c in autopar.Pipeline(axis="pp").choices(2, 4, blocks=4):
        times[(c.schedule, c.virtual_stages, c.micro_batches)] = _plan(c).predicted.step_time_s
    assert chosen.predicted.step_time_s == pytest.approx(min(times.values()), rel=1e-12)
    assert times[(pick.schedule, pick.virtual_stages, pick.micro_batches)] == chosen.predicted.step_time_s
    assert any("pipeline search" in n for n in chosen.notes)
    rows = [r for r in chosen.account if r.level == "pipeline"]  # the search's account: every choice, one chosen
    assert [r.item for r in rows if r.outcome == "chosen"] == [f"{pick.schedule} x{pick.virtual_stages} "
                                                                f"m={pick.micro_batches}"]
    assert {r.outcome for r in rows} <= {"chosen", "priced", "does not fit", "not played out", "refused"}


@pytest.mark.slow
def test_search_leaves_out_what_does_not_fit() -> None:
    """Below the free pick's peak the search picks a leaner pipeline, never predicted faster;
    below every pipeline's peak it says what the leanest needs."""
    free = _plan(autopar.Pipeline(axis="pp"))
    limit = free.predicted.peak_memory_bytes - 1
    tight = _plan(autopar.Pipeline(axis="pp"), memory_limit=limit)
    assert tight.predicted.peak_memory_bytes <= limit
    assert tight.predicted.step_time_s >= free.predicted.step_time_s
    with pytest.raises(MemoryLimitError, match="no pipeline fits .* the leanest of") as raised:
        _plan(autopar.Pipeline(axis="pp"), memory_limit=1e3)
    # the leanest priced was planned without the limit: the message also says why none was planned under it
    assert "the stage mesh's plan under the limit (the busiest rank's share): no plan fits" in str(raised.value)


def test_partly_pinned_search_keeps_the_pins() -> None:
    p = _plan(autopar.Pipeline(axis="pp", schedule="1f1b"))
    assert p.pipeline.schedule == "1f1b" and p.pipeline.virtual_stages == 1 and p.pipeline.micro_batches in (2, 4)


def test_micro_batches_split_over_the_data_axes() -> None:
    """With data parallelism inside the stages each micro-batch is split over the data axes:
    the search offers only counts leaving micro-batches that split (a batch of 8 on dp=2: not
    8 micro-batches of one row), rather than failing on one it chose itself."""
    assert {c.micro_batches for c in autopar.Pipeline(axis="pp").choices(2, 8, blocks=4, batch_ways=2)} == {2, 4}
    p = _plan(autopar.Pipeline(axis="pp", schedule="1f1b"), {"pp": 2, "dp": 2}, data_axes=("dp",))
    assert p.pipeline.micro_batches in (2, 4)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [_pinned("gpipe", 4), autopar.Pipeline(axis="pp")], ids=["pinned", "search"])
def test_a_binding_limit_never_gives_what_a_pipelined_step_cannot_run(pipeline: autopar.Pipeline) -> None:
    """Below the free plan's peak the stage mesh's ILP is solved under the limit, whose memory
    search would offload optimizer state (a pipelined step does not run that yet; ZeRO-1 is left
    out alike): the plan found keeps every state on the device, or none is found."""
    limit = 0.9 * _plan(_pinned("gpipe", 4)).predicted.peak_memory_bytes
    try:
        p = _plan(pipeline, memory_limit=limit)
    except MemoryLimitError:
        return
    assert p.predicted.peak_memory_bytes <= limit
    assert not p.memory.offload and not p.shard_buckets


def test_a_stage_plan_searches_neither_zero1_nor_offload() -> None:
    """The memory search of a pipeline's stage mesh has no scenario sharding optimizer state alone
    (ZeRO-1) or offloading it, which the pipelined runtime refuses; the same step without a
    pipeline has both; it checkpoints blocks as that one does (they recompute inside their stages);
    its memory row is the busiest rank's share (1F1B's first of 2: 2 of 4 blocks)."""
    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=4))
    step = {"loss_fn": loss_fn, "example_targets": targets}
    staged = problem_at(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, m=2, pipeline_ranks=2, **step)
    assert not any(s.zero1 or s.offload for s in scenarios(staged))
    assert {s.checkpoint for s in scenarios(staged)} == {"none", "selective", "full"}
    assert staged.memory_shares == MemoryShares(block_state=0.5, activations=1.0)
    whole = problem_at(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, m=2, micro_batches=2, **step)
    assert any(s.zero1 for s in scenarios(whole)) and any(s.offload for s in scenarios(whole))
    assert whole.memory_shares is None


def test_rank_memory_counts_every_activation_byte_of_the_step() -> None:
    """What GPipe's ranks hold besides their stages' state and m micro-batches of their
    activations, with every stage's activations of one micro-batch, is the whole step's
    activation memory on the stage mesh: its buffers (Llama's rotary tables) included, a buffer one
    stage alone reads on that stage's ranks only; of backward's largest working set (``memory.backward``),
    each rank holds its own stages' largest instead of the step's."""
    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=4))
    stage = autopar.plan(model, autopar.Mesh({"stage": 1}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                         micro_batches=4, memory_limit=math.inf)
    step = plan_step(model, autopar.Mesh({"pp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     pipeline=_pinned("gpipe", 4))
    pipe = step.plan.pipeline
    working, whole = _working_sets(step, pipe)
    assert working[0] < whole
    for s in pipe.stages:
        extra = pipe.rank_memory_bytes[s.rank] - s.state_bytes - s.buffer_bytes - 4 * s.activation_bytes
        total = extra + sum(t.activation_bytes + t.buffer_bytes for t in pipe.stages)
        assert total - working[s.rank] + whole == pytest.approx(stage.predicted.activation_memory_bytes, rel=1e-12)


def _working_sets(step: PlannedStep, pipe: PipelinePlan) -> tuple[list[float], float]:
    """Each pp rank's backward working set, and the step's (``stage_memory.rank_working_sets``)."""
    return rank_working_sets(op_working_sets(step.graph, step.chosen, step.ctx), pipe.stage_of,
                             [s.rank for s in pipe.stages])


def test_pipelined_ranks_hold_no_gradient_bucket_buffers() -> None:
    """A micro-batched stage plan holds its gradient-bucket buffers for the step (``bucket_buffer_bytes``);
    the pipelined runtime accumulates in ``.grad`` and keeps none, so on pp=2 x dp=2 the ranks hold
    the stage plan's activation bytes less those buffers, not the whole model's buffers each."""
    from autopar.result.build import bucket_buffer_bytes
    from autopar.search.planned import with_pipeline

    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=4))
    problem = problem_at(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, m=4, pipeline_ranks=2, limit=math.inf,
                         loss_fn=loss_fn, example_targets=targets)
    stage = finish(problem, solve(problem, None))
    buffers = bucket_buffer_bytes(stage.plan.grad_buckets, stage.ctx)
    assert buffers > 0
    pipe = with_pipeline(stage, _pinned("gpipe", 4), autopar.Mesh({"pp": 2, "dp": 2}, "cpu")).plan.pipeline
    assert pipe is not None
    working, whole = _working_sets(stage, pipe)
    for s in pipe.stages:
        extra = pipe.rank_memory_bytes[s.rank] - s.state_bytes - s.buffer_bytes - 4 * s.activation_bytes
        total = extra + sum(t.activation_bytes + t.buffer_bytes for t in pipe.stages) - working[s.rank] + whole
        assert total == pytest.approx(stage.plan.predicted.activation_memory_bytes - buffers, rel=1e-12)


def test_pipelines_priced_on_one_stage_plan_are_each_priced_alone() -> None:
    """A pipeline search prices one stage plan under each schedule in turn (``StepPipelines``), sharing what
    their cuts share: every pipeline is the one that stage plan cut for it alone gives, in either order, and
    a plan changed after it was priced changes none priced after it."""
    from autopar.search.planned import StepPipelines, with_pipeline

    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=4))
    problem = problem_at(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, m=4, pipeline_ranks=2, limit=math.inf,
                         loss_fn=loss_fn, example_targets=targets)
    stage = finish(problem, solve(problem, None))
    mesh = autopar.Mesh({"pp": 2, "dp": 2}, "cpu")
    choices = [_pinned("gpipe", 4), _pinned("1f1b", 4), _pinned("interleaved_1f1b", 4, 2), _pinned("zbv", 4, 2),
               _pinned("dualpipev", 4, 2), _pinned("1f1b", 4)]
    alone = [with_pipeline(stage, c, mesh) for c in choices]
    for order in (choices, choices[::-1]):
        shared = StepPipelines(stage, mesh)
        for choice in order:
            got, want = shared.cut(choice), alone[choices.index(choice)]
            assert isinstance(got, PlannedStep) and isinstance(want, PlannedStep)
            assert got.plan.predicted == want.plan.predicted and got.plan.pipeline == want.plan.pipeline
            assert (got.plan.pipeline.bubble_s, got.plan.pipeline.p2p_s) == \
                (want.plan.pipeline.bubble_s, want.plan.pipeline.p2p_s)
            got.plan.pipeline.grad_sync_per_rank_s.append(1.0)  # the plan's own lists
            got.plan.pipeline.tied.clear()
            got.plan.pipeline.stage_of.clear()
    assert len({a.plan.pipeline.stages[0].rank for a in alone}) == 1 and alone[2].plan.pipeline.stages[2].rank == 0


def test_a_stage_mesh_may_fit_by_its_share_of_the_state() -> None:
    """The memory search's quick bound (every node at its leanest, ``search.bounds.may_fit``) counts a
    stage mesh's nodes at the busiest rank's share, as its solve does: a limit below the whole
    model's leanest bytes but above the share's leaves the scenario to the solve."""
    from autopar.search.bounds import may_fit

    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=4))

    def prepared(limit: float) -> Any:
        return problem_at(model, autopar.Mesh({"stage": 1}, "cpu"), inputs, m=4, pipeline_ranks=4, limit=limit,
                          loss_fn=loss_fn, example_targets=targets)
    step = prepared(math.inf)
    nodes = [n for n in step.graph.nodes.values() if n.costs]
    whole = sum(min(c.memory for c in n.costs) for n in nodes)
    share = sum(min(c.memory for c in n.costs) * step.memory_shares.weight(n) for n in nodes)
    assert share < 0.75 * whole
    assert may_fit(prepared(0.95 * whole), {}, [])


@pytest.mark.parametrize("schedule, v, expected", [
    ("gpipe", 1, [16.0] * 4),  # every forward first: m in flight
    ("1f1b", 1, [4.0, 3.0, 2.0, 1.0]),  # Narayanan et al. 2021 §2.2.1: rank r holds p - r
    ("interleaved_1f1b", 2, [5.5, 4.5, 3.5, 2.5]),  # rank 0: p (1 + (p - 1) / (p v)), Korthikanti et al. 2022
    ("zbv", 2, [4.0] * 4),  # Qi et al. 2024 §6: ZB-V holds what 1F1B's first rank does, p, on every rank
])
def test_rank_peaks_follow_the_papers(schedule: str, v: int, expected: list[float]) -> None:
    """Micro-batches in flight per rank, walked through torch's orders (p=4, m=16; a rank's
    stages' activations add up to one unit whatever v)."""
    p = 4
    rank_of = [autopar.Pipeline(schedule=schedule, virtual_stages=v).stage_rank(s, p) for s in range(p * v)]
    assert rank_peaks(schedule, p, v, 16, rank_of, [0.0] * (p * v), [1.0 / v] * (p * v), 0.0) == expected


def test_a_schedule_with_one_number_of_stages_per_rank_is_pinned() -> None:
    """Naming the schedule and micro-batches pins a pipeline (gpipe/1f1b run 1 stage per rank,
    zbv/dualpipev 2): no search; interleaved_1f1b's stages per rank stay open."""
    assert as_pipeline(autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=4)).pinned
    assert as_pipeline(autopar.Pipeline(axis="pp", schedule="zbv", micro_batches=4)).virtual_stages == 2
    assert not as_pipeline(autopar.Pipeline(axis="pp", schedule="interleaved_1f1b", micro_batches=4)).pinned
    p = _plan(autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=4))
    assert not any("pipeline search" in n for n in p.notes)


def test_the_finest_micro_batch_count_is_searched() -> None:
    """Besides 1, 2, 4 and 8 x p, the count of one row per rank of the data split (the first
    axis of the stage mesh, or the data axes): with p=2 and a batch of 64 on dp=2, 32; on one
    device per stage, 64 micro-batches of one row."""
    search = autopar.Pipeline(axis="pp")
    assert {c.micro_batches for c in search.choices(2, 64, blocks=4)} == {2, 4, 8, 16, 64}
    assert {c.micro_batches for c in search.choices(2, 64, blocks=4, finest_ways=2)} == {2, 4, 8, 16, 32}
    assert {c.micro_batches for c in search.choices(2, 64, blocks=4, batch_ways=2, finest_ways=3)} == {2, 4, 8, 16}
    assert {c.micro_batches for c in search.choices(2, 64, blocks=4, batch_ways=2)} == {2, 4, 8, 16, 32}


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2),
                                        ("dualpipev", 2)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_the_work_floor_never_exceeds_the_played_out_step(schedule: str, v: int, p: int, m: int) -> None:
    """``work_floor_s`` (what ``Uncut(outrun=True)`` rules pipelines out by) is below every schedule's
    played-out step: each rank's actions run one after another, after the first micro-batch's forward
    reached its first stage, then its buckets and update; with the last rank's stages the slowest, it is
    that rank's wait for the first micro-batch and its work, exactly where nothing else waits."""
    import random

    from autopar.pipeline.spec import Pipeline, simulate_pipeline
    from autopar.pipeline.stages import work_floor_s
    rng = random.Random(0)
    rank_of = [Pipeline(schedule=schedule, virtual_stages=v).stage_rank(s, p) for s in range(p * v)]
    for _ in range(20):
        stage_s = [(rng.uniform(0.1, 1.0), rng.uniform(0.2, 2.0)) for _ in range(p * v)]
        sends = [rng.uniform(0.0, 0.3) if rank_of[s] != rank_of[min(s + 1, p * v - 1)] else 0.0
                 for s in range(p * v)]
        sync, update = [rng.uniform(0, 1) for _ in range(p)], [rng.uniform(0, 1) for _ in range(p)]
        sim = simulate_pipeline(schedule, p, v, m, stage_s, sends)
        drained = [acts[-1][4] if acts else 0.0 for acts in sim.placed]
        step = max(d + g + u for d, g, u in zip(drained, sync, update))  # no rank ends before this
        assert work_floor_s(m, stage_s, rank_of, sync, update, sends) <= step * (1 + 1e-12)
        # checkpointed blocks replayed (a part of each backward): a split backward replays them twice
        replayed = [(f, b, rng.uniform(0.0, b)) for f, b in stage_s]
        sim = simulate_pipeline(schedule, p, v, m, replayed, sends)
        drained = [acts[-1][4] if acts else 0.0 for acts in sim.placed]
        step = max(d + g + u for d, g, u in zip(drained, sync, update))
        extra = [(n - m) * r for n, (_, _, r) in zip(replays(schedule, p, v, m), replayed)]
        assert work_floor_s(m, stage_s, rank_of, sync, update, sends, extra) <= step * (1 + 1e-12)
        busy = [0.0] * p  # the floor's work is each rank's busy seconds exactly
        for (f, b), n, r in zip(stage_s, extra, rank_of):
            busy[r] += m * (f + b) + n
        assert sim.busy_s == pytest.approx(busy, rel=1e-9)
    if v == 1:  # the last stage busiest: its rank waits for the first micro-batch, then never again
        stage_s, sends = [(0.1, 0.2)] * (p - 1) + [(1.0, 2.0)], [0.05] * (p - 1) + [0.0]
        sim = simulate_pipeline(schedule, p, v, m, stage_s, sends)
        floor = work_floor_s(m, stage_s, rank_of, [0.0] * p, [0.0] * p, sends)
        assert floor == pytest.approx((p - 1) * 0.15 + m * 3.0, rel=1e-12)
        assert floor == pytest.approx(sim.placed[-1][-1][4], rel=1e-12)


@pytest.mark.slow
def test_ruling_out_by_work_floor_keeps_the_chosen_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search with pipelines ruled out by their work floor (or their stage plan's LP bound) chooses
    what it chooses when it plays every one out, and says what it left out."""
    from autopar.search import stage_plans

    searched = _plan(autopar.Pipeline(axis="pp"), {"pp": 2, "dp": 2})
    monkeypatch.setattr(stage_plans.Race, "saw", lambda self, priced: None)  # nothing is ever beaten
    every = _plan(autopar.Pipeline(axis="pp"), {"pp": 2, "dp": 2})
    assert searched.to_json()["pipeline"] == every.to_json()["pipeline"]
    assert searched.predicted.step_time_s == every.predicted.step_time_s
    left_out = ("not played out", "bounded out")  # a pipeline's work floor, or its stage plan's LP bound
    assert any(w in searched.notes[-1] for w in left_out) and not any(w in every.notes[-1] for w in left_out)


@pytest.mark.parametrize("mesh,options", [({"pp": 2, "dp": 2}, {"data_axes": ("dp",), "zero": {"dp": 3}}),
                                          ({"pp": 2, "tp": 2}, {"checkpoint": "full"})], ids=["zero3", "tp-ckpt"])
def test_the_ranks_work_adds_up_to_the_stage_plans_step(mesh: dict[str, int], options: dict[str, Any]) -> None:
    """Every micro-batch's forward and backward of every stage, every rank's buckets and update, and
    the last stage's summed loss add up to the stage plan's step: so p x the fastest fitting pipeline
    cuts off stage plans that cannot beat it (``search.pipeline_limited._under_limit``; a busiest rank
    works >= the average)."""
    plan = _plan(_pinned("1f1b", 4), mesh, **options)
    pipe = plan.pipeline
    assert pipe is not None
    work = (pipe.micro_batches * sum(s.forward_s + s.backward_s for s in pipe.stages)
            + sum(pipe.grad_sync_per_rank_s) + sum(pipe.update_per_rank_s) + pipe.loss_s)
    assert work >= pipe.stage_plan_step_time_s * (1 - 1e-9)
    assert plan.predicted.step_time_s * pipe.size >= work


@pytest.mark.slow
def test_cutting_off_slow_stage_plans_keeps_the_chosen_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a binding limit, the stage plans solved under it with the cutoff and the scenario
    tried first give the pipeline a search without them gives."""
    from autopar.search import pipeline_limited

    mesh = {"pp": 2, "dp": 2}
    limit = 0.8 * _plan(autopar.Pipeline(axis="pp"), mesh).predicted.peak_memory_bytes
    searched = _plan(autopar.Pipeline(axis="pp"), mesh, memory_limit=limit)
    plain = pipeline_limited._under_limit
    monkeypatch.setattr(pipeline_limited, "_under_limit", lambda stage, m, limit, unfit, cutoff_s, hint:
                        plain(stage, m, limit, unfit, math.inf, None))
    every = _plan(autopar.Pipeline(axis="pp"), mesh, memory_limit=limit)
    assert searched.to_json()["pipeline"] == every.to_json()["pipeline"]
    assert searched.predicted.step_time_s == every.predicted.step_time_s


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_split_backward_schedules_are_torchs(schedule: str) -> None:
    """``Pipeline.splits_backward`` names the schedules whose torch orders hold weight-gradient (W)
    actions, at every count they run."""
    for p in (2, 3, 4):
        for v in VIRTUAL_CHOICES[schedule]:
            for m in (p * v, 2 * p * v, 4 * p * v):
                pipeline = Pipeline(axis="pp", schedule=schedule, micro_batches=m, virtual_stages=v)
                pipeline.check_counts(p)
                split = any(kind == WEIGHT_GRAD for ops in torch_order(schedule, p, v, m) for kind, _, _ in ops)
                assert pipeline.splits_backward == split, (p, v, m)
