"""``autopar.compile_serving``: a prefill program and a decode program on one copy of the rank's state.

A serving step writes its keys and values into KV-cache buffers in place, and the two programs of a
deployment (a prefill chunk of one request, a decode step of every slot) must read and write the
same cache and the same weights. Two independently planned steps would place them differently
(a batch-1 prefill may, say, split the LM head by vocabulary while the decode step keeps it whole),
so the decode step, which runs for every generated token, is planned freely, and the prefill step is
planned with every parameter and buffer pinned to the decode plan's placements
(``prepare_step(state_placements=...)``): the planner prices the prefill's activations and
collectives around a state layout it cannot change. The prefill module is then built on the decode
module's very tensors (``rank_state(shared=...)``), so a cache write by either is seen by both.
How the cache is split is the decode plan's choice: under Megatron TP (``constraints=``) the cache
follows the key/value projections, split by KV heads where they divide by the tp axis and
replicated where they do not (as vLLM keeps them), since a head cut in two would gather it.

With ``pipeline=`` both steps are cut into stages (``runtime.pipeline``: one micro-batch through
the stages in order, the last stage's outputs broadcast to every rank), the prefill's cuts pinned to
the decode's (``Pipeline.stage_blocks``) as its placements are, so that each stage's layers, and their
KV caches, are held once and shared by both programs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from autopar.api.compiling import compile
from autopar.errors import InputError
from autopar.hf.servable import as_servable
from autopar.pipeline.spec import Pipeline
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline import PipelinedModule
from autopar.runtime.rank_errors import gather_errors
from autopar.runtime.serving import ServingModule
from autopar.serving.planner import plan_serving

__all__ = ["compile_serving", "plan_serving"]

_REFUSED = {"train": "serving steps are forward-only (train=False)",
            "loss_fn": "serving steps return the model's outputs, not a loss",
            "example_targets": "serving steps return the model's outputs, not a loss",
            "micro_batches": "micro_batches applies to training steps",
            "input_sharded": "serving ranks each pass the whole step's inputs",
            "example_kwargs": "pass each step's keyword inputs as prefill_kwargs= and decode_kwargs=",
            "state_placements": "the prefill step's state is placed as the decode step's",
            "_shared_state": "the prefill step runs on the decode step's state"}



def compile_serving(model: nn.Module, mesh: DeviceMesh, prefill_inputs: tuple[Any, ...],
                    decode_inputs: tuple[Any, ...], *, prefill_kwargs: dict[str, Any] | None = None,
                    decode_kwargs: dict[str, Any] | None = None, prefill_options: dict[str, Any] | None = None,
                    decode_options: dict[str, Any] | None = None, cache_len: int | None = None,
                    **options: Any) -> ServingModule:
    """Plan and build this rank's serving programs for ``model`` on ``mesh`` (call on every rank
    with the same arguments, as :func:`autopar.compile`).

    ``decode_inputs`` (and ``decode_kwargs``) are an example of a decode step, ``prefill_inputs``
    (``prefill_kwargs``) of a prefill step; the model's KV cache is its buffers, written in place
    (e.g. the example Llama after ``setup_cache``: ``(tokens, positions, slots)`` of shapes
    ``(1, chunk), (1, chunk), (1,)`` and ``(slots, 1), (slots, 1), (slots,)``). ``options`` go to
    ``autopar.compile`` for both steps (``constraints``, ``hardware``, ``precision``, ...), each
    compiled ``train=False``; ``prefill_options`` and ``decode_options`` add to them for one step (e.g. the
    decode's batch of slots split on a data axis whose experts are split by expert, ``data_axes=("ep",),
    expert_axes=("ep",)``, where a prefill chunk of one request has no batch to split). The decode step is
    planned first and freely; the prefill step's
    parameters and buffers are pinned to the decode plan's placements, and its program runs on
    the decode module's shards (see the module docstring). ``pipeline=autopar.Pipeline(axis=...)``
    cuts both into stages (one micro-batch, GPipe, one stage per rank; other choices are refused),
    the prefill at the decode's cuts. Errors (an option serving does not take, a prefill step that
    cannot take the decode plan's placements or cuts) are raised on every rank. An HF causal LM is served
    as it is (``autopar.hf.servable``): its cache gets the decode step's slots and ``cache_len`` positions
    (default: the model's), module FQNs gaining the adapter's ``model.`` prefix.
    """
    model = _servable(model, decode_inputs, cache_len)
    both = [options, prefill_options or {}, decode_options or {}]
    refused = next((f"{k}=: {why}" for k, why in _REFUSED.items() if any(k in o for o in both)), "")
    pipeline = options.pop("pipeline", None)
    if refused == "" and any("pipeline" in o for o in both[1:]):
        refused = "pipeline=: both steps run one pipeline (pass it once, beside the other options)"
    gather_errors("checking the serving options", refused or _pipeline_error(pipeline), InputError)
    if pipeline is not None:  # one micro-batch (a prefill chunk, a decode step) through the stages in order
        pipeline = replace(pipeline, schedule="gpipe", micro_batches=1, virtual_stages=1)
    decode = compile(model, mesh, decode_inputs, example_kwargs=decode_kwargs, train=False, pipeline=pipeline,
                     **{**options, **(decode_options or {})})
    if isinstance(decode, PipelinedModule):  # the prefill's stages hold the decode's layers (and KV caches)
        assert decode.plan.pipeline is not None and pipeline is not None
        pipeline = replace(pipeline, stage_blocks=tuple(tuple(s.blocks) for s in decode.plan.pipeline.stages))
    prefill = compile(model, mesh, prefill_inputs, example_kwargs=prefill_kwargs, train=False, pipeline=pipeline,
                      state_placements=_all_placements(decode), _shared_state=_state(decode),
                      **{**options, **(prefill_options or {})})
    gather_errors("sharing the state of the prefill and decode steps", _disagreement(decode, prefill))
    return ServingModule(prefill=prefill, decode=decode)


def _servable(model: nn.Module, decode_inputs: tuple[Any, ...], cache_len: int | None) -> nn.Module:
    """``model``, or an HF causal LM in its slot-indexed cache adapter, its cache set up for the decode step."""
    served = as_servable(model)
    if served is not model:
        served.setup_cache(int(decode_inputs[0].shape[0]), cache_len)  # type: ignore[operator]
    elif cache_len is not None:
        raise InputError("cache_len= sizes the cache of an HF causal LM; this model sets up its own (setup_cache)")
    return served


def _pipeline_error(pipeline: object) -> str:
    """What keeps ``pipeline=`` from serving ("" if nothing): a serving step is one micro-batch
    run through the stages in order, so only the stages' axis (and their cuts) may be chosen."""
    if pipeline is None:
        return ""
    if not isinstance(pipeline, Pipeline):
        return f"pipeline= takes an autopar.Pipeline(axis=...), got {type(pipeline).__name__}"
    if pipeline.from_axis is not None:
        return "pipeline=Pipeline(from_axis=...): name the pipeline axis in the mesh to serve on it"
    wrong = {k: v for k, v in (("schedule", pipeline.schedule), ("micro_batches", pipeline.micro_batches),
                               ("virtual_stages", pipeline.virtual_stages)) if v not in (None, "gpipe", 1)}
    if wrong:
        return (f"pipeline=: a serving step runs one micro-batch through one stage per rank in order (schedule "
                f"'gpipe', micro_batches 1, virtual_stages 1), got {wrong}")
    return ""


def _all_placements(module: ParallelModule | PipelinedModule) -> dict[str, tuple[Placement, ...]]:
    """FQN -> placements of every parameter and buffer of the step, as every rank pins them (a
    pipelined module's ranks each hold their stages' only: theirs are gathered, a collective)."""
    if not isinstance(module, PipelinedModule):
        return dict(module._placements)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, dict(module._placements))
    return {fqn: placements for mine in every for fqn, placements in mine.items()}


def _state(module: ParallelModule | PipelinedModule) -> dict[str, torch.Tensor]:
    """FQN -> the rank's tensor of each parameter and buffer ``module`` holds (a pipelined
    module: its stages' only), for another program to run on."""
    if isinstance(module, PipelinedModule):
        return {**dict(module.named_parameters(remove_duplicate=False)),
                **dict(module.named_buffers(remove_duplicate=False))}
    return {fqn: module.get_parameter(fqn) if kind == "param" else module.get_buffer(fqn)
            for _, kind, fqn in module._placeholders if kind in ("param", "buffer")}


def _disagreement(decode: ParallelModule | PipelinedModule, prefill: ParallelModule | PipelinedModule) -> str:
    """What keeps the two programs from sharing their state ("" if nothing): a tensor both read,
    placed differently (the pins keep this from happening; checked since a wrong shard is silent)."""
    differ = [f"{fqn}: decode {decode._placements[fqn]}, prefill {placements}"
              for fqn, placements in prefill._placements.items()
              if fqn in decode._placements and tuple(decode._placements[fqn]) != tuple(placements)]
    return f"placed differently by the two plans: {'; '.join(differ[:4])}" if differ else ""
