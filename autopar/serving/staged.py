"""A pipelined serving step's figures, read from its plan's stages.

A replica of tp x pp devices runs each step as one micro-batch through its pp stages in order
(``compile_serving``'s pipeline: GPipe, one micro-batch, one stage per rank), so a step's latency is
the chain the plan predicts (``plan.predicted.step_time_s``: every stage's forward, the sends between
them and the logits' broadcast). Each stage's ranks hold their layers' weights and KV caches only
(``pipeline.stage_memory`` counts a buffer one stage reads on that stage's ranks), so the memory a replica
serves from is its busiest rank's: the largest stage's weights, and the cache of the stage holding the
most cache bytes per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.pipeline.stages import PipelinePlan

SERVING_PIPELINE = {"schedule": "gpipe", "micro_batches": 1, "virtual_stages": 1}
"""A serving step's pipeline (``compile_serving`` pins the same): one micro-batch through the stages in order."""

Cut = tuple[tuple[str, ...], ...]
"""The units each stage runs (``Pipeline.stage_blocks``): pinned across a replica's steps so that every
step holds the same layers, and caches, on each stage."""


@dataclass(frozen=True, kw_only=True)
class StageFigures:
    """Per-device memory figures of a pipelined step, its busiest rank's."""

    weight_bytes: float
    """Weights per device of the stage holding the most."""
    working_bytes: float
    """Activations per device other than the KV caches, the largest over the ranks."""
    kv_bytes_per_token_device: float
    """KV-cache bytes a token takes on a device of the stage holding the most of them."""
    cut: Cut
    """The stages' units, as the plan cut them."""


def stage_of(module: str, cut: Cut) -> int:
    """The stage running ``module`` (a buffer's owner, e.g. 'layers.3.attention.cache'): the one whose
    unit it sits in; the first stage for what no repeated unit holds (the head's)."""
    for index, units in enumerate(cut):
        if any(module == u or module.startswith(u + ".") for u in units):
            return index
    return 0


def stage_figures(pipeline: PipelinePlan, buffers: list[tuple[str, list[int], str]], batch: int, max_len: int,
                  element_size: int, tp: int) -> StageFigures:
    """``buffers``: the plan's cache buffers as (owning module, shape, placement on the stage mesh), of
    leading shape (``batch``, ``max_len``). Each counts on its stage's ranks, at its share per device."""
    cut = tuple(tuple(s.blocks) for s in pipeline.stages)
    per_token = [0.0] * len(cut)
    for module, shape, placement in buffers:
        per_token[stage_of(module, cut)] += math.prod(shape[2:]) * element_size / (tp if "S" in placement else 1)
    held = [0.0] * pipeline.size  # each rank's weights and caches, the rest of its peak is working memory
    for s in pipeline.stages:
        held[s.rank] += s.state_bytes + per_token[s.index] * batch * max_len
    working = max((peak - held[r] for r, peak in enumerate(pipeline.rank_memory_bytes)), default=0.0)
    return StageFigures(weight_bytes=max(s.parameter_bytes for s in pipeline.stages),
                        working_bytes=max(working, 0.0), kv_bytes_per_token_device=max(per_token), cut=cut)


def element_size(buffers: dict[str, torch.Tensor]) -> int:
    """Bytes per element of the cache buffers (they share one dtype)."""
    return next(iter(buffers.values())).element_size()
