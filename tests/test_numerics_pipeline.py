"""Pipelined steps (``pipeline=autopar.Pipeline(...)``, ``pm.step``) train to the single-device
numbers: loss on every rank, every gradient (whole tensors, gathered over the stage mesh) and
every parameter after 3 AdamW steps, for each schedule, with tensor and data parallelism (and
ZeRO-3) inside the stages, with checkpointed blocks recomputed inside them, also for HF's Llama
computing its own loss from padded labels; each rank runs the blocks the plan cut into its
stages, and the stages' replicas stay bitwise equal. Plus the pipeline's plan (cuts, bubble, JSON, text)
and the inputs it refuses."""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.cost.collectives import ALL_REDUCE, CollectiveCall, collective_time
from autopar.errors import InputError
from autopar.runtime.forked import TIMEOUT_S, run_ranks
from autopar.runtime.ops import CollectiveLog
from autopar.runtime.pipeline import PipelinedModule
from autopar.pipeline.cuts import balanced_cuts
from autopar.pipeline.schedule_sim import replays, split_backward
from examples import gpt, hf_models, llama, moe
from numerics_harness import EPS, LR, STEPS, Reference, mismatches, planned_counts, reference, reference_accumulated


def _llama() -> Any:
    return llama.build(llama.LlamaConfig(layers=4))


class _Stack(nn.Module):
    """Four residual MLP blocks and a head, trained with mse_loss (a mean over a fixed count:
    each micro-batch weighs 1/m, where the examples' cross entropy weighs by counted targets)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(4))
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def _stack() -> Any:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return (_Stack(), (torch.randn(8, 16, generator=gen),), nn.functional.mse_loss,
            (torch.randn(8, 8, generator=gen),))


def _hf_llama() -> Any:
    """HF's ``LlamaForCausalLM`` (4 layers, untied head) computing its own loss from ``labels``:
    right padding in ``attention_mask`` (HF builds the 4-d mask and the rotary cos/sin in the
    head: later stages receive them with the hidden states and the labels), padding's labels
    ignored, and row 1 all ignored (a prompt), so with 4 micro-batches one counts no target."""
    model, (ids,), _, _, _ = hf_models.build_llama(layers=4, hidden=32, heads=4, kv_heads=2, intermediate=64,
                                                   vocab=64, seq=16, batch=4)
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0
    mask[3, 5:] = 0
    labels = ids.masked_fill(mask == 0, hf_models.IGNORE_INDEX)
    labels[1] = hf_models.IGNORE_INDEX
    return model, (ids,), None, (), {"labels": labels, "attention_mask": mask}


def _wide_vocab() -> Any:
    """Two thin blocks under a 4096-word output head: the tail outweighs the blocks, so it takes
    a stage alone (and with interleaving the embedding too)."""
    return llama.build(llama.LlamaConfig(layers=2, hidden=32, heads=2, kv_heads=1, ffn_hidden=64, vocab_size=4096))


def _tied_gpt() -> Any:
    """The example GPT, small, its output head the embedding table itself (``lm_head.weight`` is
    ``wte.weight``): the first stage reads it to embed, the last to compute the logits."""
    model, inputs, loss_fn, targets = gpt.build(gpt.GPTConfig(vocab_size=64, max_seq_len=16, hidden=32, heads=2))
    model.lm_head.weight = model.wte.weight
    return model, inputs, loss_fn, targets


def _hf_gpt2() -> Any:
    """HF's ``GPT2LMHeadModel`` (``tie_word_embeddings`` as it defaults: ``lm_head`` tied to
    ``transformer.wte``) computing its own loss; dropout off (the reference draws no masks)."""
    model, inputs, loss_fn, targets, kwargs = hf_models.build_gpt2(layers=2, hidden=32, heads=2, vocab=64, seq=16)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    assert model.lm_head.weight is model.transformer.wte.weight
    return model, inputs, loss_fn, targets, kwargs


def _moe(top_k: int = 2, capacity_factor: float | None = None) -> Any:
    """examples/moe.py (shared expert, 4 experts) trained on its LM loss alone: its load-balancing loss is no
    weighted sum of micro-batches' losses, which pipelines need (``problem.micro_losses``)."""
    cfg = moe.MoEConfig(vocab_size=32, max_seq_len=8, hidden=16, heads=2, kv_heads=1, ffn_hidden=16, layers=2,
                        experts=4, top_k=top_k, capacity_factor=capacity_factor, shared_expert=capacity_factor is None)
    model, inputs, _, targets = moe.build(cfg, batch=8)
    return model, inputs, _lm_loss, targets


def _lm_loss(output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output[0].flatten(0, 1), targets.flatten())


def _gpt_dropout() -> Any:
    """GPT with training-mode dropout (p = 0.1 on the residual stream and the attention probabilities)."""
    return gpt.build(gpt.GPTConfig(dropout=0.1, attn_dropout=0.1))


MODELS: dict[str, Callable[[], Any]] = {"llama": _llama, "gpt": gpt.build, "stack": _stack, "hf_llama": _hf_llama,
                                        "wide_vocab": _wide_vocab, "tied_gpt": _tied_gpt, "hf_gpt2": _hf_gpt2,
                                        "gpt_dropout": _gpt_dropout, "moe": _moe,
                                        "moe_capacity": lambda: _moe(top_k=1, capacity_factor=1.0)}
