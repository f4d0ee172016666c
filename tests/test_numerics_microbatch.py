"""Micro-batches (``micro_batches=m``, ``pm.step``): a step of m micro-batches trains to the
single-device whole-batch numbers (loss, every gradient, parameters after 3 AdamW steps),
also when ignored targets make the micro-batches' counts differ (or leave one micro-batch
none to count); with dropout, to single-device gradient accumulation over the same
micro-batches (each micro-batch draws its own mask, so a whole-batch step draws other
masks); the program's collectives run once per micro-batch and the gradient buckets once
per step; misuse is refused clearly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime.forked import run_ranks
from examples import gpt, llama
import backward_prefetch
from numerics_harness import STEPS, Reference, check, reference, reference_accumulated, run_compiled

SEED = 1234


def _gpt_ignored() -> Any:
    """Targets = -100 (cross entropy's ignore_index) on most of the first rows and a few
    others: the micro-batches count different numbers of targets, so weighting them equally
    would be wrong."""
    model, inputs, loss_fn, (targets,) = gpt.build()
    targets = targets.clone()
    targets[0, 3:] = -100
    targets[1, :20] = -100
    targets[5, ::3] = -100
    return model, inputs, loss_fn, (targets,)


def _gpt_padded() -> Any:
    """The first micro-batch (of 4) counts no target at all (padding rows, every target -100):
    its own loss is 0 / 0 = NaN, but its share of the step's sum is 0, not NaN."""
    model, inputs, loss_fn, (targets,) = _gpt_ignored()
    targets[:2] = -100
    return model, inputs, loss_fn, (targets,)


def _regression(reduction: str) -> Callable[[], Any]:
    """An MLP with mse_loss: a mean over a count shapes fix (weights 1/m), or a sum (weights 1)."""
    def build() -> Any:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
        gen = torch.Generator().manual_seed(2)
        loss_fn = lambda out, t: torch.nn.functional.mse_loss(out, t, reduction=reduction)  # noqa: E731
        return model, (torch.randn(32, 16, generator=gen),), loss_fn, (torch.randn(32, 16, generator=gen),)
    return build


def _gpt_dropout() -> Any:
    return gpt.build(gpt.GPTConfig(dropout=0.1, attn_dropout=0.1))


MODELS: dict[str, Callable[[], Any]] = {"gpt": gpt.build, "llama": llama.build, "gpt_ignored": _gpt_ignored,
                                         "gpt_padded": _gpt_padded,
                                         "gpt_dropout": _gpt_dropout, "mse_mean": _regression("mean"),
                                         "mse_sum": _regression("sum")}
TP_PLANS = {"gpt": gpt.TP_PLAN, "llama": llama.TP_PLAN, "gpt_ignored": gpt.TP_PLAN}


@dataclass(frozen=True)
class Case:
    model: str
    mesh: tuple[int, ...]
    micro_batches: int | None
    plan: str = "dp"
    """'dp' (data_axes dp), 'dp_tp' (and the model's TP plan pinned on tp) or 'free'."""
    zero: int = 0
    """ZeRO stage on dp: 2 reduce-scatters gradients inside the program, every micro-batch."""
    regather_blocks: int | None = None
    """With ZeRO-3: only the first this many blocks gather their parameters again."""

    @property
    def id(self) -> str:
        zero = f"-zero{self.zero}" if self.zero else ""
        zero += "" if self.regather_blocks is None else f"-regather{self.regather_blocks}"
        mesh = "x".join(map(str, self.mesh)) + ("tp" if self.tp_only else "")
        return f"{self.model}-{mesh}-{self.plan}-m{self.micro_batches}{zero}"

    tp_only: bool = False
    """A 1-D mesh named tp: the loss runs replicated (the batch is not split)."""

    @property
    def names(self) -> tuple[str, ...]:
        return ("tp",) if self.tp_only else ("dp", "tp")[: len(self.mesh)]

    def compile_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"micro_batches": self.micro_batches}
        if self.plan in ("dp", "dp_tp") and not self.tp_only:
            kw["data_axes"] = ("dp",)
        if self.plan == "dp_tp":
            kw["constraints"] = TP_PLANS[self.model]
        if self.model.endswith("dropout"):
            kw["seed"] = SEED
        if self.zero:
            kw["zero"] = {"dp": self.zero}
        if self.regather_blocks is not None:
            kw["regather_blocks"] = self.regather_blocks
        return kw

    def reference(self) -> Reference:
        if self.model.endswith("dropout"):
            return reference_accumulated(MODELS[self.model], self.micro_batches or 1, seed=SEED)
        return reference(MODELS[self.model])


