"""Training-mode dropout (p = 0.1, on the residual stream and the attention probabilities)
trains to the single-device numbers when the single device draws from the stream the
compiled module draws from (the counter stream by default: ``autopar.random.stream(seed)``;
with ``random_stream='torch'`` the default generator seeded alike): loss, every gradient,
every parameter after 3 AdamW steps, on dp, pinned tp, tp with sequence parallelism and free
dp x tp plans; replicas stay bit-identical and the collectives run are those planned. The
runtime's random op is also checked on its own, for both streams: the ranks' slices of every
supported op, put together, are the single-device op's output bit for bit."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.capture.graph import TensorMeta
from autopar.cost.model import CostContext, op_cost
from autopar.cost.precision import PRECISIONS
from autopar.mesh import Mesh
from autopar.rules.redistribute import redistribute_steps
from autopar.rules.strategy import R, OpCall, Strategy, parse_placements
from autopar.runtime.forked import run_ranks
from autopar.philox_spec import KERNEL_OPS_PER_COUNTER, KERNEL_OPS_PER_ELEMENT, eager_draw_ops, rank_region
from autopar.runtime.random import RandomOps
from autopar.runtime.stream import CounterStream
from examples import gpt, hf_models
from sharding_sim import assemble, distribute
from test_redistribute import run_steps
from numerics_harness import Reference, check, reference, run_compiled

aten = torch.ops.aten
P_DROP = 0.1
SEED = 1234


def _gpt() -> Any:
    return gpt.build(gpt.GPTConfig(dropout=P_DROP, attn_dropout=P_DROP))


def _hf_gpt2() -> Any:
    model, inputs, loss_fn, targets = hf_models.build_gpt2_step()  # HF's dropouts: 0.1 everywhere
    model.train()
    return model, inputs, loss_fn, targets


MODELS: dict[str, Callable[[], Any]] = {"gpt": _gpt, "hf_gpt2": _hf_gpt2}


@dataclass(frozen=True)
class Case:
    model: str
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    plan: str
    """'free', 'dp', 'tp' or 'tp_sp'."""
    seed: int | None = SEED
    """compile's seed=; None: rank 0's torch.initial_seed() (ranks seed their default
    generators differently, so this is the case that failed before the RNG discipline)."""
    sharded: tuple[str, ...] = ()
    """Random ops (op, placements) the plan must run split, so slicing is exercised."""
    stream: str = "counter"
    """compile's random_stream=."""
    zero: int | None = None
    """ZeRO stage pinned on dp."""

    @property
    def id(self) -> str:
        return f"{self.model}-{'x'.join(map(str, self.mesh))}-{self.plan}" + ("-default-seed" if self.seed is None else "") \
            + ("" if self.stream == "counter" else f"-{self.stream}") + ("" if self.zero is None else f"-zero{self.zero}")

    def compile_kwargs(self) -> dict[str, Any]:
        stream: dict[str, Any] = {"random_stream": self.stream}
        if self.zero is not None:
            stream["zero"] = {"dp": self.zero}
        if self.plan in ("tp", "tp_sp"):
            return {"constraints": gpt.TP_SP_PLAN if self.plan == "tp_sp" else gpt.TP_PLAN, **stream}
        return {"data_axes": ("dp",), **stream} if self.plan == "dp" else stream


DROPOUT, SDPA = "aten.dropout.default", "aten.scaled_dot_product_attention.default"
CASES = [
    # tp peers hold the residual stream replicated: before, each drew its own mask.
    Case("gpt", (4,), ("tp",), "tp", seed=None, sharded=(f"{SDPA} S(1)",)),
    Case("gpt", (2,), ("dp",), "dp", sharded=(f"{DROPOUT} S(0)", f"{SDPA} S(0)")),
    Case("gpt", (4,), ("tp",), "tp_sp", sharded=(f"{DROPOUT} S(1)", f"{SDPA} S(1)")),
    Case("gpt", (2, 2), ("dp", "tp"), "free"),
    Case("hf_gpt2", (2,), ("dp",), "dp", sharded=(f"{DROPOUT} S(0)", f"{SDPA} S(0)")),
    Case("hf_gpt2", (2, 2), ("dp", "tp"), "free"),
    Case("gpt", (2,), ("dp",), "dp", sharded=(f"{DROPOUT} S(0)",), stream="torch"),
    Case("gpt", (2,), ("dp",), "dp", sharded=(f"{DROPOUT} S(0)", f"{SDPA} S(0)"), zero=3),
]


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = MODELS[case.model]()
    torch.manual_seed(1000 + rank)  # per-rank default seeds: the module's stream must not depend on them
    seed = {} if case.seed is None else {"seed": case.seed}  # the default: what a user gets without asking
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **seed,
                         **case.compile_kwargs(), pipeline=False)
    randoms = [f"{n.args[0]} {n.args[1]}" for n in pm.program.graph.nodes if n.op == "call_module" and n.target == "random"]
    return {**run_compiled(pm, (*inputs, *targets), ref), "randoms": randoms}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_dropout_step_matches_single_device(case: Case) -> None:
    # With seed=None the module takes rank 0's initial seed: 1000 (see train_on_rank); the
    # single device draws from the state the compiled module starts in.
    ref = reference(MODELS[case.model], seed=SEED if case.seed is not None else 1000,
                    torch_generator=case.stream == "torch")
    results = run_ranks(train_on_rank, len(list(itertools.product(*map(range, case.mesh)))), case, ref)
    check(results, ref)
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks return different losses"
    randoms = results[0]["randoms"]
    assert randoms, "the step draws nothing: dropout was not captured in training mode"
    for wanted in case.sharded:
        assert wanted in randoms, (wanted, randoms)