RANDOM = {"gpt_dropout"}
"""Models drawing random numbers: compiled with ``SEED``, checked against one device drawing from the counter
stream micro-batch after micro-batch (``reference_accumulated``)."""
SEED = 1234


@dataclass(frozen=True)
class Case:
    model: str
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    schedule: str | None
    """None (with micro_batches and virtual_stages None): rank 0 chooses the pipeline (``search.pipeline``)."""
    micro_batches: int | None
    virtual_stages: int | None = 1
    options: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def id(self) -> str:
        mesh = "x".join(f"{n}{s}" for n, s in zip(self.names, self.mesh))
        extra = "-".join(f"{k}={v}" if isinstance(v, (str, int)) else k for k, v in self.options.items())
        return f"{self.model}-{mesh}-{self.schedule}-m{self.micro_batches}-v{self.virtual_stages}" + \
            (f"-{extra}" if extra else "")


CASES = [
    Case("llama", (2,), ("pp",), "gpipe", 2),
    Case("stack", (2,), ("pp",), "gpipe", 4),
    Case("gpt", (2,), ("pp",), "1f1b", 2),
    Case("llama", (4,), ("pp",), "1f1b", 4),
    Case("llama", (2,), ("pp",), "interleaved_1f1b", 4, 2),
    Case("llama", (2,), ("pp",), "zbv", 4, 2),
    Case("llama", (2, 2), ("pp", "tp"), "1f1b", 2, options={"constraints": llama.TP_PLAN}),
    Case("llama", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",)}),
    Case("llama", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",), "zero": {"dp": 3}}),
    # zero-bubble schedules with sharded parameters: their gradient groups arrive over several of torch's
    # weight-pass calls
    Case("llama", (2, 2), ("pp", "dp"), "zbv", 4, 2, options={"data_axes": ("dp",), "zero": {"dp": 2}}),
    Case("llama", (2, 2), ("pp", "dp"), "dualpipev", 4, 2, options={"data_axes": ("dp",), "zero": {"dp": 2}}),
    # a block's grouped gathers replayed in both passes of a split backward, each on its own stage
    Case("llama", (2, 2), ("pp", "dp"), "zbv", 4, 2, options={"data_axes": ("dp",), "zero": {"dp": 2},
                                                          "checkpoint": "full"}),
    Case("hf_llama", (2, 2, 2), ("pp", "dp", "tp"), "zbv", 2, 2,
         options={"data_axes": ("dp",), "zero": {"dp": 2}, "constraints": hf_models.LLAMA_TP_PLAN,
                  "checkpoint": "full"}),
    # mixture of experts: routing, dispatch and combine inside the stages, experts split by expert on ep
    Case("moe", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",)}),
    Case("moe", (2, 2), ("pp", "ep"), "1f1b", 2, options={"data_axes": ("ep",), "expert_axes": ("ep",)}),
    Case("moe_capacity", (2,), ("pp",), "zbv", 4, 2, options={"checkpoint": "full", "checkpoint_blocks": 2}),
    # context parallelism inside the stages: ring (zig-zag), Ulysses, and HF's own mask (all-gathered keys)
    Case("llama", (2, 2), ("pp", "cp"), "1f1b", 2,
         options={"context_axes": ("cp",), "context_layout": "zigzag", "context_attention": "ring"}),
    Case("llama", (2, 2), ("pp", "cp"), "interleaved_1f1b", 2, 2,
         options={"context_axes": ("cp",), "context_attention": "ulysses"}),
    Case("hf_llama", (2, 2), ("pp", "cp"), "1f1b", 2, options={"context_axes": ("cp",), "checkpoint": "full"}),
    Case("hf_llama", (2, 2), ("pp", "cp"), "zbv", 4, 2, options={"context_axes": ("cp",)}),
    Case("stack", (2,), ("pp",), None, None, None),
    Case("hf_llama", (2,), ("pp",), "1f1b", 4),
    Case("hf_llama", (2, 2), ("pp", "tp"), "1f1b", 2, options={"constraints": hf_models.LLAMA_TP_PLAN}),
    # each dp rank counts its own row's targets (row 1's none): the loss Partial on dp, its sum over the
    # micro-batches all-reduced once a step
    Case("hf_llama", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",)}),
    Case("hf_llama", (2,), ("pp",), "interleaved_1f1b", 4, 2),
    Case("hf_llama", (2,), ("pp",), "zbv", 4, 2),
    Case("hf_llama", (2,), ("pp",), "dualpipev", 4, 2),  # stages 0 and 3 on rank 0: the targets read there
    # checkpointed blocks recompute inside their stages: zero-bubble schedules recompute twice (input, then
    # weight gradients: test_split_backward_prices_the_second_replay), ZeRO-3 regathers, tensor parallelism
    # replays its collectives, the first 3 blocks only leave a stage with checkpointed and plain blocks
    Case("stack", (2,), ("pp",), "1f1b", 2, 1, {"checkpoint": "full"}),
    Case("llama", (2,), ("pp",), "1f1b", 2, 1, {"checkpoint": "full"}),
    Case("llama", (2,), ("pp",), "gpipe", 2, 1, {"checkpoint": "selective"}),
    Case("llama", (2,), ("pp",), "dualpipev", 4, 2, {"checkpoint": "selective"}),
    Case("llama", (2, 2), ("pp", "tp"), "zbv", 4, 2, {"constraints": llama.TP_PLAN, "checkpoint": "full"}),
    # dualpipev splits some backwards only: each whole one replays once, each split one twice
    Case("llama", (2, 2), ("pp", "tp"), "dualpipev", 4, 2, {"constraints": llama.TP_PLAN,
                                                            "checkpoint": "selective"}),
    Case("llama", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",), "checkpoint": "full"}),
    Case("llama", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",), "zero": {"dp": 3},
                                                          "checkpoint": "selective", "checkpoint_blocks": 3}),
    Case("llama", (2, 2), ("pp", "tp"), "interleaved_1f1b", 4, 2, {"constraints": llama.TP_PLAN,
                                                                   "checkpoint": "full"}),
    # the head and the tail as stages of their own (test_head_and_tail_take_stages_alone)
    Case("wide_vocab", (2,), ("pp",), "1f1b", 2),
    Case("wide_vocab", (2,), ("pp",), "interleaved_1f1b", 4, 2),
    # a tied embedding read by the first and the last stage: held by both ranks, its gradients summed between
    # them (pp=4: by a group of the first and last rank; ZB-V: both stages on rank 0, no all-reduce)
    Case("tied_gpt", (2,), ("pp",), "1f1b", 2),
    Case("tied_gpt", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",)}),
    Case("tied_gpt", (2,), ("pp",), "interleaved_1f1b", 4, 2),
    Case("tied_gpt", (2,), ("pp",), "zbv", 4, 2),
    # a ZeRO-sharded tied weight: each stage reading it gathers (and reduce-scatters) its own copy; gathers it
    # again in backward where its reader saved it (the head, not the embedding); dualpipev: two stages, one rank
    Case("tied_gpt", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",), "zero": {"dp": 2}}),
    Case("tied_gpt", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",), "zero": {"dp": 3}}),
    Case("tied_gpt", (2, 2), ("pp", "dp"), "dualpipev", 4, 2, options={"data_axes": ("dp",), "zero": {"dp": 2}}),
    Case("tied_gpt", (4,), ("pp",), "1f1b", 4),
    Case("hf_gpt2", (2,), ("pp",), "1f1b", 2),
    # dropout: each stage's draws of a micro-batch numbered as one device numbers them, whatever order the
    # schedule runs them in, replayed alike by a checkpointed block (twice under zbv)
    Case("gpt_dropout", (2,), ("pp",), "1f1b", 2),
    Case("gpt_dropout", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",)}),
    Case("gpt_dropout", (2,), ("pp",), "zbv", 4, 2, {"checkpoint": "full", "checkpoint_blocks": 2}),
    Case("gpt_dropout", (2,), ("pp",), "interleaved_1f1b", 4, 2, {"checkpoint": "full", "checkpoint_blocks": 2}),
    # HF's tied head, ZeRO-3 on its two stages
    Case("hf_gpt2", (2, 2), ("pp", "dp"), "1f1b", 2, options={"data_axes": ("dp",), "zero": {"dp": 3}}),
]
_REFERENCES: dict[tuple[str, int], Reference] = {}


def _reference(model: str, micro_batches: int | None = None) -> Reference:
    """One device's run; for a model drawing random numbers, micro-batch after micro-batch, as the pipeline
    numbers its draws."""
    m = (micro_batches or 1) if model in RANDOM else 1
    if (model, m) not in _REFERENCES:
        _REFERENCES[model, m] = reference_accumulated(MODELS[model], m, seed=SEED) if model in RANDOM \
            else reference(MODELS[model])
    return _REFERENCES[model, m]


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _train(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    model, inputs, loss_fn, targets, *rest = MODELS[case.model]()
    kwargs = rest[0] if rest else {}
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    pipeline = autopar.Pipeline(axis="pp", schedule=case.schedule, micro_batches=case.micro_batches,
                                virtual_stages=case.virtual_stages)
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, example_kwargs=kwargs,
                         pipeline=pipeline, **({"seed": SEED} if case.model in RANDOM else {}), **case.options)
    assert isinstance(pm, PipelinedModule)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    log = CollectiveLog()
    pm.attach_log(log)
    losses, grads, ran, sent, entries = [], {}, Counter(), {}, Counter()
    for i in range(STEPS):
        loss = pm.step(*inputs, *targets, **kwargs)
        assert isinstance(loss, DTensor) and not loss.requires_grad and loss.device_mesh is mesh
        losses.append(loss.to_local().item())
        if i == 0:
            ran = Counter(log.transfers)
            entries = Counter((p, k, pm.stage_mesh.mesh_dim_names[d], b) for p, k, d, b in log.entries)
            sent = {m.index: list(m.sent_bytes) for m in pm.stage_modules}
            state = pm.state_dict()
            grads = {k: DTensor.from_local(p.grad, pm.stage_mesh, state[k].placements, run_check=False).full_tensor()
                     for k, p in pm.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    params = {k: v.full_tensor() for k, v in pm.state_dict().items() if k in ref.state}
    local = {k: _digest(v.to_local()) + str(tuple(v.placements)) for k, v in pm.state_dict().items()}
    return {"losses": losses, "held": sorted(k for k, _ in pm.named_parameters()), "with_grad": sorted(grads),
            "state_keys": sorted(pm.state_dict()), "misplaced": _misplaced(pm, mesh),
            "ran": ran, "planned": pm.plan.pipeline.step_transfers(), "sent": sent,
            "entries": entries, "planned_entries": planned_counts(pm.plan),
            "sends": [(s.sends_bytes, s.index == len(pm.plan.pipeline.stages) - 1) for s in pm.plan.pipeline.stages],
            "grad_mismatches": mismatches({k: ref.grads[k] for k in grads}, grads),
            "state_mismatches": mismatches({k: ref.state[k] for k in params}, params),
            "local": local, "coordinate": mesh.get_coordinate(), "plan": pm.plan.plan_hash(),
            "checkpoint": (pm.plan.memory.checkpoint, len(pm.plan.memory.checkpoint_blocks))}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pipeline_matches_single_device(case: Case) -> None:
    _check_training(case)


def test_searched_pipeline_under_a_tight_limit_matches_single_device() -> None:
    """Below the free search's peak the stage mesh is planned again under the limit, on the
    busiest rank's share of its memory (here it checkpoints the blocks, some parameters sharded
    on dp); compile runs the plan ``autopar.plan`` gives, and it trains to the single-device numbers.
    The micro-batch count is pinned (the schedule and stages per rank searched): each count
    planned under the limit is a memory search of its own (tests/test_pipeline_search.py
    covers the counts' search)."""
    mesh = {"pp": 2, "dp": 2}
    search = autopar.Pipeline(axis="pp", micro_batches=4)
    batch = _llama()[1][0].shape[0]
    leanest = min(_plan(c, mesh).predicted.peak_memory_bytes for c in search.choices(2, batch, blocks=4, batch_ways=1))
    limit = 0.9 * leanest  # no pipeline of a stage plan without the limit fits
    planned = _plan(search, mesh, memory_limit=limit)
    # the limit bought memory (the plan says how: which is the cost model's call)
    assert planned.memory.checkpoint != "none" or any(v != "R" for v in planned.parameters.values())
    assert planned.predicted.peak_memory_bytes <= limit
    # rank 0 plans under the limit (a memory search) while the others wait
    results = _check_training(Case("llama", (2, 2), ("pp", "dp"), None, 4, None, {"memory_limit": limit}),
                              timeout_s=180)
    assert {r["plan"] for r in results} == {planned.plan_hash()}


def _misplaced(pm: PipelinedModule, mesh: DeviceMesh) -> list[str]:
    """This rank's parameters of repeated blocks its planned stages do not run, and those of
    blocks they run that it lacks: a stage must run the ops the plan cut into it (a checkpointed
    block's call once joined the stage before, numerically alike but not the plan priced)."""
    mine = {b for s in pm.plan.pipeline.stages if s.rank == mesh.get_local_rank("pp") for b in s.blocks}
    every = {b for s in pm.plan.pipeline.stages for b in s.blocks if not b.startswith("(")}
    held = {k for k, _ in pm.named_parameters()}
    wrong = [k for k in held if any(k.startswith(b + ".") for b in every - mine)]
    return wrong + [b for b in mine & every if not any(k.startswith(b + ".") for k in held)]


def _check_training(case: Case, timeout_s: float = TIMEOUT_S) -> list[dict[str, Any]]:
    ref = _reference(case.model, case.micro_batches)
    results = run_ranks(_train, math.prod(case.mesh), case, ref, timeout_s=timeout_s)
    held: set[str] = set()
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref.losses, rel=1e-4, abs=1e-5), f"rank {rank}"
        assert result["grad_mismatches"] == [], f"rank {rank}: {result['grad_mismatches']}"
        assert result["state_mismatches"] == [], f"rank {rank}: {result['state_mismatches']}"
        assert result["with_grad"] == result["held"], f"rank {rank}: a parameter of its stages got no gradient"
        assert result["misplaced"] == [], f"rank {rank}: not its planned stages' blocks: {result['misplaced']}"
        held |= set(result["held"])
        if "checkpoint" in case.options:  # the blocks pinned checkpointed are (the first 3 or all 4 of them)
            assert result["checkpoint"] == (case.options["checkpoint"], case.options.get("checkpoint_blocks", 4))
    params = {k for k in ref.state if k in ref.grads}
    assert held == params, f"parameters no stage holds: {sorted(params - held)}"
    saved = {k for r in results for k in r["state_keys"]}
    assert saved >= set(ref.state), f"state no rank's state_dict() has: {sorted(set(ref.state) - saved)}"
    _check_replicas(results)
    _check_transfers(results)
    _check_collectives(results)
    _check_sends(results)
    return results


def _check_sends(results: list[dict[str, Any]]) -> None:
    """Each stage but the last sends the next, per micro-batch, exactly the bytes the plan prices
    (``StagePlan.sends_bytes``): what it computes that a later stage reads, never a user input nor a
    value of constants alone (each stage reads its own micro-batch of the inputs and computes those)."""
    for rank, result in enumerate(results):
        assert result["sent"], f"rank {rank} ran no stage"
        for index, sent in result["sent"].items():
            planned, last = result["sends"][index]
            assert last or sent == [planned] * len(sent), f"rank {rank} stage {index}: sent {sent}, planned {planned}"


def _check_transfers(results: list[dict[str, Any]]) -> None:
    """Per pp column (the ranks at one place on the stage mesh), what a training step ran on the
    pipeline axis besides the schedule's sends (a tied weight's gradient all-reduce, logged by each
    rank holding it) is what the plan lists."""
    columns: dict[tuple[int, ...], Counter] = {}
    for result in results:
        column = tuple(result["coordinate"][1:])
        columns[column] = columns.get(column, Counter()) + result["ran"]
    for column, ran in columns.items():
        assert ran == results[0]["planned"], f"column {column}: ran {ran}, planned {results[0]['planned']}"


def _check_collectives(results: list[dict[str, Any]]) -> None:
    """Per pp column, the stage mesh's collectives of a training step (its ranks' stages together
    run the whole step once) are those the plan lists, the loss's all-reduces included (each
    micro-batch's count, the step's summed loss once). Backward all-reduces aside: those hold the
    gradient buckets, which run as a piece on each stage holding some of a bucket's parameters
    (a tied weight's on each of its stages), as ``pipeline.pricing`` prices them per rank."""
    def unbucketed(counts: Counter) -> Counter:
        return Counter({k: n for k, n in counts.items() if k[:2] != ("backward", "all_reduce")})

    columns: dict[tuple[int, ...], Counter] = {}
    for result in results:
        column = tuple(result["coordinate"][1:])
        columns[column] = columns.get(column, Counter()) + result["entries"]
    planned = unbucketed(results[0]["planned_entries"])
    for column, ran in columns.items():
        assert unbucketed(ran) == planned, f"column {column}: ran {sorted(ran.items())}, planned {planned}"


def _check_replicas(results: list[dict[str, Any]]) -> None:
    """The ranks of one pipeline coordinate holding a replicated shard hold it bit for bit alike."""
    by_stage: dict[int, list[dict[str, str]]] = {}
    for result in results:
        by_stage.setdefault(result["coordinate"][0], []).append(result["local"])
    for locals_ in by_stage.values():
        for name in locals_[0]:
            if "Shard" not in locals_[0][name]:
                assert len({loc[name] for loc in locals_}) == 1, f"{name} differs between replicas"


def _plan(pipeline: autopar.Pipeline, mesh: dict[str, int], build: Callable[[], Any] = _llama,
          **options: Any) -> autopar.Plan:
    model, inputs, loss_fn, targets = build()
    return autopar.plan(model, autopar.Mesh(mesh, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                        pipeline=pipeline, **options)


def test_plan_pipeline_json_and_text() -> None:
    p = _plan(autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=4), {"pp": 2, "tp": 2})
    pipe = p.to_json()["pipeline"]
    assert (pipe["axis"], pipe["schedule"], pipe["virtual_stages"], pipe["micro_batches"]) == ("pp", "1f1b", 1, 4)
    assert pipe["stage_mesh"] == {"tp": 2} and p.mesh["axes"] == {"tp": 2}
    assert [s["blocks"] for s in pipe["stages"]] == [["(head)", "layers.0", "layers.1"],
                                                     ["layers.2", "layers.3", "(tail)"]]
    assert [s["rank"] for s in pipe["stages"]] == [0, 1]
    assert all(s["parameter_bytes"] > 0 and s["forward_s"] > 0 for s in pipe["stages"])
    assert pipe["stages"][0]["sends_bytes"] > 0 and pipe["stages"][1]["sends_bytes"] == 0
    first, last = ((s["forward_s"], s["backward_s"]) for s in pipe["stages"])
    # the last stage (with the output head and loss) is the slower: with two stages it computes back to back
    # after the first stage's forward of micro-batch 0, and the first stage's backward of micro-batch 3 drains
    # (the even-stage (m + p - 1)(F + B) is an upper bound, (2 - 1) / (4 + 2 - 1) = 20% its bubble share)
    assert sum(first) < sum(last)
    compute = sum(first) + 4 * sum(last)
    assert pipe["bubble_s"] == pytest.approx(sum(first), rel=1e-9)
    assert pipe["bubble_fraction"] == pytest.approx(sum(first) / compute, rel=1e-9) and pipe["bubble_fraction"] < 0.2
    # transfers delay their receivers: at least the first activation and the last gradient, at most all of them
    send = pipe["stages"][0]["send_s"]
    assert send > 0 and 2 * send <= pipe["p2p_s"] * (1 + 1e-9) and pipe["p2p_s"] <= 2 * (4 + 1) * send
    # rank 0 runs the last backward; rank 1's buckets and loss broadcast are done before rank 0's buckets are
    assert p.predicted.step_time_s == pytest.approx(compute + pipe["p2p_s"] + pipe["grad_sync_per_rank_s"][0]
                                                    + pipe["update_per_rank_s"][0], rel=1e-9)
    assert pipe["grad_sync_s"] == max(pipe["grad_sync_per_rank_s"])
    assert pipe["update_s"] == max(pipe["update_per_rank_s"])
    assert p.solver["objective_s"] == pytest.approx(pipe["stage_plan_step_time_s"], rel=1e-9)
    assert "stage_of" not in pipe and "estimate" in pipe["estimate"]
    text = str(p)
    assert "pipeline" in text and "1f1b" in text and f"bubble {pipe['bubble_fraction']:.1%}" in text


def test_interleaved_bubble_and_v_placement() -> None:
    p = _plan(autopar.Pipeline(axis="pp", schedule="interleaved_1f1b", micro_batches=4, virtual_stages=2), {"pp": 2})
    assert p.pipeline.bubble_fraction == pytest.approx((2 - 1) / (2 * 4 + 2 - 1), rel=0.2)  # stages nearly even
    assert [s.rank for s in p.pipeline.stages] == [0, 1, 0, 1]
    v = _plan(autopar.Pipeline(axis="pp", schedule="zbv", micro_batches=4, virtual_stages=2), {"pp": 2})
    assert [s.rank for s in v.pipeline.stages] == [0, 1, 1, 0]
    assert v.pipeline.stage_mesh == {"stage": 1}


def test_head_and_tail_take_stages_alone() -> None:
    """The head and the tail are units of their own: a heavy output head takes the last stage
    alone, and with four stages for two blocks the embedding takes the first (a stage of no
    repeated block); each stage's seconds are its ops' (the tail's are the head's matmul and loss)."""
    stages = _plan(autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=2), {"pp": 2}, _wide_vocab)
    assert [s.blocks for s in stages.pipeline.stages] == [["(head)", "layers.0", "layers.1"], ["(tail)"]]
    interleaved = _plan(autopar.Pipeline(axis="pp", schedule="interleaved_1f1b", micro_batches=4, virtual_stages=2),
                        {"pp": 2}, _wide_vocab).pipeline
    assert [s.blocks for s in interleaved.stages] == [["(head)"], ["layers.0"], ["layers.1"], ["(tail)"]]
    assert "0@pp0: (head) | 1@pp1: layers.0 | 2@pp0: layers.1 | 3@pp1: (tail)" in interleaved.describe()
    heaviest = max(interleaved.stages, key=lambda s: s.forward_s + s.backward_s)
    assert heaviest.blocks == ["(tail)"]


def test_balanced_cuts() -> None:
    assert balanced_cuts([3.0, 1.0, 1.0, 1.0], 2) == [0, 1]
    assert balanced_cuts([1.0, 1.0, 1.0, 3.0], 2) == [0, 3]
    assert balanced_cuts([1.0] * 4, 4) == [0, 1, 2, 3]
    assert balanced_cuts([1.0] * 6, 3) == [0, 2, 4]


@pytest.mark.parametrize("pipeline, mesh, message", [
    (autopar.Pipeline(axis="pp", schedule="zbv", micro_batches=4, virtual_stages=1), {"pp": 2}, "virtual_stages = 2"),
    (autopar.Pipeline(axis="pp", schedule="interleaved_1f1b", virtual_stages=1), {"pp": 2}, ">= 2"),
    (autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=2, virtual_stages=1), {"pp": 4},
     "micro_batches >= stages"),
    (autopar.Pipeline(axis="pp", schedule="dualpipev", micro_batches=2, virtual_stages=2), {"pp": 2}, ">= stages"),
    (autopar.Pipeline(axis="pp", schedule="bogus"), {"pp": 2}, "schedules are"),
    (autopar.Pipeline(axis="x", schedule="gpipe"), {"pp": 2}, "not an axis"),
    (autopar.Pipeline(axis="pp", schedule="gpipe"), {"tp": 2, "pp": 2}, "first (outermost)"),
    (autopar.Pipeline(axis="pp", schedule="gpipe", micro_batches=2, virtual_stages=1), {"pp": 8},
     "needs 8 stages of at least one unit"),
    (autopar.Pipeline(axis="pp", schedule="gpipe"), {"pp": 8}, "can be cut for this model"),
    (autopar.Pipeline(axis="pp", micro_batches=3), {"pp": 2}, "divide the batch"),
])
def test_pipeline_input_errors(pipeline: autopar.Pipeline, mesh: dict[str, int], message: str) -> None:
    with pytest.raises(InputError, match=re.escape(message)):
        _plan(pipeline, mesh)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_split_backward_prices_the_second_replay(schedule: str) -> None:
    """A split backward replays a stage's checkpointed blocks in its input pass and again in its weight pass
    (torch's weight-pass calls share one replay), a whole backward once, the first stage's input pass not at
    all (the cases above check the replays' collectives against the plan's): each stage's replay is priced
    beside its backward, the forward of its blocks' replayed ops, and the simulation's I and W each carry it."""
    pipe = autopar.Pipeline(axis="pp", schedule=schedule, micro_batches=4)
    plan = _plan(pipe, {"pp": 2}, checkpoint="full")
    assert plan.pipeline is not None and plan.pipeline.schedule == schedule
    for stage in plan.pipeline.stages:
        replay = sum(n.forward_s for n in plan.nodes
                     if plan.pipeline.stage_of.get(n.name) == stage.index and n.module.startswith("layers."))
        assert replay > 0 and stage.replay_s == pytest.approx(replay, rel=1e-9)
        f, i, w, b = split_backward(stage.forward_s, stage.backward_s, stage.replay_s, first=stage.index == 0)
        assert (f, b) == (stage.forward_s, stage.backward_s)
        assert i + w == pytest.approx(stage.backward_s + (stage.replay_s if stage.index else 0.0), rel=1e-12)
    counts = replays(schedule, 2, 2, 4)
    assert counts[0] == 4 and all(c >= 4 for c in counts[1:])  # once a micro-batch, twice where split
    if schedule == "zbv":  # every backward split
        assert counts == (4, 8, 8, 8)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_zero_bubble_schedules_refuse_gathers_again(schedule: str) -> None:
    """A split backward runs an op of both input and weight gradients twice, reading what it saved in each:
    ZeRO-3's gathers in backward would run twice as often as priced, so such a plan is refused when pinned,
    and an unpinned schedule is another one."""
    pin = autopar.Pipeline(axis="pp", schedule=schedule, micro_batches=4)
    with pytest.raises(InputError, match=re.escape("ZeRO-2 (zero={axis: 2}) runs with this one")):
        _plan(pin, {"pp": 2, "dp": 2}, data_axes=("dp",), zero={"dp": 3})
    searched = _plan(autopar.Pipeline(axis="pp"), {"pp": 2, "dp": 2}, data_axes=("dp",), zero={"dp": 3})
    assert searched.memory.regather and searched.pipeline is not None
    assert searched.pipeline.schedule not in ("zbv", "dualpipev")


def test_pipelined_dropout_on_the_torch_stream_is_refused_on_every_rank() -> None:
    """A torch generator draws in the order a rank runs its stages, not as one device would: refused."""
    options = {"seed": SEED, "random_stream": "torch",
               "pipeline": autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=2)}
    messages = run_ranks(_compile_bad, 2, _gpt_dropout, options)
    assert all("only the counter stream draws them as one device does" in m for m in messages), messages


def test_checkpointing_inside_stages_is_planned() -> None:
    """checkpoint= with a pipeline plans every stage's blocks checkpointed (they recompute inside
    their stages: the cases above train them), each rank then holding less than without."""
    pipeline = autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=2, virtual_stages=1)
    plain = _plan(pipeline, {"pp": 2})
    for policy in ("selective", "full"):
        planned = _plan(pipeline, {"pp": 2}, checkpoint=policy)
        assert planned.memory.checkpoint == policy
        assert planned.memory.checkpoint_blocks == [f"layers.{i}" for i in range(4)]
        assert [s.blocks for s in planned.pipeline.stages] == [s.blocks for s in plain.pipeline.stages]
        for ours, theirs in zip(planned.pipeline.stages, plain.pipeline.stages):
            assert ours.activation_bytes < theirs.activation_bytes
            assert ours.backward_s > theirs.backward_s  # the replay


def _untied_gpt() -> Any:
    """``_tied_gpt`` with an output head of its own (the same shapes)."""
    return gpt.build(gpt.GPTConfig(vocab_size=64, max_seq_len=16, hidden=32, heads=2))


@pytest.mark.parametrize("schedule, v, p, holders", [("1f1b", 1, 2, [(0, 0), (1, 1)]),
                                                     ("interleaved_1f1b", 2, 2, [(0, 0), (3, 1)]),
                                                     ("1f1b", 1, 4, [(0, 0), (3, 3)]),
                                                     ("zbv", 2, 2, [(0, 0)])])
def test_tied_weight_is_priced_on_both_stages(schedule: str, v: int, p: int, holders: list[tuple[int, int]]) -> None:
    """A weight the first and the last stage read is held by both stages' ranks: its state counts on
    both (each stage holds what the untied model's embedding and head hold apart), and after the
    drain its gradient is all-reduced between them on the pipeline axis, which the plan lists
    (stages, ranks, bytes of the fp32 gradient, seconds) and prices in the step: both ranks wait
    for the later one's buckets, then run it, then update. Where both stages are on one rank
    (ZB-V's rank 0) the copies are one tensor: no all-reduce."""
    pipeline = autopar.Pipeline(axis="pp", schedule=schedule, micro_batches=4, virtual_stages=v)
    tied = _plan(pipeline, {"pp": p}, _tied_gpt)
    untied = _plan(pipeline, {"pp": p}, _untied_gpt)
    pipe, apart = tied.pipeline, untied.pipeline
    assert [s.blocks for s in pipe.stages] == [s.blocks for s in apart.stages]
    nbytes = 64 * 32 * 4
    for ours, theirs in zip(pipe.stages, apart.stages):
        # the last stage on the first's rank (ZB-V) reads the copy that rank holds for stage 0
        shared = ours.index == len(pipe.stages) - 1 and ours.rank == pipe.stages[0].rank
        assert (ours.parameters + shared, ours.parameter_bytes + shared * nbytes, ours.state_bytes + shared * 4 * nbytes
                ) == (theirs.parameters, theirs.parameter_bytes, theirs.state_bytes), ours.index
    assert list(tied.parameters) == [s for s in untied.parameters if s != "lm_head.weight"]
    if len(holders) == 1:  # one rank holds both stages: nothing to sum between ranks
        assert pipe.tied == [] and pipe.step_transfers() == Counter()
        return
    (weight,) = pipe.tied
    assert (weight.parameter, weight.stages, weight.ranks, weight.bytes) == \
        ("wte.weight", [s for s, _ in holders], [r for _, r in holders], nbytes)
    mesh = autopar.Mesh({"pp": p}, "cpu")
    n, link = len(holders), mesh.link(0)
    ring = mesh.hardware.collective_overhead + 2 * (n - 1) * (link.latency + nbytes / n / link.bandwidth)
    assert weight.time_s == pytest.approx(ring, rel=1e-12) and weight.time_s > 0
    if p == 2:  # the whole pp axis: the all-reduce the cost model prices on it
        assert weight.time_s == pytest.approx(collective_time(CollectiveCall(ALL_REDUCE, 0, nbytes), mesh), rel=1e-12)
    assert pipe.step_transfers() == Counter({("all_reduce", s, nbytes): 1 for s, _ in holders})
    ends = pipe.rank_ends(pipe.simulate())
    start = max(ends[r].synced_s for _, r in holders)
    for r, end in enumerate(ends):
        held = any(r == h for _, h in holders)
        assert (end.tied_start_s, end.tied_end_s) == pytest.approx((start, start + weight.time_s) if held
                                                          else (end.synced_s, end.synced_s), rel=1e-12)
    assert tied.predicted.step_time_s == pytest.approx(max(e.end_s for e in ends), rel=1e-12)
    assert tied.predicted.step_time_s > start + weight.time_s
    assert tied.to_json()["pipeline"]["tied"][0]["parameter"] == "wte.weight"
    assert f"wte.weight tied on stages {holders[0][0]} and {holders[-1][0]}" in pipe.describe()


def _compile_bad(rank: int, world: int, build: Callable[[], Any], options: dict[str, Any]) -> str:
    """compile's error on this rank ("" when it compiled)."""
    model, inputs, loss_fn, targets = build()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    try:
        autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **options)
    except InputError as exc:
        return str(exc)
    return ""


def test_compile_refuses_a_bad_pipeline_on_every_rank() -> None:
    options = {"pipeline": autopar.Pipeline(axis="pp", schedule="zbv", micro_batches=4, virtual_stages=1)}
    messages = run_ranks(_compile_bad, 2, _llama, options)
    assert all("virtual_stages" in m for m in messages), messages


_GPIPE4 = autopar.Pipeline(axis="pp", schedule="gpipe", micro_batches=4, virtual_stages=1)


def _compiled_hashes(rank: int, world: int, limit: float) -> list[str]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    out = []
    for pipeline in (_GPIPE4, autopar.Pipeline(axis="pp")):
        model, inputs, loss_fn, targets = _stack()
        pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, pipeline=pipeline,
                             memory_limit=limit)
        out.append(pm.plan.plan_hash())
    return out


def test_compile_plans_the_pipeline_plan_prices() -> None:
    """Under a memory limit that binds the whole model on one stage mesh but not the pipeline,
    compile plans a pinned pipeline, and the one rank 0's search chose, as ``plan`` does
    (the stage mesh's ILP without the limit first): the plan that runs is the plan priced."""
    model, inputs, loss_fn, targets = _stack()
    mesh = autopar.Mesh({"pp": 2}, "cpu")

    def planned(pipeline: autopar.Pipeline, **options: Any) -> autopar.Plan:
        return autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, pipeline=pipeline,
                            **options)
    limit = planned(_GPIPE4).predicted.peak_memory_bytes
    expected = [planned(p, memory_limit=limit).plan_hash() for p in (_GPIPE4, autopar.Pipeline(axis="pp"))]
    assert run_ranks(_compiled_hashes, 2, limit) == [expected, expected]


def _train_depth_searched(rank: int, world: int, limit: float | None, ref: Reference, asked: dict[str, Any]
                          ) -> dict[str, Any]:
    """``compile`` with the depth left open (``Pipeline(from_axis="dp")``, or by default: ``asked``) on a
    2-rank dp mesh."""
    model, inputs, loss_fn, targets = _stack()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, memory_limit=limit,
                         zero={"dp": 0}, offload=False, **asked)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        loss = pm.step(*inputs, *targets) if isinstance(pm, PipelinedModule) else pm(*inputs, *targets)
        if not isinstance(pm, PipelinedModule):
            loss.backward()
        losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
        opt.step()
        opt.zero_grad()
    params = {k: v.full_tensor() for k, v in pm.state_dict().items() if k in ref.state}
    return {"pipelined": isinstance(pm, PipelinedModule), "plan": pm.plan.plan_hash(), "losses": losses,
            "held": sorted(params), "state_mismatches": mismatches({k: ref.state[k] for k in params}, params)}


