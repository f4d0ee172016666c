"""Activation checkpointing (``checkpoint='full'`` / ``'selective'`` / ``'selective_op'``) trains to the
single-device numbers: loss, every gradient, every parameter after 3 AdamW steps, on GPT with dropout
in training mode (the recompute draws the forward's masks again) and on Llama, on dp=2 and
dp=2 x tp=2. The recompute re-runs exactly the forward collectives of the checkpointed
blocks (logged as phase "recompute"), and checkpointing frees activations: fewer bytes stay
alive between forward and backward under 'full' than 'selective_op', under 'selective_op' than
'selective', and under 'selective' than without it."""

from __future__ import annotations

import contextlib
import gc
import importlib
import math
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autopar
from autopar.passes.checkpoint_blocks import REGION_PREFIX
from autopar.runtime.forked import run_ranks
from autopar.runtime.recompute import Recompute
from examples import gpt, llama
from numerics_harness import Reference, check, reference, run_compiled

P_DROP = 0.1
SEED = 1234


def _gpt_dropout() -> Any:
    return gpt.build(gpt.GPTConfig(dropout=P_DROP, attn_dropout=P_DROP))


MODELS: dict[str, Callable[[], Any]] = {"gpt": _gpt_dropout, "llama": llama.build}
TP_PLANS = {"gpt": (gpt.TP_PLAN, gpt.TP_SP_PLAN), "llama": (llama.TP_PLAN, llama.TP_SP_PLAN)}


@dataclass(frozen=True)
class Case:
    model: str
    mesh: tuple[int, ...]
    policy: str
    plan: str = "free"
    """'free', or 'tp' / 'tp_sp' (the example's hand plan pinned on tp, dp on dp)."""
    blocks: int | None = None
    """checkpoint_blocks= (the first blocks checkpoint); None: all."""

    @property
    def names(self) -> tuple[str, ...]:
        return ("dp", "tp")[: len(self.mesh)]

    @property
    def id(self) -> str:
        first = f"-first{self.blocks}" if self.blocks is not None else ""
        return f"{self.model}-{'x'.join(map(str, self.mesh))}-{self.plan}-{self.policy}{first}"

    def compile_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"checkpoint": self.policy, "checkpoint_blocks": self.blocks, "seed": SEED}
        if self.plan != "free":
            kw["constraints"] = TP_PLANS[self.model][self.plan == "tp_sp"]
            kw["data_axes"] = ("dp",)
        return kw


CASES = [Case(model, mesh, policy, plan) for model in MODELS for mesh, plan in (((2,), "free"), ((2, 2), "tp"))
         for policy in ("full", "selective")] + [Case("llama", (2, 2), "full", "tp", blocks=1)] + [
    Case("gpt", (2,), "selective_op"), Case("llama", (2, 2), "selective_op", "tp")]


