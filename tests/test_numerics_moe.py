"""Mixture-of-experts models train to the single-device numbers when compiled: loss (LM loss plus
the load-balancing loss), every gradient (the router's too) and every parameter after 3 AdamW
steps, on gloo ranks forked from this process (``numerics_harness``).

``examples/moe.py`` in both dispatch styles (dropless sorted dispatch, capacity-based one-hot
einsums), top-1 and top-2, with and without a shared expert. On "dp" the batch is pinned split
(``data_axes``): routing, dispatch and combine run on each rank's sequences. On "tp" the model is
wide enough that the planner splits the stacked expert weights by expert (``Shard(0)``) and runs
dispatch replicated, each rank computing its experts' slots and the outputs gathered back (what
Megatron calls the all-gather token dispatcher). On "ep" (an expert axis: ``expert_axes``, a data
axis whose expert weights are left to the planner) the batch is split as on dp, the wide model's
experts split by expert, and the slots travel to their expert's rank and back by all-to-all
(expert parallelism); with "dp" beside it the experts are replicated on dp, as torchtitan's dp2ep;
with "tp" beside it the planner splits the experts on tp too (tokens replicated there, gathered back).
With ZeRO-3 on "dp" beside "ep" (FSDP of the dense part) every weight is stored split on dp, the experts
by expert over both axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics_harness import Reference, reference, run_compiled, run_checked
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.rules.strategy import parse_placements
from examples import hf_models, moe


@dataclass(frozen=True)
class Case:
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    top_k: int
    capacity_factor: float | None = None
    shared_expert: bool = False
    zero: int | None = None
    """ZeRO stage on "dp" (FSDP of the dense part beside expert parallelism on "ep")."""

    @property
    def wide(self) -> bool:
        """Experts wide enough (and a batch large enough) that splitting them on tp or ep pays on the cpu profile."""
        return "tp" in self.names or "ep" in self.names

    @property
    def experts(self) -> int:
        """On ep, eight: the expert weights' gradient all-reduce the split saves then outweighs the all-to-alls;
        sixteen beside tp, which would otherwise take the whole expert split (tokens replicated there)."""
        if "ep" not in self.names:
            return 4
        return 16 if "tp" in self.names else 8

    @property
    def id(self) -> str:
        style = "dropless" if self.capacity_factor is None else f"capacity{self.capacity_factor}"
        shared = ("-shared" if self.shared_expert else "") + (f"-zero{self.zero}" if self.zero else "")
        return f"{'x'.join(map(str, self.mesh))}-{'x'.join(self.names)}-top{self.top_k}-{style}{shared}"

    def build(self) -> Any:
        hidden, ffn, batch, seq = (64, 512, 8, 16) if self.wide else (16, 16, 4, 8)
        cfg = moe.MoEConfig(vocab_size=32, max_seq_len=seq, hidden=hidden, heads=2, kv_heads=1, ffn_hidden=ffn,
                            layers=2, experts=self.experts, top_k=self.top_k, capacity_factor=self.capacity_factor,
                            shared_expert=self.shared_expert, aux_loss_coef=0.1)
        return moe.build(cfg, batch=batch)


DP, TP, DP_TP = ((2,), ("dp",)), ((2,), ("tp",)), ((2, 2), ("dp", "tp"))
EP, DP_EP, EP_TP = ((2,), ("ep",)), ((2, 2), ("dp", "ep")), ((2, 2), ("ep", "tp"))
CASES = [
    Case(*DP, 1), Case(*DP, 2), Case(*DP, 1, 1.0), Case(*DP, 2, 0.5),
    Case(*TP, 1), Case(*TP, 2), Case(*TP, 1, 1.0), Case(*TP, 2, 0.5),
    Case(*DP_TP, 2, shared_expert=True), Case(*DP_TP, 2, 1.0, shared_expert=True),
    Case(*EP, 1), Case(*EP, 2), Case(*EP, 1, 1.0), Case(*EP, 2, 0.5),
    Case(*DP_EP, 2), Case(*DP_EP, 1, 1.0, shared_expert=True), Case(*DP_EP, 2, zero=3),
    Case(*EP_TP, 2), Case(*EP_TP, 2, 1.0),
]


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = case.build()
    data_axes = tuple(a for a in case.names if a in ("dp", "ep"))
    expert_axes = ("ep",) if "ep" in case.names else ()
    zero = {"zero": {"dp": case.zero}} if case.zero else {}
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, data_axes=data_axes,
                         expert_axes=expert_axes, **{"pipeline": False, **zero})
    return {**run_compiled(pm, (*inputs, *targets), ref), "fallbacks": [str(f) for f in pm.plan.fallbacks],
            "experts": {k: v for k, v in pm.plan.parameters.items() if ".experts." in k},
            "stored": {k: v for k, v in pm.plan.parameters.items() if k.endswith(".weight") and "norm" not in k},
            "dispatch": sorted({(c.kind, c.axis, c.phase) for c in pm.plan.collectives if ".moe" in c.module})}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_compiled_moe_matches_single_device(case: Case) -> None:
    ref = reference(case.build)
    assert any("router" in k for k in ref.grads), "the router must get a gradient"
    if case.capacity_factor is not None:  # the same loss and gradients then mean the same tokens were dropped
        assert dropped_pairs(case) > 0, "no token over capacity: the case checks no dropping"
    results = run_checked(train_on_rank, case.mesh, case, ref)
    assert results[0]["fallbacks"] == [], results[0]["fallbacks"]
    assert any(r["ran"] for r in results), "nothing ran split: the case checks nothing parallel"
    experts = {k: parse_placements(v) for k, v in results[0]["experts"].items()}
    if case.wide:  # the case is meant to check experts split by expert across tp (or ep) ranks
        split = case.names.index("ep" if "ep" in case.names else "tp")
        assert all(p[split] == Shard(0) for p in experts.values()), results[0]["experts"]
    if case.zero:  # FSDP on dp: every weight stored split there (the experts by expert, on dp and ep: the
        # planner then dispatches by all-gathers, cheaper here than all-to-alls behind ZeRO-3's gathers)
        dp = case.names.index("dp")
        assert all(parse_placements(p)[dp].is_shard() for p in results[0]["stored"].values()), results[0]["stored"]
    elif "ep" in case.names:  # expert parallelism: tokens to their experts and back by all-to-all, both ways
        assert {("all_to_all", "ep", "forward"), ("all_to_all", "ep", "backward")} <= set(results[0]["dispatch"])
    if "dp" in case.names and "ep" in case.names and not case.zero:  # dp2ep: experts replicated on dp, summed there
        assert all(p[case.names.index("dp")] == Replicate() for p in experts.values()), results[0]["experts"]


def dropped_pairs(case: Case) -> int:
    """(token, choice) pairs the first MoE layer drops for lack of capacity, on one device."""
    model, inputs, _, _ = case.build()
    seen: list[torch.Tensor] = []
    layer = model.layers[0].moe
    handle = layer.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    with torch.no_grad():
        model(*inputs)
    handle.remove()
    routing = moe.route(layer.router, seen[0], layer.cfg.top_k)
    chosen = F.one_hot(routing.experts.transpose(1, 2).flatten(1, 2), layer.cfg.experts)  # GShard's queue order
    kept = (chosen.cumsum(dim=1) <= layer.cfg.capacity(seen[0].shape[1])) & chosen.bool()
    return int(chosen.sum() - kept.sum())


def build_hf_mixtral(experts_implementation: str | None = None) -> Any:
    """HF Mixtral, tiny, dropout off (``eval``); ``None``: transformers' default experts (grouped_mm)."""
    model, inputs, loss_fn, targets = hf_models.build_mixtral_step(
        batch=8, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=64, seq=16,
        experts_implementation=experts_implementation)
    model.eval()
    return model, inputs, loss_fn, targets


