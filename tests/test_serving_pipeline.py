"""Pipelined serving: the example Llama (4 layers, its KV cache written in place) served by
``autopar.compile_serving(..., pipeline=autopar.Pipeline(axis="pp"))`` on pp=2 and pp=2 x tp=2
forked gloo ranks: each stage holds its layers' weights and caches (one copy shared by the prefill
and decode programs, cut at the same layer), a step runs the stages in order with the activations
sent point to point, the last stage's logits are broadcast to every rank, and greedy generation
gives exactly the single-device tokens; each step runs exactly the sends and collectives its plan
lists."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.api.planning import plan_step
from autopar.errors import InputError
from autopar.runtime.forked import run_ranks
from autopar.runtime.generate import generate
from autopar.runtime.ops import CollectiveLog
from examples import llama
from tests.numerics_harness import planned_counts
from tests.test_serving_runtime import CHUNK, MAX_LEN, NEW, PROMPTS, SLOTS, _step

STAGE_LAYERS = [["layers.0", "layers.1"], ["layers.2", "layers.3"]]
"""The layers the balanced cut gives each stage of the 4-layer model."""


def _serving_llama() -> llama.Llama:
    model, *_ = llama.build(llama.LlamaConfig(layers=4))
    model.eval()
    model.setup_cache(slots=SLOTS, max_len=MAX_LEN)
    return model


def _ran(module: Any, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """What one step of ``module`` ran on this rank: its stage mesh's collectives and its sends."""
    log = CollectiveLog()
    module.attach_log(log)
    module(*inputs)
    module.attach_log(None)
    return {"collectives": Counter(log.entries), "transfers": Counter(log.transfers)}