def _loss_on_two_meshes(rank: int, world: int) -> list[float]:
    losses = []
    for shape, names, kwargs in (((4,), ("dp",), {"data_axes": ("dp",)}),
                                 ((2, 2), ("dp", "tp"), {"constraints": gpt.TP_SP_PLAN})):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model, inputs, loss_fn, targets = _gpt()
        pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, seed=SEED,
                             **{"pipeline": False, **kwargs})
        losses.append(pm(*inputs, *targets).full_tensor().item())
    return losses


def test_same_step_on_two_meshes_draws_the_same_masks() -> None:
    """dp=4 and dp=2 x tp=2 with sequence parallelism split dropout differently; the counter
    stream draws the same masks, so the loss is the one-device loss under the stream on both."""
    model, inputs, loss_fn, targets = _gpt()
    with autopar.random.stream(SEED):
        want = loss_fn(model(*inputs), *targets).item()
    results = run_ranks(_loss_on_two_meshes, 4)
    for dp4, dp2tp2 in results:
        assert dp4 == pytest.approx(want, rel=1e-5) and dp2tp2 == pytest.approx(want, rel=1e-5), (dp4, dp2tp2, want)


# The runtime op alone: every rank's slice, put together (by DTensor's own split, in
# sharding_sim), is the single-device draw, on 1-D and 2-D meshes.

X = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
Q = torch.randn(2, 4, 8, 4, generator=torch.Generator().manual_seed(1))
OPS: list[tuple[str, Any, tuple[Any, ...], tuple[str, ...]]] = [
    ("dropout", aten.dropout.default, (X, 0.3, True), ("S(0)", "S(1)S(2)", "S(0)S(0)", "RS(2)", "S(1/3)", "R")),
    ("dropout_", aten.dropout_.default, (X, 0.3, True), ("S(2)",)),
    ("native_dropout", aten.native_dropout.default, (X, 0.3, True), ("S(1)S(2)",)),
    ("alpha_dropout", aten.alpha_dropout.default, (X, 0.2, True), ("S(1)S(2)",)),
    ("feature_dropout", aten.feature_dropout.default, (X, 0.5, True), ("S(1)", "S(0)S(1)")),
    ("rand_like", aten.rand_like.default, (X,), ("S(1)S(2)", "S(2/2)")),
    ("randn_like", aten.randn_like.default, (X,), ("S(1)S(2)",)),
    ("bernoulli_p", aten.bernoulli.p, (X, 0.4), ("S(0)S(0)",)),
    ("bernoulli_probs", aten.bernoulli.default, (X.sigmoid(),), ("S(1)S(2)",)),
    ("bernoulli_", aten.bernoulli_.float, (X, 0.7), ("S(1)S(2)",)),
    ("uniform_", aten.uniform_.default, (X, -1.0, 2.0), ("S(0)S(2)",)),
    ("normal_", aten.normal_.default, (X,), ("S(1)S(2)",)),
    ("sdpa_heads", aten.scaled_dot_product_attention.default, (Q, Q, Q, None, 0.2), ("S(1)", "S(0)S(1)")),
    ("sdpa_causal", aten.scaled_dot_product_attention.default, (Q, Q, Q, None, 0.2, True), ("S(0)S(1)",)),
    ("rand", aten.rand.default, ([4, 6],), ("R",)),
    ("randn", aten.randn.default, ([4, 6],), ("R",)),
]