def train_hf_on_rank(rank: int, world: int, experts_implementation: str | None, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = build_hf_mixtral(experts_implementation)
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, data_axes=("dp",),
                         pipeline=False)
    ops = {n.op for n in pm.plan.nodes}
    return {**run_compiled(pm, (*inputs, *targets), ref), "fallbacks": [str(f) for f in pm.plan.fallbacks],
            "moe_experts": "autopar.moe_experts.default" in ops}


@pytest.mark.parametrize("experts_implementation", [None, "batched_mm"], ids=["default", "batched_mm"])
def test_hf_mixtral_matches_single_device(experts_implementation: str | None) -> None:
    """The default experts run as transformers' opaque grouped-matmul op under torch.export
    (``torch._grouped_mm`` has no fp32 meta kernel), the whole sorted region captured as one
    ``autopar::moe_experts`` op (``capture.moe_region``), each dp rank sorting its own tokens;
    ``batched_mm`` as index + bmm."""
    ref = reference(lambda: build_hf_mixtral(experts_implementation))
    assert any(".gate." in k for k in ref.grads), "the router must get a gradient"
    results = run_checked(train_hf_on_rank, (2,), experts_implementation, ref)
    assert results[0]["fallbacks"] == [], results[0]["fallbacks"]
    assert results[0]["moe_experts"] == (experts_implementation is None)
    assert any(r["ran"] for r in results)


AUX_LOSS_COEF = 0.1


