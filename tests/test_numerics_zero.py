"""ZeRO-2 and ZeRO-3 (FSDP) train to the single-device numbers (``numerics_harness``): loss,
every gradient, parameters after 3 AdamW steps, with the optimizer state as small as the
shards. ZeRO-3 frees each gathered parameter after forward (nothing holds it until
backward) and gathers it again once per use that autograd saves, which is exactly the
rule ``autopar.cost.saved`` states."""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.cost.saved import saved_inputs, saved_inputs_of_node
from autopar.rules.redistribute import ALL_GATHER, redistribute_steps
from autopar.rules.strategy import parse_placements
from autopar.problem.block_paths import block_of
from autopar.runtime.forked import run_ranks
from examples import gpt, llama
import backward_prefetch
from numerics_harness import STEPS, TP_PLANS, Reference, reference, run_compiled, run_checked

def _gpt_tied() -> Any:
    """GPT-2's tied head: one ZeRO-3 parameter read by an embedding (saves only the indices)
    and by the head's linear (saves the weight): gathered again once, for the linear."""
    model, inputs, loss_fn, targets = gpt.build()
    model.lm_head.weight = model.wte.weight
    return model, inputs, loss_fn, targets


def _gpt3() -> Any:
    """The GPT example with three blocks (a held block after one gathering again, and before)."""
    return gpt.build(gpt.GPTConfig(layers=3))


MODELS: dict[str, Callable[[], Any]] = {"gpt": gpt.build, "llama": llama.build, "gpt_tied": _gpt_tied, "gpt3": _gpt3}


@dataclass(frozen=True)
class Case:
    model: str
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    stage: int
    regather_blocks: int | None = None
    """Only the first this many blocks' parameters are gathered again (None: every one's)."""
    checkpoint_blocks: int = 0
    """The first this many blocks are checkpointed ('full'; their recompute gathers again)."""

    @property
    def id(self) -> str:
        first = "" if self.regather_blocks is None else f"-regather{self.regather_blocks}"
        first += f"-checkpoint{self.checkpoint_blocks}" if self.checkpoint_blocks else ""
        return f"{self.model}-{'x'.join(map(str, self.mesh))}-zero{self.stage}{first}"

    def compile_kwargs(self) -> dict[str, Any]:
        # data_axes: the batch stays split on dp, so each parameter is gathered where used
        # (on the cpu profile the tiny models would otherwise use the dp shards in place, as TP)
        kw: dict[str, Any] = {"zero": {"dp": self.stage}, "data_axes": ("dp",), "regather_blocks": self.regather_blocks}
        if "tp" in self.names:
            kw["constraints"] = TP_PLANS[self.model]
        if self.checkpoint_blocks:
            kw.update(checkpoint="full", checkpoint_blocks=self.checkpoint_blocks)
        return kw


CASES = [Case(model, mesh, names, stage) for model in ("gpt", "llama")
         for mesh, names, stage in [((2,), ("dp",), 2), ((2,), ("dp",), 3), ((4,), ("dp",), 2), ((4,), ("dp",), 3),
                                    ((2, 2), ("dp", "tp"), 3)]] + [
    Case("gpt_tied", (2,), ("dp",), 3), Case("gpt", (2,), ("dp",), 3, regather_blocks=1),
    Case("llama", (2, 2), ("dp", "tp"), 3, regather_blocks=1), Case("gpt3", (2,), ("dp",), 3, regather_blocks=2),
    Case("gpt3", (2,), ("dp",), 3, regather_blocks=2, checkpoint_blocks=1)]


def _source_val(node: Any) -> Any:
    """The (global) value an argument of the program stands for: through reshards to their input."""
    while isinstance(node, torch.fx.Node) and node.op == "call_module" and node.target in ("reshard", "regather"):
        node = node.args[0]
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def expected_regathers(program: torch.fx.GraphModule, mesh_shape: tuple[int, ...]) -> Counter[str]:
    """All-gathers backward runs per parameter by the rule: for every consumer of a
    ``self.regather`` that saves it (``saved_inputs``), its forward all-gathers again."""
    want: Counter[str] = Counter()
    for node in program.graph.nodes:
        if node.op != "call_module" or node.target != "regather":
            continue
        fqn, src, dst = node.args[1:4]
        gathers = sum(1 for s in redistribute_steps(parse_placements(src), parse_placements(dst))
                      if s.kind == ALL_GATHER and mesh_shape[s.mesh_dim] > 1)
        for user in node.users:
            slots = [a for a in (*user.args, *user.kwargs.values())
                     for a in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(a, torch.fx.Node)]
            args = torch.fx.node.map_arg(user.args, _source_val)
            kwargs = torch.fx.node.map_arg(user.kwargs, _source_val)
            saved = saved_inputs(user.target, args, kwargs)
            tensor_slots = [a for a in slots if isinstance(_source_val(a), torch.Tensor)]
            want[fqn] += gathers * sum(s for a, s in zip(tensor_slots, saved) if a is node)
    return want


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = MODELS[case.model]()
    full = {k: tuple(p.shape) for k, p in model.named_parameters()}
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **case.compile_kwargs(),
                         pipeline=False)
    regather_calls = [n for n in pm.program.graph.nodes if n.op == "call_module" and n.target == "regather"]
    backward = backward_prefetch.watch(pm)
    result = run_compiled(pm, (*inputs, *targets), ref)
    got: Counter[str] = Counter()
    for (fqn, *_), count in result["regathered"]:
        got[fqn] += count
    return {**result, "full": full, "regather_calls": len(regather_calls), "got": dict(got), "backward": backward,
            "want": {k: v for k, v in expected_regathers(pm.program, tuple(case.mesh)).items() if v}}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_zero_matches_single_device(case: Case) -> None:
    ref = reference(MODELS[case.model])
    results = run_checked(train_on_rank, case.mesh, case, ref)
    for r in results:
        assert all(local == state for local, state in r["adam_shapes"].values())
        split = [k for k, (local, _) in r["adam_shapes"].items() if local != r["full"][k]]
        assert len(split) >= len(r["full"]) - 2, split  # every parameter but odd-sized ones is a shard
        if case.stage == 2:
            assert r["regather_calls"] == 0 and r["got"] == {}
        else:
            assert r["regather_calls"] > 0
            assert r["got"] == r["want"] and r["got"], (r["got"], r["want"])
        blocks = list(dict.fromkeys(b for fqn in r["full"] if (b := block_of(fqn)) is not None))
        again = blocks[case.checkpoint_blocks:case.regather_blocks]  # None: every block; checkpointed ones replay
        if case.regather_blocks is not None:  # the first blocks' parameters only; the later ones' are held
            assert r["regather_planned"] and {block_of(fqn) for fqn in r["regather_planned"]} == set(again)
        if case.stage == 3:
            _check_backward_prefetch(r["backward"], blocks, again)
        if case.model == "gpt_tied" and "wte.weight" in r["regather_planned"]:
            # the embedding's use saves nothing; the head's saves the table (when the plan gathers it)
            assert sum(n for k, n in r["got"].items() if k in ("wte.weight", "lm_head.weight")) == 1, r["got"]


