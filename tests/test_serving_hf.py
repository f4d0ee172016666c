"""HF causal LMs served as they are (``autopar.hf.servable``, taken by ``compile_serving`` and ``plan_serving``):
tiny random-weight configs of Llama, Qwen2, Qwen3, Mistral, Gemma, Mixtral and Qwen2-MoE generate exactly the
tokens ``model.generate(do_sample=False)`` generates on one device, for prompts of different lengths (chunked
prefill with padding into slots, then decode steps of every slot), on one device, on tp=2, on pp=2 and on 2
replicas of tp=2 of the continuous-batching engine, aggregated and disaggregated (fp32, gloo).

Each configuration runs every family in one ``run_ranks`` (forking and its first compile are paid once), each
family's model built once (``hf.model``) and its reference computed once, in the parent, before forking."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.errors import InputError
from autopar.hf import servable
from autopar.runtime.forked import run_ranks
from autopar.runtime.generate import generate
from tests import hf_serving_models as hf

pytest.importorskip("transformers")

FAMILIES = sorted(hf.FAMILIES)
CACHE_K = "model.model.layers.0.self_attn.slot_kv.k"


def test_the_adapter_generates_hf_greedy_tokens_on_one_device() -> None:
    """Every family: the slot-indexed cache (chunked prefill into slots, decode of all slots) gives
    ``generate``'s tokens; the cache is (slots, max_len, kv heads, head dim) buffers."""
    for family in FAMILIES:
        want = hf.reference(family, hf.PROMPTS, hf.NEW)
        served = servable(hf.build(family))  # hf.model's stays unserved here (no cache on its attentions)
        served.setup_cache(hf.SLOTS, hf.MAX_LEN)
        with torch.no_grad():
            got = generate(served, served, hf.PROMPTS, hf.NEW, chunk=hf.CHUNK, slots=hf.SLOTS, max_len=hf.MAX_LEN)
        assert got.tokens == want, family
        assert served.get_buffer(CACHE_K).shape == (hf.SLOTS, hf.MAX_LEN, 2, 16)


def test_the_adapter_refuses_what_it_cannot_serve() -> None:
    model = hf.build("llama")
    served = servable(model)
    with pytest.raises(InputError, match="setup_cache"):
        served(*hf.step(1, 1))
    with pytest.raises(InputError, match="exceeds the model's 64 positions"):
        served.setup_cache(1, 65)
    from examples import hf_models

    gpt2, *_ = hf_models.build_gpt2(device="meta")
    with pytest.raises(InputError, match="no self-attention with k_proj/v_proj"):
        servable(gpt2)
    with pytest.raises(InputError, match="cache_len= sizes the cache of an HF causal LM"):
        autopar.compile_serving(torch.nn.Linear(2, 2), None, (), (), cache_len=8)  # type: ignore[arg-type]


def serve_on_rank(mesh: DeviceMesh, family: str) -> dict[str, Any]:
    serving = autopar.compile_serving(hf.model(family), mesh, hf.step(1, hf.CHUNK), hf.step(hf.SLOTS, 1),
                                      constraints=hf.tp_plan(family), cache_len=hf.MAX_LEN)
    got = generate(serving.prefill, serving.decode, hf.PROMPTS, hf.NEW, chunk=hf.CHUNK, slots=hf.SLOTS,
                   max_len=hf.MAX_LEN)
    cache = serving.decode_module.get_buffer(CACHE_K)
    return {"tokens": got.tokens, "cache": (tuple(cache.shape), serving.placements[CACHE_K]),
            "collectives": len(serving.decode_module.plan.collectives)}


def _serve_families(rank: int, world: int) -> list[dict[str, Any]]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return [serve_on_rank(mesh, family) for family in FAMILIES]


def test_tensor_parallel_hf_serving_generates_the_hf_tokens() -> None:
    """tp=2, attention (and dense MLPs) Megatron TP pinned: each family's tokens are ``generate``'s, the
    cache split by KV heads (2 kv heads on tp=2), the decode step really tensor parallel."""
    want = {family: hf.reference(family, hf.PROMPTS, hf.NEW) for family in FAMILIES}
    results = run_ranks(_serve_families, 2, timeout_s=600)
    for rank, per_family in enumerate(results):
        for family, result in zip(FAMILIES, per_family):
            assert result["tokens"] == want[family], (rank, family)
            assert result["cache"] == ((hf.SLOTS, hf.MAX_LEN, 1, 16), (Shard(2),)), (family, result["cache"])
            assert result["collectives"], family


def pipelined_on_rank(mesh: DeviceMesh, family: str) -> dict[str, Any]:
    serving = autopar.compile_serving(hf.model(family), mesh, hf.step(1, hf.CHUNK), hf.step(hf.SLOTS, 1),
                                      pipeline=autopar.Pipeline(axis="pp"), cache_len=hf.MAX_LEN)
    got = generate(serving.prefill, serving.decode, hf.PROMPTS, hf.NEW, chunk=hf.CHUNK, slots=hf.SLOTS,
                   max_len=hf.MAX_LEN)
    held = [f for f, _ in [*serving.decode_module.named_parameters(), *serving.decode_module.named_buffers()]]
    return {"tokens": got.tokens, "caches": sorted(f for f in held if f.endswith("slot_kv.k")),
            "layers": sorted({f.split(".")[3] for f in held if f.startswith("model.model.layers.")}),
            "blocks": [s.blocks for s in serving.decode_module.plan.pipeline.stages]}


