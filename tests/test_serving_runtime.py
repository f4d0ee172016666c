"""Serving on ranks: the example Llama's prefill and decode steps (its own KV cache, written in place
by ``index_put_``) compiled for one mesh with ``autopar.compile_serving``, on one copy of each
rank's weights and cache, generating exactly the single-device greedy tokens (fp32, gloo)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.api.planning import plan_step
from autopar.errors import InputError
from autopar.hardware import get_profile
from autopar.runtime.forked import run_ranks
from autopar.runtime.generate import generate
from autopar.runtime.ops import CollectiveLog
from autopar.problem.nodes import BUFFER, PARAM
from examples import llama, moe
from tests.numerics_harness import planned_counts

PROMPTS = [[5, 7, 9, 11, 13, 2, 3, 4, 8, 100, 200], [42, 17, 3], [1, 2, 3, 4, 5, 6, 7, 8]]
"""Three requests: over two chunks with padding, under one chunk, exactly two chunks."""
SLOTS, CHUNK, MAX_LEN, NEW = 4, 4, 32, 5


def _serving_llama() -> llama.Llama:
    model, *_ = llama.build()
    model.eval()
    model.setup_cache(slots=SLOTS, max_len=MAX_LEN)
    return model


def _step(batch: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Example (tokens, positions, slots) of a serving step."""
    zeros = torch.zeros(batch, steps, dtype=torch.long)
    return zeros, zeros.clone(), torch.arange(batch)


def _recomputed() -> tuple[list[list[int]], list[torch.Tensor]]:
    """Single-device greedy tokens of each prompt, the whole sequence recomputed every token (no
    cache), and the logits each token was chosen from, (prompts, vocab) per token."""
    model = _serving_llama()
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    logits: list[list[torch.Tensor]] = [[] for _ in range(NEW)]
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            seq = torch.tensor([prompt])
            for step in range(NEW):
                last = model(seq)[0, -1]
                logits[step].append(last)
                tokens[i].append(int(last.argmax()))
                seq = torch.cat([seq, last.argmax().view(1, 1)], 1)
    return tokens, [torch.stack(row) for row in logits]


def test_cached_greedy_tokens_equal_recomputing_the_sequence() -> None:
    """One device: the cache (a batch of rows into their slots, then chunked prefill with padding
    and decode of all slots) gives the tokens of recomputing the whole sequence each time."""
    want, want_logits = _recomputed()
    model = _serving_llama()
    with torch.no_grad():
        got = generate(model, model, PROMPTS, NEW, chunk=CHUNK, slots=SLOTS, max_len=MAX_LEN)
        with pytest.raises(InputError, match="need 34 cache positions"):
            generate(model, model, [[1] * 30], NEW, chunk=CHUNK, slots=SLOTS, max_len=MAX_LEN)
        two = [PROMPTS[0][:10], PROMPTS[2][:8] + [0, 0]]  # one batched prefill of two rows into slots 3 and 1
        logits = model(torch.tensor(two), torch.arange(10).expand(2, 10), torch.tensor([3, 1]))
    assert got.tokens == want
    for step, (mine, theirs) in enumerate(zip(got.logits, want_logits)):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5, msg=f"token {step}")
    assert int(logits[0, -1].argmax()) == model(torch.tensor([PROMPTS[0][:10]]))[0, -1].argmax()
    assert int(logits[1, 7].argmax()) == want[2][0]


def _state_placements(step: Any) -> dict[str, tuple[Any, ...]]:
    """FQN -> placements of every parameter and buffer a planned step holds."""
    graph = step.graph
    return {graph.nodes[n].fqn: step.chosen[n].outputs[0] for n in graph.order
            if graph.nodes[n].kind in (PARAM, BUFFER)}


def test_prefill_planned_with_the_decode_steps_state_placements() -> None:
    """Pinned with ``state_placements`` (the decode step's, its LM head split otherwise than a batch-1 prefill
    planned alone places it), every parameter and cache buffer of the prefill matches, and a placement no
    strategy takes is refused by name."""
    model = _serving_llama()
    decode = _state_placements(plan_step(model, {"tp": 2}, _step(SLOTS, 1), train=False))
    alone = _state_placements(plan_step(model, {"tp": 2}, _step(1, CHUNK), train=False))
    head = (Shard(0),) if alone["output.weight"] == (Replicate(),) else (Replicate(),)  # not what alone chose
    decode = {**decode, "output.weight": head}
    pinned = plan_step(model, {"tp": 2}, _step(1, CHUNK), train=False, state_placements=decode)
    assert alone != decode and _state_placements(pinned) == decode
    assert pinned.plan.pinned["parameters, buffers"] == "placed as the step sharing them"
    with pytest.raises(InputError, match="norm.weight"):
        plan_step(model, {"tp": 2}, _step(1, CHUNK), train=False, state_placements={"norm.weight": (Shard(1),)})