def _check_backward_prefetch(events: list[backward_prefetch.Event], blocks: list[str], again: list[str]) -> None:
    """In every step, each block gathering again but the last block was prefetched as the next
    block's backward started (whether that one gathers again or holds its own); the last
    block, when it gathers again, gathers on demand (nothing after it prefetches it)."""
    runs = backward_prefetch.runs(events)
    assert len(runs) == STEPS
    for run in runs:
        for block, after in zip(blocks, blocks[1:]):
            if block in again:
                backward_prefetch.assert_prefetched(run, block, after)
        if blocks[-1] in again:
            backward_prefetch.assert_on_demand(run, blocks[-1])
        started = [b for what, b, _ in run if what == "starts"]
        assert started == [after for block, after in zip(blocks, blocks[1:]) if block in again][::-1], started


def _gathers_alive(rank: int, world: int, stage: int) -> dict[str, Any]:
    """How many parameter gathers of a ZeRO ``stage`` step are still alive once forward returned."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, zero={"dp": stage},
                         data_axes=("dp",), pipeline=False)
    params = {id(p) for p in pm.parameters()}
    refs: list[weakref.ref[torch.Tensor]] = []
    for name in ("reshard", "regather"):
        module = pm.program.get_submodule(name)
        inner = module.forward

        def watch(x: torch.Tensor, *args: Any, _inner: Any = inner, **kwargs: Any) -> torch.Tensor:
            out = _inner(x, *args, **kwargs)  # kwargs: dtype, pending (a prefetched gather)
            if id(x) in params:
                refs.append(weakref.ref(out))
            return out
        module.forward = watch  # type: ignore[method-assign]
    loss = pm(*inputs, *targets)
    gc.collect()
    alive = sum(r() is not None for r in refs)
    loss.backward()
    return {"gathers": len(refs), "alive": alive}


def test_zero3_frees_gathered_parameters_after_forward() -> None:
    zero2 = run_ranks(_gathers_alive, 2, 2)[0]
    zero3 = run_ranks(_gathers_alive, 2, 3)[0]
    assert zero3["gathers"] > 0 and zero2["gathers"] > 0  # (the plans may differ: a re-gather is priced)
    assert zero3["alive"] == 0
    assert zero2["alive"] > 0  # linear and layer_norm keep theirs until backward (embedding does not)


AT = torch.ops.aten


@pytest.mark.parametrize("target, args, want", [
    (AT.linear.default, (torch.ones(2, 3, 8), torch.ones(4, 8), torch.ones(4)), (True, True, False)),
    (AT.embedding.default, (torch.ones(10, 8), torch.zeros(2, 3, dtype=torch.long)), (False, True)),
    (AT.layer_norm.default, (torch.ones(2, 8), [8], torch.ones(8), torch.ones(8), 1e-5, False), (True, True, True)),
    (AT.rms_norm.default, (torch.ones(2, 8), [8], torch.ones(8), 1e-5), (True, True)),
    (AT.mul.Tensor, (torch.ones(2, 8), torch.ones(8)), (True, True)),
    (AT.add.Tensor, (torch.ones(2, 8), torch.ones(8)), (False, False)),
])
def test_saved_inputs_of_the_examples_ops(target: Any, args: tuple[Any, ...], want: tuple[bool, ...]) -> None:
    assert saved_inputs(target, args) == want
    # what real tensors save under the same hooks (the rule probes meta tensors)
    real = [a.clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args]
    seen: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t._base if t._base is not None else t) or t,
                                                  lambda t: t):
        target(*real)
    tensors = [a for a in real if isinstance(a, torch.Tensor)]
    assert tuple(any(s is t for s in seen) for t in tensors) == want


def test_a_frozen_weight_is_saved_for_the_input_gradient_only() -> None:
    x, w = torch.ones(2, 8), torch.ones(4, 8)
    assert saved_inputs(AT.linear.default, (x, w), needs_grad=[True, False]) == (False, True)
    assert saved_inputs(AT.linear.default, (x, w), needs_grad=[False, True]) == (True, False)


def test_saved_inputs_of_a_captured_node() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 4))
    gm = torch.export.export(model, (torch.zeros(2, 3, dtype=torch.long),), strict=False).module()
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    assert saved_inputs_of_node(calls[AT.embedding.default]) == (False, True)
    assert saved_inputs_of_node(calls[AT.linear.default]) == (True, True, False)