def _single_device(stream: str, op: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """``op`` on one device drawing from ``stream`` seeded SEED (its first output)."""
    torch.manual_seed(SEED)
    with autopar.random.stream(SEED) if stream == "counter" else contextlib.nullcontext():
        ref = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    return ref[0] if isinstance(ref, tuple) else ref


def _stream(stream: str) -> CounterStream | torch.Generator:
    return CounterStream(SEED) if stream == "counter" else torch.Generator().manual_seed(SEED)


STREAMS = ("counter", "torch")


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("name,op,args,layouts", OPS, ids=[o[0] for o in OPS])
def test_random_op_slices_one_global_draw(name: str, op: Any, args: tuple[Any, ...], layouts: tuple[str, ...],
                                          stream: str) -> None:
    ref = _single_device(stream, op, args)
    gen = torch.Generator()
    for placements in layouts:
        pl = parse_placements(placements)
        mesh = (2,) * len(pl)
        pieces = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                pieces[i] = distribute(a, pl, mesh, gen)
        outs = {}
        for coord in itertools.product(*map(range, mesh)):
            ops = RandomOps(mesh, coord, _stream(stream))
            out = ops(str(op), placements, tuple(ref.shape),
                      *[pieces[i][coord].clone() if i in pieces else a for i, a in enumerate(args)])
            outs[coord] = out[0] if isinstance(out, tuple) else out
        assert torch.equal(assemble(outs, pl, mesh), ref), f"{name} {placements}: slices differ from the single-device draw"


@pytest.mark.parametrize("op,args", [(aten.native_dropout.default, (X, 0.3, True)),
                                     (aten.bernoulli.default, (X.sigmoid(),))], ids=["dropout", "bernoulli_probs"])
@pytest.mark.parametrize("placements", ["S(2)", "S(0)S(2)", "S(2)S(2)", "S(2/2)"])
@pytest.mark.parametrize("stream", STREAMS)
def test_random_op_slices_a_zigzag_piece(op: Any, args: tuple[Any, ...], placements: str, stream: str) -> None:
    """On a zig-zag mesh dim (the last) each rank keeps the zig-zag piece of the global draw
    that a reshard from Replicate hands it (``run_steps`` as in test_redistribute)."""
    ref = _single_device(stream, op, args)
    pl = parse_placements(placements)
    mesh, zigzag = (2,) * len(pl), frozenset({len(pl) - 1})
    coords = list(itertools.product(*map(range, mesh)))
    steps = redistribute_steps((R,) * len(pl), pl)
    expected = run_steps({c: ref for c in coords}, steps, mesh, zigzag)
    given = run_steps({c: args[0] for c in coords}, steps, mesh, zigzag)
    for coord in coords:
        ops = RandomOps(mesh, coord, _stream(stream), zigzag)
        out = ops(str(op), placements, tuple(ref.shape), given[coord].clone(), *args[1:])
        out = out[0] if isinstance(out, tuple) else out
        assert torch.equal(out, expected[coord]), f"{placements} at {coord}"


@pytest.mark.parametrize("stream", STREAMS)
def test_replicated_draw_keeps_generators_in_lockstep(stream: str) -> None:
    """Ranks holding different pieces advance their generators alike: the next draw agrees."""
    states = []
    for coord in ((0,), (1,)):
        ops = RandomOps((2,), coord, _stream(stream))
        ops("aten.dropout.default", "S(0)", tuple(X.shape), X.chunk(2)[coord[0]].clone(), 0.5, True)
        states.append(ops.generator.get_state())
    same = states[0] == states[1] if isinstance(states[0], tuple) else torch.equal(states[0], states[1])
    assert same, states


def _dropout_price(ways: int, global_draws: bool, shape: tuple[int, ...] = (8, 64, 128), dim: int = 0,
                   hardware: str = "h100") -> float:
    """Seconds dropout's draw adds on one rank of a ``ways``-way split along ``dim``."""
    mesh = Mesh({"tp": ways}, hardware=hardware)
    ctx = CostContext(mesh=mesh, precision=PRECISIONS["fp32"], train=True, global_draws=global_draws)
    x = TensorMeta(shape, torch.float32)
    split = Strategy(((parse_placements(f"S({dim})")),), (parse_placements(f"S({dim})"),))
    drawing = op_cost(OpCall(aten.dropout.default, (x, 0.1, True), {}, (x,)), split, ctx).time
    return drawing - op_cost(OpCall(aten.dropout.default, (x, 0.0, True), {}, (x,)), split, ctx).time


def test_torch_stream_draw_is_priced_at_global_elements() -> None:
    """random_stream='torch': every rank draws all of dropout's elements, however it is split."""
    mesh = Mesh({"tp": 4}, hardware="h100")
    hw = mesh.hardware
    n = 8 * 64 * 128
    by_hand = max(n / (hw.peak_flops_fp32 * hw.compute_efficiency),  # one op per global element
                  2 * 4 * n / (hw.memory_bandwidth * hw.memory_efficiency))  # written, read back: fp32
    assert _dropout_price(4, True) == pytest.approx(by_hand, rel=1e-9)
    assert _dropout_price(1, True) == pytest.approx(_dropout_price(4, True), rel=1e-9)


def _scale_pass(n: float, hw: Any) -> float:
    """Dropout's scale: a pass over its fp32 elements reading the mask (``bytes``), one launch."""
    return max(n / (hw.peak_flops_fp32 * hw.compute_efficiency), n * 8 / (hw.memory_bandwidth * hw.memory_efficiency))


def test_counter_stream_draw_is_priced_as_the_fused_kernel_on_a_gpu() -> None:
    """On a GPU profile a rank's draw is one kernel over its own elements: its 32-bit integer
    instructions at the INT32 rate (or its mask's bytes, the slower), then dropout's scale pass;
    about one pass over the elements, shrinking with the split, 4x the rounds where the split
    leaves a rank runs of the last dim that are not whole counters."""
    big = (64, 512, 1024)
    hw = Mesh({"tp": 1}, hardware="h100").hardware
    n = 64 * 512 * 1024
    ops = n / 4 * KERNEL_OPS_PER_COUNTER + n * KERNEL_OPS_PER_ELEMENT
    kernel = max(ops / (hw.int_op_rate * hw.compute_efficiency), n / (hw.memory_bandwidth * hw.memory_efficiency))
    assert _dropout_price(1, False, big) == pytest.approx(kernel + max(_scale_pass(n, hw) + n / (
        hw.memory_bandwidth * hw.memory_efficiency), hw.op_overhead), rel=1e-9)
    one_pass = n * 8 / (hw.memory_bandwidth * hw.memory_efficiency)  # read and write fp32
    assert kernel < one_pass  # the draw costs less than one pass over its elements
    assert _dropout_price(4, False, big) == pytest.approx(_dropout_price(1, False, big) / 4, rel=1e-6)
    assert _dropout_price(4, False, big, dim=2) == pytest.approx(_dropout_price(4, False, big), rel=1e-9)
    odd, half = (64, 512, 1022), n * 1022 / 1024 / 2  # split on dim 2, a rank holds 511 of each row
    scale = max(_scale_pass(half, hw) + half / (hw.memory_bandwidth * hw.memory_efficiency), hw.op_overhead)
    per_element = _dropout_price(2, False, odd, dim=2) - scale  # one counter per element
    assert per_element > 3 * (_dropout_price(2, False, odd, dim=0) - scale)


def test_counter_stream_draw_is_priced_as_the_eager_ops_on_a_cpu() -> None:
    """On the cpu profile a rank's draw is the eager ops it dispatches (``eager_draw_ops``: each
    a fixed cost, and element-ops at the profile's rate) on its own region, then the scale pass."""
    hw = Mesh({"tp": 1}, hardware="cpu").hardware
    for shape, dim in (((8, 64, 128), 0), ((64, 512, 1024), 0), ((64, 512, 1022), 2)):
        region = rank_region(shape, parse_placements(f"S({dim})"), (2,), (0,))
        ops, element_ops = eager_draw_ops(region, "below")
        n = region.numel
        by_hand = ops * hw.int_op_overhead + element_ops / hw.int_op_rate + _scale_pass(n, hw) + n / (
            hw.memory_bandwidth * hw.memory_efficiency) + hw.op_overhead
        assert _dropout_price(2, False, shape, dim=dim, hardware="cpu") == pytest.approx(by_hand, rel=1e-9)


def _compile_with_rank_seed(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    try:
        autopar.compile(torch.nn.Linear(4, 4), mesh, (torch.randn(2, 4),), loss_fn=lambda out: out.sum(), seed=rank,
                        pipeline=False)
    except autopar.CompileError as exc:
        return str(exc)
    return "compiled"


def test_ranks_passing_different_seeds_fail_together() -> None:
    """Generators seeded differently would draw different masks: every rank refuses."""
    messages = run_ranks(_compile_with_rank_seed, 2)
    assert all("rank 0: 0, rank 1: 1" in m for m in messages), messages