def _pipelined_families(rank: int, world: int) -> list[dict[str, Any]]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    return [pipelined_on_rank(mesh, family) for family in FAMILIES]


def test_pipelined_hf_serving_generates_the_hf_tokens() -> None:
    """pp=2: each family's decoder layers cut one a stage, each stage holding its layer's weights (a MoE
    layer's experts and router included) and cache only; every rank gets ``generate``'s tokens."""
    want = {family: hf.reference(family, hf.PROMPTS, hf.NEW) for family in FAMILIES}
    results = run_ranks(_pipelined_families, 2, timeout_s=600)
    for rank, per_family in enumerate(results):
        for family, result in zip(FAMILIES, per_family):
            assert result["tokens"] == want[family], (rank, family)
            assert result["caches"] == [f"model.model.layers.{rank}.self_attn.slot_kv.k"], (family, result["caches"])
            assert result["layers"] == [str(rank)], (family, result["layers"])
            assert len(result["blocks"]) == 2, family


ENGINE_SLOTS, ENGINE_CHUNK, ENGINE_LEN = 4, 8, 64
REQUESTS_ARGS = [([5, 7, 9, 11, 13, 2, 3, 4, 8, 100, 200], 5, 0.0), ([42, 17, 3], 1, 0.0),
                 (list(range(1, 20)), 4, 0.01), ([8, 6, 4], 6, 0.3)]
"""(prompt, new tokens, arrival s): two chunks with padding, one token only, over the token budget, a late one."""
MODES = {"aggregated": ["serve", "serve"], "disaggregated": ["prefill", "decode"]}


def engine_on_rank(mesh: DeviceMesh, family: str) -> dict[str, Any]:
    from autopar.runtime.engine import EngineConfig, ServeRequest, serve

    serving = autopar.compile_serving(hf.model(family), mesh, hf.step(1, ENGINE_CHUNK), hf.step(ENGINE_SLOTS, 1),
                                      constraints=hf.tp_plan(family), replica_axis="replica", cache_len=ENGINE_LEN)
    cache = tuple(f"model.model.layers.{i}.self_attn.slot_kv.{kv}" for i in range(2) for kv in "kv")
    config = EngineConfig(slots=ENGINE_SLOTS, chunk=ENGINE_CHUNK, max_len=ENGINE_LEN, token_budget=16,
                          cache_buffers=cache)
    requests = [ServeRequest(prompt=p, max_new_tokens=n, arrival_s=a) for p, n, a in REQUESTS_ARGS]
    out = {}
    for mode, roles in MODES.items():
        record = serve(serving, requests, mesh.mesh.tolist(), roles, config)
        out[mode] = {"replica": record.replica, "tokens": record.tokens, "sent": len(record.transfers)}
    return out


def _engine_families(rank: int, world: int) -> list[dict[str, Any]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "tp"))
    return [engine_on_rank(mesh, family) for family in FAMILIES]


def test_hf_replicas_serve_the_hf_tokens_aggregated_and_disaggregated() -> None:
    """2 replicas of tp=2 of each family on the continuous-batching engine: aggregated, and disaggregated
    (each request's cache sent point to point from the prefill replica to the decode replica), every
    request gets ``generate``'s tokens."""
    want = {family: [hf.reference(family, [p], n)[0] for p, n, _ in REQUESTS_ARGS] for family in FAMILIES}
    results = run_ranks(_engine_families, 4, timeout_s=600)
    for k, family in enumerate(FAMILIES):
        for mode, roles in MODES.items():
            delivered: dict[int, list[int]] = {}
            for per_family in results:
                record = per_family[k][mode]
                if roles[record["replica"]] != "prefill":
                    delivered.update(record["tokens"])
            assert [delivered.get(i) for i in range(len(REQUESTS_ARGS))] == want[family], (family, mode)
        assert sum(r[k]["disaggregated"]["sent"] for r in results) > 0, family


@pytest.mark.parametrize("tp,placement", [(2, Shard(2)), (4, Replicate())])
def test_the_cache_is_split_by_kv_heads_where_they_divide(tp: int, placement: Any) -> None:
    """As vLLM keeps it: 2 KV heads split on tp=2, replicated on tp=4 (a head cut in two would be gathered)."""
    from autopar.api.planning import plan_step
    from autopar.problem.nodes import BUFFER

    model = servable(hf.build("llama"))
    model.setup_cache(hf.SLOTS, hf.MAX_LEN)
    step = plan_step(model, {"tp": tp}, hf.step(hf.SLOTS, 1), train=False, constraints=hf.tp_plan("llama"))
    caches = {step.graph.nodes[n].fqn: step.chosen[n].outputs[0] for n in step.graph.order
              if step.graph.nodes[n].kind == BUFFER and ".slot_kv." in step.graph.nodes[n].fqn}
    assert len(caches) == 4 and set(caches.values()) == {(placement,)}, caches