def build_hf_mixtral_ep(top_k: int = 2, intermediate: int = 512, aux_loss: bool = False) -> Any:
    """HF Mixtral with its default (grouped_mm) experts, wide enough (16 experts of 512) that splitting
    them by expert pays on the cpu profile (of 1024: splitting their F on tp as well); dropout off
    (``eval``). ``aux_loss``: the model computes its own loss (``labels=``): the LM loss plus, in place
    (``loss += coef * aux_loss``), its load-balancing loss over every layer's router logits
    (``output_router_logits``), weighted ``AUX_LOSS_COEF``; then ``(model, inputs, None, (), kwargs)``."""
    sizes: dict[str, Any] = dict(batch=8, hidden=64, heads=4, kv_heads=2, intermediate=intermediate, vocab=64,
                                 seq=16, experts=16, top_k=top_k)
    example = hf_models.build_mixtral(**sizes) if aux_loss else hf_models.build_mixtral_step(**sizes)
    model = example[0]
    model.eval()
    model.config.output_router_logits = aux_loss
    model.router_aux_loss_coef = AUX_LOSS_COEF
    return example


@dataclass(frozen=True)
class HfCase:
    mesh: tuple[tuple[int, ...], tuple[str, ...]]
    top_k: int
    aux_loss: bool = False
    checkpoint: str | None = None
    """Pinned activation checkpointing: the expert layer's all-to-alls run again in backward."""
    family: str = "mixtral"
    """"qwen2_moe": HF Qwen2-MoE (softmax-then-top-k routing, a gated shared expert beside the experts)."""

    @property
    def id(self) -> str:
        extra = ("-aux" if self.aux_loss else "") + (f"-{self.checkpoint}" if self.checkpoint else "")
        return f"{self.family}-{'x'.join(self.mesh[1])}-top{self.top_k}{extra}"

    def build(self) -> Any:
        if self.family == "qwen2_moe":
            example = hf_models.build_qwen2_moe_step(batch=8, hidden=64, heads=4, kv_heads=2, intermediate=512,
                                                     vocab=64, seq=16, experts=16, top_k=self.top_k)
            example[0].eval()
            return example
        return build_hf_mixtral_ep(self.top_k, 1024 if "tp" in self.mesh[1] else 512, self.aux_loss)


HF_EP_CASES = [HfCase(EP, 2, aux_loss=True, checkpoint="selective"), HfCase(DP_EP, 1), HfCase(EP_TP, 2),
               HfCase(EP, 2, family="qwen2_moe")]
"""Top-2 and top-1, the load-balancing loss, checkpointing, dp2ep and TP inside the experts on HF Mixtral, and
HF Qwen2-MoE (its softmax-then-top-k router, a sigmoid-gated shared expert beside the split experts), in four
cases (CI time)."""


def train_hf_ep_on_rank(rank: int, world: int, case: HfCase, ref: Reference) -> dict[str, Any]:
    shape, names = case.mesh
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model, inputs, loss_fn, targets, *rest = case.build()
    kwargs = rest[0] if rest else {}
    data_axes = tuple(a for a in names if a in ("dp", "ep"))
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, example_kwargs=kwargs,
                         data_axes=data_axes, expert_axes=("ep",), checkpoint=case.checkpoint, pipeline=False)
    return {**run_compiled(pm, (*inputs, *targets), ref, kwargs=kwargs),
            "fallbacks": [str(f) for f in pm.plan.fallbacks],
            "experts": {k: v for k, v in pm.plan.parameters.items() if ".experts." in k},
            "dispatch": sorted({(c.kind, c.axis, c.phase) for c in pm.plan.collectives if c.data_dependent})}


