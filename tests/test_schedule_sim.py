"""The schedule simulator (``autopar.pipeline.schedule_sim``): its orders are torch's own, its
timelines respect every dependency and leave no unexplained idle time, a small case with
transfers is checked by hand, and the closed forms the planner used to price pipelines are
checked against it (``autopar.pipeline.spec``'s docstring quotes these results)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch.distributed.pipelining.schedules as ts

from autopar.pipeline.spec import Pipeline, simulate_pipeline
from autopar.pipeline.schedule_sim import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Simulation, simulate, torch_order

MULTI = {"interleaved_1f1b": ts.ScheduleInterleaved1F1B, "zbv": ts.ScheduleZBVZeroBubble,
         "dualpipev": ts.ScheduleDualPipeV}


def _ranks(schedule: str, p: int, v: int) -> list[int]:
    where = Pipeline(schedule=schedule, virtual_stages=v)
    return [where.stage_rank(s, p) for s in range(p * v)]


def _run(schedule: str, p: int, v: int, m: int, fiw: tuple[float, float, float], send: float = 0.0) -> Simulation:
    return simulate(schedule, p, v, m, [fiw] * (p * v), _ranks(schedule, p, v), [send] * (p * v))


def _table(action_list: list) -> list[tuple[str, int, int]]:
    out = []
    for a in action_list:
        for sub in (() if a is None else a.sub_actions or (a,)):
            if sub.computation_type.value in "FBIW":
                out.append((sub.computation_type.value, sub.stage_index, sub.microbatch_index))
    return out


def _stages(p: int, v: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=k, submod=None)
            for k in range(v)]


@pytest.mark.parametrize("schedule, p, v, m", [(s, p, 2, m) for s in MULTI for p, m in [(2, 4), (4, 8), (4, 12), (8, 16)]]
                         + [("interleaved_1f1b", p, v, m) for p, v, m in [(2, 4, 6), (4, 3, 8), (4, 4, 12), (3, 2, 9)]])
def test_multi_stage_orders_are_torchs_tables(schedule: str, p: int, v: int, m: int) -> None:
    """The compute actions of ``pipeline_order`` (which the runtime runs, with sends and receives
    put between them) verbatim, an OVERLAP_F_B opened into its forward, then its backward; the order
    is read without torch's lowering to communication actions, which leaves them as they are."""
    built = MULTI[schedule](_stages(p, v), m)
    order = torch_order(schedule, p, v, m)
    for r in range(p):
        assert list(order[r]) == _table(built.pipeline_order[r])
        with_comms = [a for a in built.pipeline_order_with_comms[r] if a.is_compute_op]
        assert list(order[r]) == _table(with_comms)
    if schedule == "dualpipev":
        overlapped = [a for a in built.pipeline_order[0] if a is not None and a.sub_actions]
        assert overlapped and [s.computation_type.value for s in overlapped[0].sub_actions] == ["F", "B"]


def _1f1b_runtime(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """``Schedule1F1B._step_microbatches`` of stage r: min(m, p - r) forwards, then a backward
    and a forward at a time while forwards remain, then the remaining backwards."""
    warmup = min(m, p - r)
    out = [("F", r, i) for i in range(warmup)]
    f, b = warmup, 0
    while True:
        out.append(("B", r, b))
        b += 1
        if f == m:
            break
        out.append(("F", r, f))
        f += 1
    return out + [("B", r, i) for i in range(b, m)]


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 4), (4, 9), (8, 16)])
def test_single_stage_orders(p: int, m: int) -> None:
    """GPipe: torch's table (all forwards, then all backwards). 1F1B: the runtime's order; torch's
    table agrees on every rank but the last, whose forwards it numbers 1..m."""
    gpipe = ts.ScheduleGPipe(_stages(p, 1)[0], m)
    for r in range(p):
        assert list(torch_order("gpipe", p, 1, m)[r]) == _table(gpipe.pipeline_order[r])
    table = ts.Schedule1F1B(_stages(p, 1)[0], m).pipeline_order
    order = torch_order("1f1b", p, 1, m)
    for r in range(p):
        assert list(order[r]) == _1f1b_runtime(p, m, r)
        if r < p - 1:
            assert list(order[r]) == _table(table[r])
    torch_last = _table(table[p - 1])
    assert [i for k, _, i in torch_last if k == "F"] == list(range(1, m + 1))
    assert [a for a in torch_last if a[0] == "B"] == [a for a in order[p - 1] if a[0] == "B"]