def _watch_regions(pm: autopar.ParallelModule) -> list[tuple[str, str, int, int]]:
    """Hooks on every checkpointed region: the collectives logged while one runs (the region's
    forward, then its recompute), appended to the returned list as they run."""
    inside: list[tuple[str, str, int, int]] = []
    for name, region in pm.program.named_children():
        if not name.startswith(REGION_PREFIX):
            continue
        start: list[int] = []
        region.register_forward_pre_hook(lambda m, a, start=start: start.append(len(pm._comm.log.entries)))
        region.register_forward_hook(lambda m, a, o, start=start: inside.extend(pm._comm.log.entries[start.pop():]))
    return inside


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = MODELS[case.model]()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **case.compile_kwargs(),
                         pipeline=False)
    inside = _watch_regions(pm)
    result = run_compiled(pm, (*inputs, *targets), ref)
    log = pm._comm.log.entries
    return {**result, "regions": sorted(n for n, _ in pm.program.named_children() if n.startswith(REGION_PREFIX)),
            "blocks": list(pm.plan.memory.checkpoint_blocks),
            "recompute_all": Counter(e for e in log if e[0] == "recompute"),
            "forward_in_blocks": Counter(("recompute", *e[1:]) for e in inside if e[0] == "forward"),
            "recompute_outside_regions": sum(e[0] == "recompute" for e in log) - sum(e[0] == "recompute" for e in inside)}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_checkpointed_step_matches_single_device(case: Case) -> None:
    ref = reference(MODELS[case.model], seed=SEED)
    results = run_ranks(train_on_rank, math.prod(case.mesh), case, ref)
    check(results, ref)
    for rank, r in enumerate(results):
        every = ["blocks.0", "blocks.1"] if case.model == "gpt" else ["layers.0", "layers.1"]
        assert r["blocks"] == every[:case.blocks]
        assert r["regions"] == sorted(REGION_PREFIX + b.replace(".", "_") for b in r["blocks"]), r["regions"]
        # every forward collective of a block runs again in its recompute, and nothing else does
        assert r["recompute_all"] == r["forward_in_blocks"], f"rank {rank}"
        assert r["recompute_outside_regions"] == 0, f"rank {rank}"
        if "tp" in case.names:  # the hand plan all-reduces row-parallel outputs inside each block
            assert r["recompute_all"], f"rank {rank}: no collective was recomputed"


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_reruns_the_blocks_forward_collectives(policy: str) -> None:
    """Sequence parallelism gathers and reduce-scatters inside each block: the recompute
    runs each of them again, with the same sizes, as phase "recompute"."""
    case = Case("gpt", (2, 2), policy, "tp_sp")
    ref = reference(MODELS[case.model], seed=SEED)
    results = run_ranks(train_on_rank, 4, case, ref)
    check(results, ref)
    for rank, r in enumerate(results):
        kinds = {kind for _, kind, _, _ in r["recompute_all"]}
        assert {"all_gather", "reduce_scatter"} <= kinds, (rank, r["recompute_all"])
        assert r["recompute_all"] == r["forward_in_blocks"], f"rank {rank}"
        assert r["recompute_outside_regions"] == 0, f"rank {rank}"


class _LiveOutputs(TorchDispatchMode):
    """Bytes of the storages ops produced while active that are still alive when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) is torch.Tensor:  # subclasses (a collective's pending result) wrap a plain tensor
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
        return out

    def alive_bytes(self) -> int:
        gc.collect()
        return sum(nbytes for ref, nbytes in self.storages.values() if ref() is not None)


def held_between_passes(rank: int, world: int) -> dict[str, int]:
    """Bytes the forward leaves alive for backward, per policy (GPT on dp=2)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    held = {}
    for policy in ("none", "selective", "selective_op", "full"):
        model, inputs, loss_fn, targets = gpt.build()
        pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, checkpoint=policy,
                             pipeline=False)
        watch = _LiveOutputs()
        with watch:
            loss = pm(*inputs, *targets)
        held[policy] = watch.alive_bytes()
        loss.backward()
        del loss
    return held


def test_checkpointing_frees_activations() -> None:
    for held in run_ranks(held_between_passes, 2):
        assert held["full"] < held["selective_op"] < held["selective"] < held["none"], held


def _stack(path: str) -> dict[str, tuple[str, type]]:
    return {"L__self__": ("L__self__", torch.nn.Module), **({path: (path, torch.nn.Module)} if path else {})}


def _interleaved() -> torch.fx.GraphModule:
    """x -> blocks.0 (a, c) with root nodes between: ``h`` reads only x (can go before),
    ``s`` reads a and is read by no block node (can go after), ``z`` reads a and feeds c (splits
    the block); ``r`` has no module stack (as a node a pass inserted) and is read by c only (joins).
    Traced names: a sin, h cos, s mul, z add, r exp, c mul_1 + add_1."""
    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = torch.sin(x)
        h = torch.cos(x)
        s = a * 2
        z = a + 1
        r = torch.exp(x)
        c = torch.mul(a, z) + r
        return c, h, s

    gm = torch.fx.symbolic_trace(step)
    paths = {"sin": "blocks.0.attn", "cos": "", "mul": "", "add": "", "mul_1": "blocks.0", "add_1": "blocks.0"}
    for node in gm.graph.nodes:
        if node.name in paths:
            node.meta["nn_module_stack"] = _stack(paths[node.name])
    return gm