def _log_step(module: autopar.ParallelModule, call: Any, names: tuple[str, ...]) -> dict[str, list[Any]]:
    """The collectives one call of ``module`` ran, and those its plan lists, as comparable lists."""
    log = CollectiveLog()
    module.attach_log(log)
    call()
    module.attach_log(None)
    ran = Counter((p, k, names[d], b) for p, k, d, b in log.entries)
    return {"ran": sorted(ran.items()), "planned": sorted(planned_counts(module.plan).items())}


def serve_on_rank(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    serving = autopar.compile_serving(_serving_llama(), mesh, _step(1, CHUNK), _step(SLOTS, 1),
                                      constraints=llama.TP_PLAN)
    prefill, decode = serving.prefill_module, serving.decode_module
    shared = [fqn for _, kind, fqn in prefill._placeholders if kind in ("param", "buffer")
              and (prefill.get_parameter(fqn) if kind == "param" else prefill.get_buffer(fqn)).data_ptr()
              != (decode.get_parameter(fqn) if kind == "param" else decode.get_buffer(fqn)).data_ptr()]
    got = generate(serving.prefill, serving.decode, PROMPTS, NEW, chunk=CHUNK, slots=SLOTS, max_len=MAX_LEN)
    names = ("tp",)
    logged = {"prefill": _log_step(prefill, lambda: serving.prefill(*_step(1, CHUNK)), names),
              "decode": _log_step(decode, lambda: serving.decode(*_step(SLOTS, 1)), names)}
    cache = decode.get_buffer("layers.0.attention.cache.k")
    return {"tokens": got.tokens, "logits": [t.tolist() for t in got.logits], "not_shared": shared,
            "cache": (tuple(cache.shape), serving.placements["layers.0.attention.cache.k"]), "logged": logged,
            "prefill_collectives": len(prefill.plan.collectives), "decode_collectives": len(decode.plan.collectives)}


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_serving_generates_the_single_device_tokens(tp: int) -> None:
    """Megatron TP (pinned) on tp=2 and tp=4: three prompts of different lengths (chunked, padded)
    then four decode steps of all slots give exactly the single-device greedy tokens, the logits
    to fp32 tolerance; prefill and decode run on the same tensors; the cache is split by KV heads
    where they divide by tp (kv_heads=2 on tp=2) and replicated where not (tp=4), as vLLM keeps
    it; each step runs exactly the collectives its plan lists."""
    want, want_logits = _recomputed()
    results = run_ranks(serve_on_rank, tp)
    for rank, result in enumerate(results):
        assert result["tokens"] == want, f"rank {rank}"
        for step, (mine, theirs) in enumerate(zip(result["logits"], want_logits)):
            torch.testing.assert_close(torch.tensor(mine), theirs, rtol=1e-4, atol=1e-5, msg=f"rank {rank} {step}")
        assert result["not_shared"] == [], f"rank {rank}: prefill holds its own copy of {result['not_shared']}"
        for step, logged in result["logged"].items():
            assert logged["ran"] == logged["planned"], f"rank {rank} {step}: executed collectives differ"
    shape, placements = results[0]["cache"]
    assert (shape, placements) == (((SLOTS, MAX_LEN, 1, 32), (Shard(2),)) if tp == 2 else
                                   ((SLOTS, MAX_LEN, 2, 32), (Replicate(),)))
    assert results[0]["prefill_collectives"] and results[0]["decode_collectives"]  # really tensor parallel


def _serving_moe() -> Any:
    """``examples/moe.py``'s model with experts wide enough that tp=2 splits them (as its training tests do)."""
    cfg = moe.MoEConfig(vocab_size=64, max_seq_len=MAX_LEN, hidden=64, heads=4, kv_heads=2, ffn_hidden=512,
                        layers=2, experts=16, top_k=2)
    model, *_ = moe.build(cfg, batch=1)
    model.eval()
    model.setup_cache(slots=SLOTS, max_len=MAX_LEN)
    return model


def _moe_logits(model: Any) -> Any:
    return lambda *step: model(*step)[0]  # (logits, aux): generate picks the logits


def serve_moe_on_rank(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    attention_tp = {k: v for k, v in llama.TP_PLAN.items() if ".attention." in k}
    serving = autopar.compile_serving(_serving_moe(), mesh, _step(1, CHUNK), _step(SLOTS, 1), constraints=attention_tp)
    got = generate(serving.prefill, serving.decode, MOE_PROMPTS, NEW, chunk=CHUNK, slots=SLOTS, max_len=MAX_LEN)
    return {"tokens": got.tokens, "cache": serving.placements["layers.0.attention.cache.k"]}


MOE_PROMPTS = [[p % 64 for p in prompt] for prompt in PROMPTS]


def test_a_mixture_of_experts_serves_the_single_device_tokens() -> None:
    """``examples/moe.py``'s model keeps its KV cache as the Llama does (``setup_cache``): cached greedy
    tokens equal recomputing the sequence on one device, and on tp=2 (attention split by heads, the
    cache by KV heads; the experts as the planner places them: whole, for so small a decode step)."""
    model = _serving_moe()
    want = []
    with torch.no_grad():
        for prompt in MOE_PROMPTS:
            seq = torch.tensor([prompt])
            for _ in range(NEW):
                seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], 1)
            want.append(seq[0, len(prompt):].tolist())
        cached = generate(_moe_logits(model), _moe_logits(model), MOE_PROMPTS, NEW, chunk=CHUNK, slots=SLOTS,
                          max_len=MAX_LEN)
    assert cached.tokens == want
    results = run_ranks(serve_moe_on_rank, 2)
    assert all(r["tokens"] == want for r in results), [r["tokens"] for r in results]
    assert results[0]["cache"] == (Shard(2),)