def _check_timeline(sim: Simulation, schedule: str, p: int, v: int, m: int, stage_s: list, send_s: list) -> None:
    """Each rank runs torch's order one action at a time, each action starts when its inputs are
    there, and as soon as both they and its rank are (no idle time without a reason)."""
    rank_of = _ranks(schedule, p, v)
    end: dict[tuple[str, int, int], float] = {}
    arrive: dict[tuple[str, int, int], float] = {}  # value -> when the stage that reads it has it
    for t in sim.transfers:
        arrive[(t.kind if t.kind == FORWARD else "G", t.stage, t.micro_batch)] = t.end_s
        cut = t.stage if t.kind == FORWARD else t.stage - 1
        assert t.src == rank_of[t.stage] != t.dst and t.end_s - t.start_s == pytest.approx(send_s[cut])
    for link in {(t.src, t.dst) for t in sim.transfers}:  # one at a time on a link, in the sender's order
        on = [t for t in sim.transfers if (t.src, t.dst) == link]
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(on, on[1:]))
    for r, acts in enumerate(sim.actions):
        assert [(a.kind, a.stage, a.micro_batch) for a in acts] == list(torch_order(schedule, p, v, m)[r])
        for a in acts:
            end[(a.kind, a.stage, a.micro_batch)] = a.end_s
    for r, acts in enumerate(sim.actions):
        free = 0.0
        for a in acts:
            f, i, w = stage_s[a.stage]
            assert a.end_s - a.start_s == pytest.approx({"F": f, "I": i, "W": w, "B": i + w}[a.kind])
            needs = _inputs(a, end, arrive, p * v)
            assert a.start_s >= max([free, *needs]) - 1e-12
            assert a.start_s == pytest.approx(max([free, *needs]), abs=1e-12)
            free = a.end_s
    assert sim.span_s == max(a.end_s for acts in sim.actions for a in acts)


def _inputs(a: Action, end: dict, arrive: dict, count: int) -> list[float]:
    """When the values action ``a`` reads are on its rank."""
    if a.kind == FORWARD:
        before = ("F", a.stage - 1, a.micro_batch)
        return [] if a.stage == 0 else [arrive.get(before, end.get(before))]
    if a.kind == WEIGHT_GRAD:
        return [end[(INPUT_GRAD, a.stage, a.micro_batch)]]
    own = [end[("F", a.stage, a.micro_batch)]]
    if a.stage == count - 1:
        return own
    key = ("I" if ("I", a.stage + 1, a.micro_batch) in end else "B", a.stage + 1, a.micro_batch)
    return own + [arrive.get(("G", a.stage + 1, a.micro_batch), end[key])]


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
                                         ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("p, m, seed", [(2, 4, 0), (4, 8, 1), (4, 12, 2), (3, 6, 3)])
def test_timelines_respect_dependencies(schedule: str, v: int, p: int, m: int, seed: int) -> None:
    gen = random.Random(seed)
    stage_s = [(gen.uniform(0.5, 2), gen.uniform(0.5, 2), gen.uniform(0.1, 1)) for _ in range(p * v)]
    send_s = [gen.uniform(0, 0.8) for _ in range(p * v)]
    sim = simulate(schedule, p, v, m, stage_s, _ranks(schedule, p, v), send_s)
    _check_timeline(sim, schedule, p, v, m, stage_s, send_s)
    bare = simulate(schedule, p, v, m, stage_s, _ranks(schedule, p, v))
    _check_timeline(bare, schedule, p, v, m, stage_s, [0.0] * (p * v))
    assert bare.span_s <= sim.span_s and not bare.transfers


def test_transfers_by_hand() -> None:
    """GPipe, 2 ranks, 2 micro-batches, F = 1, B = 2 (I = W = 1). A transfer c delays its receiver;
    the transfers from one rank to another run one after another."""
    fiw = [(1.0, 1.0, 1.0)] * 2
    # c = 0.5: rank 1 runs F0 1.5-2.5, F1 2.5-3.5, B0 3.5-5.5, B1 5.5-7.5; rank 0 B0 6-8, B1 8-10
    sim = simulate("gpipe", 2, 1, 2, fiw, [0, 1], [0.5, 0.0])
    assert [(a.start_s, a.end_s) for a in sim.actions[1]] == [(1.5, 2.5), (2.5, 3.5), (3.5, 5.5), (5.5, 7.5)]
    assert [(a.start_s, a.end_s) for a in sim.actions[0]] == [(0, 1), (1, 2), (6, 8), (8, 10)]
    assert sim.span_s == 10 and sim.busy_s == [6, 6] and sim.bubble_s == 4
    # c = 1.5, longer than a forward: F1's activation waits for F0's on rank 0's link (2.5-4, not 2-3.5)
    sim = simulate("gpipe", 2, 1, 2, fiw, [0, 1], [1.5])
    assert [(t.kind, t.micro_batch, t.start_s, t.end_s) for t in sim.transfers] == [
        ("F", 0, 1, 2.5), ("F", 1, 2.5, 4), ("B", 0, 7, 8.5), ("B", 1, 9, 10.5)]
    assert sim.span_s == 12.5