def test_block_regions_made_contiguous() -> None:
    cb = importlib.import_module("autopar.passes.checkpoint_blocks")  # the package's name is the pass function
    gm = _interleaved()
    x = torch.randn(5)
    want = gm(x)
    owner = cb._owners(gm.graph, ["blocks.0"])
    assert sorted(n.name for n in owner) == ["add_1", "exp", "mul_1", "sin"]  # exp: read by the block only
    cb._make_contiguous(gm.graph, owner, "blocks.0")
    order = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert order == ["cos", "sin", "add", "exp", "mul_1", "add_1", "mul"], order
    runs = [[n.name for n in nodes] for _, nodes in cb._regions(gm.graph, owner)]
    assert runs == [["sin"], ["exp", "mul_1", "add_1"]], runs  # z reads a and feeds the block: two regions

    class Call(torch.nn.Module):
        def forward(self, region: torch.nn.Module, policy: str, *inputs: Any) -> Any:
            return region(*inputs)

    gm.add_submodule("recompute", Call())
    for i, (_, nodes) in enumerate(cb._regions(gm.graph, owner)):
        cb._outline(gm, f"region_{i}", nodes, "full", {})
    gm.graph.lint()
    gm.recompile()
    assert all(torch.equal(w, g) for w, g in zip(want, gm(x)))



class _NoLog:
    """A ``Comm`` stand-in for a region without collectives."""

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        yield


@pytest.mark.parametrize("policy", ["full", "selective", "selective_op"])
def test_recompute_replays_for_split_backward(policy: str) -> None:
    """A zero-bubble schedule's backward is two calls (input gradients, then weight gradients),
    and each recomputes the region: with ``replays`` both give the plain run's gradients (the
    dropout mask drawn again as in forward). Without it selective checkpointing refuses the
    second call (torch hands each kept matmul output out once)."""
    torch.manual_seed(0)
    region = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.5),
                                 torch.nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    weights = list(region.parameters())

    def split_backward(replays: bool | None) -> list[torch.Tensor]:
        """Input then weight gradients of one run (None: not checkpointed)."""
        run = Recompute(_NoLog(), torch.Generator(), replays=bool(replays))  # type: ignore[arg-type]
        with torch.random.fork_rng():
            torch.manual_seed(5)
            out = region(x) if replays is None else run(region, policy, x, matmuls=(0, 2))
        dx = torch.autograd.grad(out.sum(), x, retain_graph=True)
        return [*dx, *torch.autograd.grad(out.sum(), weights)]

    want = split_backward(None)
    assert all(torch.equal(w, g) for w, g in zip(want, split_backward(True), strict=True))
    if policy != "full":
        with pytest.raises(RuntimeError, match="backward an extra time"):
            split_backward(False)


def test_op_policy_keeps_every_other_matmul() -> None:
    """'selective_op' keeps the block's first, third... linear matmul (counted from the region's
    ``matmuls`` start) and recomputes the others; a region running another number of them than its
    plan counted is an error at its forward."""
    torch.manual_seed(0)
    region = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(3)])
    x = torch.randn(4, 8, requires_grad=True)
    mms: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten.mm.default:
                mms.append("mm")
            return func(*args, **(kwargs or {}))

    def recomputed_mms(before: int) -> int:
        """Matmuls run by forward and backward beyond the plain run's 3 + 6."""
        mms.clear()
        with Count():
            out = Recompute(_NoLog(), torch.Generator())(region, "selective_op", x, matmuls=(before, 3))  # type: ignore[arg-type]
            out.sum().backward()
        return len(mms) - 9
    assert recomputed_mms(0) == 1  # the second of three
    assert recomputed_mms(1) == 2  # this region starts at the block's second: its first and third
    with pytest.raises(RuntimeError, match="ran 3 linear matmuls .* its plan counted 2"):
        Recompute(_NoLog(), torch.Generator())(region, "selective_op", x, matmuls=(0, 2))  # type: ignore[arg-type]