def serve_on_rank(rank: int, world: int, shape: tuple[int, ...]) -> dict[str, Any]:
    names = ("pp", "tp")[:len(shape)]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    serving = autopar.compile_serving(_serving_llama(), mesh, _step(1, CHUNK), _step(SLOTS, 1),
                                      pipeline=autopar.Pipeline(axis="pp"),
                                      constraints=llama.TP_PLAN if "tp" in names else None)
    prefill, decode = serving.prefill_module, serving.decode_module
    got = generate(serving.prefill, serving.decode, PROMPTS, NEW, chunk=CHUNK, slots=SLOTS, max_len=MAX_LEN)
    state = {**dict(decode.named_parameters()), **dict(decode.named_buffers())}
    own = {**dict(prefill.named_parameters()), **dict(prefill.named_buffers())}
    stage_names = tuple(n for n in names if n != "pp") or ("stage",)
    ran = {"prefill": _ran(prefill, _step(1, CHUNK)), "decode": _ran(decode, _step(SLOTS, 1))}
    for step in ran.values():  # mesh dims as axis names, as the plan lists them
        step["collectives"] = Counter({(p, k, stage_names[d], b): n for (p, k, d, b), n in step["collectives"].items()})
    return {"tokens": got.tokens, "logits": [t.tolist() for t in got.logits], "ran": ran,
            "caches": sorted(f for f in state if f.endswith("cache.k")),
            "cache_shape": tuple(state["layers.0.attention.cache.k"].shape) if "layers.0.attention.cache.k" in state
            else None,
            "not_shared": sorted(f for f in state if f not in own or own[f].data_ptr() != state[f].data_ptr()),
            "planned": {name: {"collectives": planned_counts(m.plan), "transfers": m.plan.pipeline.forward_transfers(),
                               "blocks": [s.blocks for s in m.plan.pipeline.stages]}
                        for name, m in (("prefill", prefill), ("decode", decode))}}


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["pp2", "pp2xtp2"])
def test_pipelined_serving_generates_the_single_device_tokens(shape: tuple[int, ...]) -> None:
    """pp=2 (and pp=2 x tp=2, Megatron TP pinned inside each stage): three prompts of different
    lengths (chunked, padded) then four decode steps of all slots give exactly the single-device
    greedy tokens on every rank; both programs cut at the same layer and run on one copy of the
    stage's weights and caches, which hold its layers' only (split by KV heads on tp=2); per pp
    column (the ranks at one place on the stage mesh) each step runs exactly the collectives,
    sends and logits broadcast its plan lists."""
    model = _serving_llama()
    with torch.no_grad():
        want = generate(model, model, PROMPTS, NEW, chunk=CHUNK, slots=SLOTS, max_len=MAX_LEN)
    results = run_ranks(serve_on_rank, math.prod(shape), shape)
    tp = shape[1] if len(shape) > 1 else 1
    for rank, result in enumerate(results):
        assert result["tokens"] == want.tokens, f"rank {rank}"
        for step, (mine, theirs) in enumerate(zip(result["logits"], want.logits)):
            torch.testing.assert_close(torch.tensor(mine), theirs, rtol=1e-4, atol=1e-5, msg=f"rank {rank} {step}")
        stage = rank // tp
        assert result["caches"] == [f"{layer}.attention.cache.k" for layer in STAGE_LAYERS[stage]], f"rank {rank}"
        assert result["not_shared"] == [], f"rank {rank}: prefill holds its own copy of {result['not_shared']}"
        planned = result["planned"]
        assert planned["prefill"]["blocks"] == planned["decode"]["blocks"]
        assert [[b for b in blocks if b.startswith("layers")] for blocks in planned["decode"]["blocks"]] == STAGE_LAYERS
    assert results[0]["cache_shape"] == (SLOTS, MAX_LEN, 2 // tp, 32)
    for column in range(tp):
        ranks = [results[r] for r in range(column, len(results), tp)]
        for step in ("prefill", "decode"):
            planned = ranks[0]["planned"][step]
            for what in ("collectives", "transfers"):
                ran = sum((r["ran"][step][what] for r in ranks), Counter())
                assert ran == planned[what], f"column {column} {step} {what}: ran {ran}, planned {planned[what]}"
            assert planned["transfers"], step
    assert bool(results[0]["planned"]["decode"]["collectives"]) == (tp > 1)


def refuse_on_rank(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    errors = []
    for pipeline in (autopar.Pipeline(axis="pp", schedule="1f1b"), autopar.Pipeline(axis="pp", micro_batches=2)):
        try:
            autopar.compile_serving(_serving_llama(), mesh, _step(1, CHUNK), _step(SLOTS, 1), pipeline=pipeline)
        except InputError as exc:
            errors.append(str(exc))
    serving = autopar.compile_serving(_serving_llama(), mesh, _step(1, CHUNK), _step(SLOTS, 1),
                                      pipeline=autopar.Pipeline(axis="pp"))
    try:
        serving.decode(*_step(SLOTS - 1, 1))
    except InputError as exc:
        errors.append(str(exc))
    return errors


def test_pipelined_serving_refuses_what_a_forward_chain_does_not_run() -> None:
    """A schedule or micro-batch count other than one micro-batch through the stages in order is
    refused by name on every rank (before anything is planned); a decode step of another batch
    than compiled is refused by name on every rank, before any stage sends."""
    for errors in run_ranks(refuse_on_rank, 2):
        assert len(errors) == 3, errors
        assert "'schedule': '1f1b'" in errors[0] and "one micro-batch" in errors[0], errors[0]
        assert "'micro_batches': 2" in errors[1], errors[1]
        assert "shape" in errors[2], errors[2]


def test_pinned_stage_blocks_cut_where_named() -> None:
    """``Pipeline(stage_blocks=...)`` cuts where it says (the prefill is pinned to the decode's cuts
    this way); a pin that is not every unit once, in order, is refused naming the units."""
    model = _serving_llama()
    pinned = (("(head)", "layers.0"), ("layers.1", "layers.2", "layers.3", "(tail)"))
    pipeline = autopar.Pipeline(axis="pp", schedule="gpipe", micro_batches=1, stage_blocks=pinned)
    step = plan_step(model, {"pp": 2}, _step(SLOTS, 1), train=False, pipeline=pipeline)
    assert step.plan.pipeline is not None
    assert [tuple(s.blocks) for s in step.plan.pipeline.stages] == list(pinned)
    assert step.plan.pipeline.output_bytes > 0 and step.plan.pipeline.output_s > 0
    wrong = autopar.Pipeline(axis="pp", schedule="gpipe", micro_batches=1,
                             stage_blocks=(("(head)", "layers.0"), ("layers.2", "layers.1", "layers.3", "(tail)")))
    with pytest.raises(InputError, match=r"stage_blocks .* must cut this step's units \['\(head\)', 'layers.0'"):
        plan_step(model, {"pp": 2}, _step(SLOTS, 1), train=False, pipeline=wrong)


def serve_hf_on_rank(rank: int, world: int) -> dict[str, Any]:
    from tests.test_serving_runtime import HF_CHUNK, _hf_greedy, _hf_static
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    _, wrapped = _hf_static()
    serving = autopar.compile_serving(wrapped, mesh, (torch.zeros(1, HF_CHUNK, dtype=torch.long),),
                                      (torch.zeros(1, 1, dtype=torch.long),), pipeline=autopar.Pipeline(axis="pp"),
                                      prefill_kwargs={"cache_position": torch.arange(HF_CHUNK)},
                                      decode_kwargs={"cache_position": torch.tensor([0])})
    tokens, logits = _hf_greedy(serving.prefill, serving.decode)
    log = CollectiveLog()
    serving.decode_module.attach_log(log)
    serving.decode(torch.zeros(1, 1, dtype=torch.long), cache_position=torch.tensor([0]))
    return {"tokens": tokens, "logits": [t.tolist() for t in logits], "ran": Counter(log.transfers),
            "planned": serving.decode_module.plan.pipeline.forward_transfers(),
            "caches": sorted(n for n, _ in serving.decode_module.named_buffers() if "_cache_" in n)}


def test_hf_llama_static_cache_serving_on_two_stages() -> None:
    """Hugging Face's Llama with its ``StaticCache`` (transformers' export wrapper) on pp=2: each
    stage holds its layer's key and value caches, chunked prefill then decode give the tokens of
    the wrapper on one device, and the two ranks together run the decode step's planned sends."""
    pytest.importorskip("transformers")
    from tests.test_serving_runtime import _hf_greedy, _hf_static
    _, wrapped = _hf_static()
    with torch.no_grad():
        want, want_logits = _hf_greedy(wrapped, wrapped)
    results = run_ranks(serve_hf_on_rank, 2)
    for rank, result in enumerate(results):
        assert result["tokens"] == want, f"rank {rank}"
        torch.testing.assert_close(torch.tensor(result["logits"]), torch.stack(want_logits), rtol=1e-4, atol=1e-5)
        assert result["caches"] == [f"key_cache_{rank}", f"value_cache_{rank}"], result["caches"]
    assert results[0]["ran"] + results[1]["ran"] == results[0]["planned"] and results[0]["planned"]