SLOW_MEMORY = dataclasses.replace(get_profile("h100"), name="h100-slow-memory",
                                  memory_bandwidth=get_profile("h100").memory_bandwidth / 1000)
"""An H100 whose memory is 1000x slower: reading every expert's weights per decode step then outweighs
the all-to-alls of a few tokens, so the planner splits the experts by expert (on these tiny shapes an
H100 keeps them whole)."""


def serve_moe_expert_parallel_on_rank(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    serving = autopar.compile_serving(_serving_moe(), mesh, _step(1, CHUNK), _step(SLOTS, 1), hardware=SLOW_MEMORY,
                                      decode_options={"data_axes": ("ep",), "expert_axes": ("ep",)})
    got = generate(serving.prefill, serving.decode, MOE_PROMPTS, NEW, chunk=CHUNK, slots=SLOTS, max_len=MAX_LEN)
    names = ("ep",)
    logged = {"prefill": _log_step(serving.prefill_module, lambda: serving.prefill(*_step(1, CHUNK)), names),
              "decode": _log_step(serving.decode_module, lambda: serving.decode(*_step(SLOTS, 1)), names)}
    kinds = {phase: {(c.kind, c.module.rsplit(".", 1)[-1]) for c in module.plan.collectives}
             for phase, module in (("prefill", serving.prefill_module), ("decode", serving.decode_module))}
    return {"tokens": got.tokens, "experts": {k: v for k, v in serving.placements.items() if ".experts." in k},
            "logged": logged, "kinds": kinds}


def test_expert_parallel_serving_dispatches_by_all_to_all_in_decode() -> None:
    """Expert parallelism per phase on ep=2: the decode step's batch of slots split on ep (attention data
    parallel, its new keys and values gathered into the whole cache) with the experts split by expert, tokens
    to their experts and back by all-to-all; the prefill chunk of one request (no batch to split) runs on the
    same expert shards, its tokens whole on every rank (the all-gather dispatcher). The single-device greedy
    tokens; each step runs exactly the collectives its plan lists."""
    model = _serving_moe()
    with torch.no_grad():
        want = generate(_moe_logits(model), _moe_logits(model), MOE_PROMPTS, NEW, chunk=CHUNK, slots=SLOTS,
                        max_len=MAX_LEN).tokens
    results = run_ranks(serve_moe_expert_parallel_on_rank, 2)
    assert all(r["tokens"] == want for r in results), [r["tokens"] for r in results]
    assert set(results[0]["experts"].values()) == {(Shard(0),)}
    assert ("all_to_all", "moe") in results[0]["kinds"]["decode"]
    assert not any(kind == "all_to_all" for kind, _ in results[0]["kinds"]["prefill"])
    for rank, result in enumerate(results):
        for step, logged in result["logged"].items():
            assert logged["ran"] == logged["planned"], f"rank {rank} {step}: executed collectives differ"


def refuse_on_rank(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    errors = []
    try:
        autopar.compile_serving(_serving_llama(), mesh, _step(1, CHUNK), _step(SLOTS, 1), train=True)
    except InputError as exc:
        errors.append(str(exc))
    serving = autopar.compile_serving(_serving_llama(), mesh, _step(1, CHUNK), _step(SLOTS, 1))
    try:
        serving.decode(*_step(SLOTS - 1, 1))
    except InputError as exc:
        errors.append(str(exc))
    return errors


def test_serving_refuses_training_options_and_other_shapes() -> None:
    """An option serving does not take is refused on every rank; a decode step of another batch
    than compiled is refused by name (the program is specialized on the shapes)."""
    results = run_ranks(refuse_on_rank, 2)
    for errors in results:
        assert len(errors) == 2, errors
        assert "train=" in errors[0] and "forward-only" in errors[0], errors[0]
        assert "shape" in errors[1], errors[1]


HF_PROMPT, HF_CHUNK, HF_CACHE = [5, 7, 9, 11, 13, 2], 4, 32


def _hf_static() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny HF Llama and transformers' export wrapper around it: a ``StaticCache`` of batch 1
    registered as buffers (``key_cache_i`` (1, kv heads, len, head dim), written by ``index_copy_``),
    called ``(input_ids, cache_position=...)`` with consecutive positions."""
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    from examples import hf_models
    model, *_ = hf_models.build_llama(batch=1, seq=HF_CACHE)
    model.eval()
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    return model, TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=HF_CACHE)


def _hf_greedy(prefill: Any, decode: Any) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens of ``HF_PROMPT`` (chunked prefill, the last chunk padded at the next positions,
    which the causal mask hides and decode overwrites in order) and the logits each came from."""
    from autopar.runtime.generate import whole
    length = len(HF_PROMPT)
    for start in range(0, length, HF_CHUNK):
        real = HF_PROMPT[start:start + HF_CHUNK]
        ids = torch.tensor([real + [0] * (HF_CHUNK - len(real))])
        last = whole(prefill(ids, cache_position=torch.arange(start, start + HF_CHUNK)))[0, len(real) - 1]
    tokens, logits = [int(last.argmax())], [last]
    for step in range(NEW - 1):
        last = whole(decode(torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([length + step])))[0, -1]
        tokens.append(int(last.argmax()))
        logits.append(last)
    return tokens, logits


def serve_hf_on_rank(rank: int, world: int) -> dict[str, Any]:
    from examples import hf_models
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    _, wrapped = _hf_static()
    constraints = {f"model.{pattern}": style for pattern, style in hf_models.LLAMA_TP_PLAN.items()}
    serving = autopar.compile_serving(wrapped, mesh, (torch.zeros(1, HF_CHUNK, dtype=torch.long),),
                                      (torch.zeros(1, 1, dtype=torch.long),), constraints=constraints,
                                      prefill_kwargs={"cache_position": torch.arange(HF_CHUNK)},
                                      decode_kwargs={"cache_position": torch.tensor([0])})
    tokens, logits = _hf_greedy(serving.prefill, serving.decode)
    cache = serving.decode_module.get_buffer("key_cache_0")
    prefill_ids, decode_ids = torch.zeros(1, HF_CHUNK, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    logged = {"prefill": _log_step(serving.prefill_module, lambda: serving.prefill(
                  prefill_ids, cache_position=torch.arange(HF_CHUNK)), ("tp",)),
              "decode": _log_step(serving.decode_module, lambda: serving.decode(
                  decode_ids, cache_position=torch.tensor([0])), ("tp",))}
    return {"tokens": tokens, "logits": [t.tolist() for t in logits], "logged": logged,
            "cache": (tuple(cache.shape), serving.placements["key_cache_0"])}


def test_hf_llama_static_cache_serving_generates_the_single_device_tokens() -> None:
    """Hugging Face's Llama with its ``StaticCache`` (transformers' export wrapper) on tp=2, Megatron
    TP pinned: chunked prefill then decode give the single-device tokens (recomputing the sequence),
    the cache is split by KV heads (dim 1 of HF's layout), and each step runs its plan's collectives."""
    pytest.importorskip("transformers")
    model, wrapped = _hf_static()
    want, want_logits = [], []
    with torch.no_grad():
        seq = torch.tensor([HF_PROMPT])
        for _ in range(NEW):
            last = model(seq).logits[0, -1]
            want.append(int(last.argmax()))
            want_logits.append(last)
            seq = torch.cat([seq, last.argmax().view(1, 1)], 1)
        assert _hf_greedy(wrapped, wrapped)[0] == want  # the wrapper's cache on one device
    for rank, result in enumerate(run_ranks(serve_hf_on_rank, 2)):
        assert result["tokens"] == want, f"rank {rank}"
        torch.testing.assert_close(torch.tensor(result["logits"]), torch.stack(want_logits), rtol=1e-4, atol=1e-5)
        assert result["cache"] == ((1, 1, HF_CACHE, 16), (Shard(1),)), result["cache"]
        for step, logged in result["logged"].items():
            assert logged["ran"] == logged["planned"] and logged["ran"], f"rank {rank} {step}: collectives differ"