def test_v_schedules_hand_over_on_one_rank() -> None:
    """ZB-V and DualPipeV run stages p - 1 and p on rank p - 1: no transfer crosses that cut."""
    for schedule in ("zbv", "dualpipev"):
        sim = _run(schedule, 4, 2, 8, (1.0, 1.0, 1.0), send=0.25)
        assert {(t.src, t.dst) for t in sim.transfers} == {(0, 1), (1, 2), (2, 3), (3, 2), (2, 1), (1, 0)}
        crossing = {(t.stage, t.kind) for t in sim.transfers}
        assert (3, "F") not in crossing and (4, "I") not in crossing and (4, "B") not in crossing


def test_rank_mapping_is_checked() -> None:
    with pytest.raises(ValueError, match="runs stages on pp ranks"):
        simulate("zbv", 2, 2, 4, [(1.0, 1.0, 1.0)] * 4, [0, 1, 0, 1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 64)])
@pytest.mark.parametrize("f, b", [(1.0, 2.0), (2.0, 1.0), (0.5, 0.5)])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_stages(schedule: str, p: int, m: int, f: float, b: float) -> None:
    """Even stages, no transfers: (m + p - 1)(F + B), exactly (GPipe; Narayanan et al. 2021 §2.2.1)."""
    sim = _run(schedule, p, 1, m, (f, b / 2, b / 2))
    assert sim.span_s == (m + p - 1) * (f + b) and sim.bubble_s == (p - 1) * (f + b)
    priced = simulate_pipeline(schedule, p, 1, m, [(f, b)] * p)  # what a plan's bubble is read from
    assert (priced.span_s, priced.bubble_s) == (sim.span_s, sim.bubble_s)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 4), (4, 2, 6), (4, 2, 8), (4, 2, 10), (4, 3, 8), (4, 4, 16),
                                     (8, 2, 8), (8, 2, 12), (8, 2, 64)])
@pytest.mark.parametrize("f, b", [(1.0, 2.0), (2.0, 1.0), (1.0, 1.0)])
def test_interleaved_takes_m_plus_p_minus_1_over_v(p: int, v: int, m: int, f: float, b: float) -> None:
    """m >= p: (m + (p - 1) / v) rank-micro-batches of v (F + B), exactly (Narayanan et al. 2021
    §2.2.2), whether m is a multiple of p or not."""
    sim = _run("interleaved_1f1b", p, v, m, (f, b / 2, b / 2))
    assert sim.span_s == pytest.approx((m + (p - 1) / v) * v * (f + b), rel=1e-12)
    assert sim.bubble_s == pytest.approx((p - 1) * (f + b), rel=1e-12)


def test_interleaved_with_fewer_micro_batches_than_ranks() -> None:
    """m < p (torch runs one round of m): the fill is not shortened v-fold any more."""
    assert _run("interleaved_1f1b", 4, 2, 3, (1.0, 0.5, 0.5)).bubble_s == 4 * 2
    assert _run("interleaved_1f1b", 4, 2, 2, (1.0, 0.5, 0.5)).bubble_s == 5 * 2


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8])
def test_zero_bubble_v(p: int) -> None:
    """ZB-V: with F = I = W no rank idles once started (Qi et al. 2024 §6's zero bubble, counted per
    stage), but the last rank waits p - 1 forwards for its first input: bubble (p - 1) F. The
    formula priced before, (p - 1)(F + B - 2W) with B = W, gave 0, and (p - 1) I for F = 2I = 2W."""
    m = 4 * p
    even = _run("zbv", p, 2, m, (1.0, 1.0, 1.0))
    assert even.bubble_s == p - 1 and max(even.windows_s) == max(even.busy_s)
    assert _run("zbv", p, 2, m, (2.0, 1.0, 1.0)).bubble_s == 3 * p - 4  # F = 2I = 2W: (3p - 4) I
    assert _run("zbv", p, 2, m, (1.0, 2.0, 1.0)).bubble_s == 2 * (p - 1)  # I = 2F = 2W: (p - 1) I


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8])
def test_dualpipev(p: int) -> None:
    """DualPipeV as torch runs it (forward, then backward, in each overlapped pair): (p - 1) F
    with F = I = W and with F = 2I = 2W, (3p - 4) F with I = 2F = 2W."""
    m = 4 * p
    assert _run("dualpipev", p, 2, m, (1.0, 1.0, 1.0)).bubble_s == p - 1
    assert _run("dualpipev", p, 2, m, (2.0, 1.0, 1.0)).bubble_s == 2 * (p - 1)
    assert _run("dualpipev", p, 2, m, (1.0, 2.0, 1.0)).bubble_s == 3 * p - 4