@pytest.mark.parametrize("case", HF_EP_CASES, ids=[c.id for c in HF_EP_CASES])
def test_hf_mixtral_expert_parallel_matches_single_device(case: HfCase) -> None:
    """HF Mixtral's default experts (captured as one ``autopar::moe_experts`` op) split by expert on
    ep: each rank's (token, choice) pairs go to their experts' ranks and back by variable-split
    all-to-alls (``runtime.moe``); loss, every gradient (router included) and the parameters after
    3 AdamW steps are the single device's, and the all-to-alls that ran are the planned ones (with
    checkpointing, those of the replay too). With
    ``aux_loss`` the loss includes HF's load-balancing loss, computed from the router's logits beside
    the expert layer (the router's gradient then has both terms)."""
    names = case.mesh[1]
    ref = reference(case.build)
    assert any(".gate." in k for k in ref.grads), "the router must get a gradient"
    if case.aux_loss:  # the case checks nothing unless the loss includes the aux loss
        model, inputs, _, _, kwargs = case.build()
        with torch.no_grad():
            out = model(*inputs, **kwargs)
        lm = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), inputs[0][:, 1:].flatten())
        assert float(out.aux_loss) > 1.0  # about top_k at balance: it weighs in
        assert float(out.loss) == pytest.approx(float(lm + AUX_LOSS_COEF * out.aux_loss), rel=1e-5)
    results = run_checked(train_hf_ep_on_rank, case.mesh[0], case, ref)
    assert results[0]["fallbacks"] == [], results[0]["fallbacks"]
    split = names.index("ep")
    assert all(parse_placements(p)[split] == Shard(0) for p in results[0]["experts"].values()), results[0]["experts"]
    assert {("all_to_all", "ep", "forward"), ("all_to_all", "ep", "backward")} <= set(results[0]["dispatch"])
    if case.checkpoint:  # the blocks' replay runs the counts, dispatch and combine again (and the plan says so)
        assert ("all_to_all", "ep", "recompute") in results[0]["dispatch"]
        assert {k for (_, k, _, _), _ in results[0]["recomputed"]} == {"all_to_all"}
    if "dp" in names:  # dp2ep: experts replicated on dp
        assert all(parse_placements(p)[names.index("dp")] == Replicate() for p in results[0]["experts"].values())
    if "tp" in names:  # tensor parallel inside the experts: gate and up each split on F (strided), down on F
        placed = {k.rsplit(".", 1)[1]: v for k, v in results[0]["experts"].items()}
        assert placed == {"gate_up_proj": "S(0)S(1/2)", "down_proj": "S(0)S(2)"}, results[0]["experts"]


@dataclass(frozen=True)
class HfMoeCase:
    """DeepSeek-V3 (latent attention whose keys are filled into a ``new_empty`` buffer by slice copies) or
    Llama-4 (complex rotary embeddings) on dp, dp x tp, or ep with the experts pinned split by expert."""

    family: str
    mesh: tuple[tuple[int, ...], tuple[str, ...]]

    @property
    def id(self) -> str:
        return f"{self.family}-{'x'.join(self.mesh[1])}"

    def build(self) -> Any:
        """On ep, 16 experts of 512 (8 sequences of 16): splitting them by expert then pays on the cpu profile."""
        sizes: dict[str, Any] = dict(batch=4, seq=8, vocab=64)
        if "ep" in self.mesh[1]:
            sizes = dict(batch=8, seq=16, vocab=64, experts=16,
                         **{"moe_intermediate" if self.family == "deepseek_v3" else "intermediate": 512})
        example = getattr(hf_models, f"build_{self.family}")(**sizes)
        example[0].eval()
        return example


HF_WRITES_CASES = [HfMoeCase(family, mesh) for family in ("deepseek_v3", "llama4") for mesh in (DP, DP_TP, EP)]


def train_hf_writes_on_rank(rank: int, world: int, case: HfMoeCase, ref: Reference) -> dict[str, Any]:
    shape, names = case.mesh
    model, inputs, loss_fn, targets, kwargs = case.build()
    experts = {k: tuple(Shard(0) if a == "ep" else Replicate() for a in names)
               for k, _ in model.named_parameters() if ".experts." in k} if "ep" in names else None
    pm = autopar.compile(model, init_device_mesh("cpu", shape, mesh_dim_names=names), inputs, loss_fn=loss_fn,
                         example_targets=targets, example_kwargs=kwargs, data_axes=(names[0],),
                         expert_axes=("ep",) if "ep" in names else (), state_placements=experts, pipeline=False)
    return {**run_compiled(pm, (*inputs, *targets), ref, kwargs=kwargs),
            "dispatch": sorted({(c.kind, c.axis, c.phase) for c in pm.plan.collectives if c.data_dependent})}


@pytest.mark.parametrize("case", HF_WRITES_CASES, ids=[c.id for c in HF_WRITES_CASES])
def test_hf_deepseek_v3_and_llama4_match_single_device(case: HfMoeCase) -> None:
    """Both backward through what autograd differentiates and the plan once took as gradient-free
    (DeepSeek-V3's key buffer, Llama-4's complex rotation): loss, every gradient, parameters after
    3 AdamW steps are one device's on every mesh, experts split by expert on ep."""
    ref = reference(case.build)
    results = run_checked(train_hf_writes_on_rank, case.mesh[0], case, ref)
    if "ep" in case.mesh[1] and case.family == "deepseek_v3":  # its routed experts dispatch by all-to-all
        assert {("all_to_all", "ep", "forward"), ("all_to_all", "ep", "backward")} <= set(results[0]["dispatch"])
    # Llama-4's HF experts run every expert on every token (its router masks the outputs): no dispatch, the
    # experts' split weights gathered for their batched matmul