CASES = [
    Case("gpt", (2,), 4), Case("gpt", (2, 2), 2, "dp_tp"), Case("gpt", (2, 2), 4, "dp"),
    Case("llama", (2,), 2), Case("llama", (2, 2), 4, "dp_tp"),
    Case("gpt_ignored", (2,), 4), Case("gpt_ignored", (2, 2), 2, "dp_tp"), Case("gpt_padded", (2,), 4),
    Case("gpt_dropout", (2,), 2), Case("gpt", (2,), 2, "free", zero=2),
    Case("gpt", (2,), 2, zero=3, regather_blocks=1),  # each micro-batch prefetches block 0 behind held block 1
    Case("gpt_ignored", (2,), 4, "dp_tp", tp_only=True),  # a replicated loss counts its whole targets
    Case("mse_mean", (2,), 4), Case("mse_sum", (2,), 4),
    Case("gpt", (2,), None),  # one micro-batch: pm.step is forward + backward
]


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = MODELS[case.model]()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **case.compile_kwargs(),
                         pipeline=False)
    assert pm.plan.memory.micro_batches == (case.micro_batches or 1)
    counts = [repr(n.args[1:3]) for n in pm.program.graph.nodes  # a count may be a placeholder: no Nodes in results
              if n.op == "call_module" and n.target == "partial_mean_loss"]
    backward = backward_prefetch.watch(pm) if case.zero == 3 else []
    return {**run_compiled(pm, (*inputs, *targets), ref, step=True), "counts": counts, "backward": backward}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_step_matches_single_device(case: Case) -> None:
    ref = case.reference()
    results = run_ranks(train_on_rank, 4 if len(case.mesh) == 2 else 2, case, ref)
    check(results, ref)
    assert any(r["ran"] for r in results)
    if case.tp_only:  # counted on the whole targets, no collective: the count the step weighs by
        assert results[0]["counts"] == [repr(((), None))], results[0]["counts"]
    if case.zero:  # parameters stored split: gathered in the program, their gradients reduced there too
        assert any(kind == "all_gather" for (_, kind, _, _), _ in results[0]["ran"]), results[0]["ran"]
    if case.regather_blocks == 1:  # every micro-batch's run prefetches block 0's regathers as block 1's backward starts
        for r in results:
            runs = backward_prefetch.runs(r["backward"])
            assert len(runs) == STEPS * (case.micro_batches or 1)
            for run in runs:
                backward_prefetch.assert_prefetched(run, "blocks.0", after="blocks.1")


def test_unweighted_micro_batches_would_differ() -> None:
    """The ignored-targets case proves the weighting: the micro-batches' plain mean gives
    gradients far from the whole batch's (beyond the harness's tolerance many times over)."""
    model, inputs, loss_fn, (targets,) = _gpt_ignored()
    loss_fn(model(*inputs), targets).backward()
    whole = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    for x, t in zip(inputs[0].chunk(4), targets.chunk(4)):
        (loss_fn(model(x), t) / 4).backward()
    worst = max(((p.grad - whole[k]).abs().max() / whole[k].abs().max()).item() for k, p in model.named_parameters())
    assert worst > 0.1


def _accumulate_on_rank(rank: int, world: int, model_name: str) -> dict[str, Any]:
    """Two steps without zero_grad: each adds the step's gradient to what .grad held."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = MODELS[model_name]()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, micro_batches=2,
                         data_axes=("dp",), pipeline=False)
    pm.step(*inputs, *targets)
    once = {k: p.grad.clone() for k, p in pm.named_parameters()}
    pm.step(*inputs, *targets)
    return {"max_err": max((p.grad - 2 * once[k]).abs().max().item() for k, p in pm.named_parameters()),
            "scale": max(g.abs().max().item() for g in once.values())}


@pytest.mark.parametrize("model_name", ["gpt", "gpt_ignored"])
def test_step_adds_to_gradients_already_held(model_name: str) -> None:
    for r in run_ranks(_accumulate_on_rank, 2, model_name):
        assert r["max_err"] <= 1e-5 * r["scale"] + 1e-7, r


class _TwoLosses(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _errors_on_rank(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build()
    out: dict[str, str] = {}
    try:
        autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, micro_batches=3, pipeline=False)
    except autopar.InputError as exc:
        out["indivisible"] = str(exc)
    x, t = torch.randn(8, 8), torch.randint(0, 4, (8,))
    mixed = lambda out, t: torch.nn.functional.cross_entropy(out, t) + out.pow(2).mean()  # noqa: E731
    try:
        autopar.compile(_TwoLosses(), mesh, (x,), loss_fn=mixed, example_targets=(t,), micro_batches=2, pipeline=False)
    except autopar.InputError as exc:
        out["inexact"] = str(exc)
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, micro_batches=2,
                         data_axes=("dp",), pipeline=False)
    for what, call in (("call", lambda: pm(*inputs, *targets)),
                       ("short_batch", lambda: pm.step(inputs[0][:6], targets[0][:6]))):
        try:
            call()
        except autopar.InputError as exc:
            out[what] = str(exc)
    forward_only = autopar.compile(gpt.build()[0], mesh, inputs, train=False, pipeline=False)
    try:
        forward_only.step(*inputs)
    except autopar.InputError as exc:
        out["no_train"] = str(exc)
    return out


def test_misuse_is_refused_on_every_rank() -> None:
    for out in run_ranks(_errors_on_rank, 2):
        assert "micro_batches=3 must divide the batch" in out["indivisible"], out
        inexact = out["inexact"]
        assert "micro_batches=2: the step's loss is not a weighted sum" in inexact and "aten.add" in inexact, out
        assert "pm.step" in out["call"], out
        assert "(8, 64)" in out["short_batch"] and "2 micro-batches of (4, 64)" in out["short_batch"], out
        assert "train=False" in out["no_train"], out