@pytest.mark.parametrize("asked", [{"pipeline": autopar.Pipeline(axis="pp", from_axis="dp")}, {}],
                         ids=["from_axis", "default"])
@pytest.mark.parametrize("limit", [None, 256 * 1024])
def test_compile_chooses_the_depth_plan_chooses(limit: float | None, asked: dict[str, Any]) -> None:
    """Rank 0 searches the depth (asked for, or by default), every rank lays the mesh out for it and
    compiles the pinned pipeline (or none): the plan that runs is ``plan``'s, and it trains to the
    single-device numbers. With memory to spare the stack stays data parallel; under a limit its whole
    model state does not fit, so it runs as a 2-stage pipeline."""
    model, inputs, loss_fn, targets = _stack()
    planned = autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                           memory_limit=limit, zero={"dp": 0}, offload=False, **asked)
    assert (planned.pipeline is not None) == (limit is not None)
    ref = _reference("stack")
    results = run_ranks(_train_depth_searched, 2, limit, ref, asked)
    held = set()
    for rank, result in enumerate(results):
        assert result["pipelined"] == (limit is not None) and result["plan"] == planned.plan_hash(), f"rank {rank}"
        assert result["losses"] == pytest.approx(ref.losses, rel=1e-4, abs=1e-5), f"rank {rank}"
        assert result["state_mismatches"] == [], f"rank {rank}: {result['state_mismatches']}"
        held |= set(result["held"])
    assert held == set(ref.state)
