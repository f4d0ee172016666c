"""PyTorch's own parallelism for HF ``LlamaForCausalLM``, written by hand as torch's docs and
torchtitan write it: the other side of ``benchmarks/runtime_vs_torch.py``.

Each builder takes the single-device model (built from the same seed on every rank) and the
DeviceMesh, and returns a ``TorchStep``: one training step (forward, loss, backward, AdamW
update, ``zero_grad``) on this rank's share of the global batch, and that step's global loss.

* ``fsdp``:      ``fully_shard`` per decoder layer and at the root (FSDP2), ZeRO-3 by default,
  ZeRO-2 with ``reshard_after_forward=False``; optionally each layer wrapped in
  ``checkpoint_wrapper`` first (full, or selective with autopar's own policy: matmul and
  attention outputs kept, ``autopar.cost.recompute.SAVED_DISPATCH_OPS``), as torchtitan applies
  activation checkpointing before FSDP.
* ``fsdp_tp``:   ``parallelize_module`` with the Megatron plan on "tp", then FSDP2 on "dp".
* ``ddp``:       ``DistributedDataParallel`` (one gradient all-reduce per 25 MB bucket).
* ``zero1``:     DDP and torch's ZeRO-1 (``ZeroRedundancyOptimizer``: each rank steps its share
  of the parameters and broadcasts them).
* ``pipeline``:  ``torch.distributed.pipelining``'s 1F1B over "pp" (stage 0: embeddings and the first
  half of the layers, stage 1: the rest, the norm and the head), each stage's gradients
  all-reduced over "dp" in one flat buffer after the schedule (DDP's bucket, run once).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

LR = 1e-3
IGNORE_INDEX = -100


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss on already shifted targets (``examples.hf_models.causal_lm_loss``)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


@dataclass
class TorchStep:
    """A hand plan's training step on this rank; ``run`` returns the step's global loss, or None on a
    rank that does not see it (a pipeline's first stage)."""

    run: Callable[[torch.Tensor, torch.Tensor], float | None]


def _rows(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    """This rank's contiguous share of the batch along ``axis``."""
    n, r = mesh.size(mesh.mesh_dim_names.index(axis)), mesh.get_local_rank(axis)
    per = x.shape[0] // n
    return x[r * per:(r + 1) * per]


def _data_parallel_step(module: nn.Module, opt: torch.optim.Optimizer, mesh: DeviceMesh) -> TorchStep:
    """Each dp rank trains on its rows; the loss reported is the mean of the dp ranks' means
    (every row counts the same number of tokens, so this is the global mean)."""
    group = mesh.get_group("dp")

    def run(tokens: torch.Tensor, targets: torch.Tensor) -> float:
        loss = lm_loss(module(_rows(tokens, mesh, "dp")).logits, _rows(targets, mesh, "dp"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value, group=group)
        return value.item() / dist.get_world_size(group)
    return TorchStep(run)


def _selective_policy(ctx: object, func: object, *args: object, **kwargs: object) -> object:
    from torch.utils.checkpoint import CheckpointPolicy

    from autopar.cost.recompute import SAVED_DISPATCH_OPS
    return CheckpointPolicy.MUST_SAVE if func in SAVED_DISPATCH_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(layer: nn.Module, kind: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if kind == "full":
        return checkpoint_wrapper(layer)
    context = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    return checkpoint_wrapper(layer, context_fn=context)


def fsdp(model: nn.Module, mesh: DeviceMesh, *, reshard: bool = True, checkpoint: str = "none") -> TorchStep:
    """FSDP2 per layer and root on "dp" (``reshard``: ZeRO-3, else ZeRO-2), layers checkpointed first."""
    from torch.distributed.fsdp import fully_shard

    layers = model.model.layers
    for i, layer in enumerate(layers):
        if checkpoint != "none":
            layers[i] = layer = _checkpointed(layer, checkpoint)
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard)
    return _data_parallel_step(model, torch.optim.AdamW(model.parameters(), lr=LR), mesh)


def fsdp_tp(model: nn.Module, mesh: DeviceMesh) -> TorchStep:
    """The Megatron plan on "tp" (``examples.hf_models.LLAMA_TP_PLAN``), FSDP2 on "dp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from examples.hf_models import LLAMA_TP_PLAN
    parallelize_module(model, mesh["tp"], dict(LLAMA_TP_PLAN))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return _data_parallel_step(model, torch.optim.AdamW(model.parameters(), lr=LR), mesh)


def ddp(model: nn.Module, mesh: DeviceMesh) -> TorchStep:
    module = nn.parallel.DistributedDataParallel(model, device_mesh=mesh["dp"])
    return _data_parallel_step(module, torch.optim.AdamW(module.parameters(), lr=LR), mesh)


def zero1(model: nn.Module, mesh: DeviceMesh) -> TorchStep:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    module = nn.parallel.DistributedDataParallel(model, device_mesh=mesh["dp"])
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW, lr=LR,
                                  process_group=mesh.get_group("dp"))
    return _data_parallel_step(module, opt, mesh)


class _FirstStage(nn.Module):
    """Embeddings and the first layers (HF's own ``LlamaModel`` with the rest removed, no final norm)."""

    def __init__(self, model: nn.Module, cut: int) -> None:
        super().__init__()
        self.model = model.model
        self.model.layers = nn.ModuleList(list(self.model.layers)[:cut])
        self.model.norm = nn.Identity()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).last_hidden_state


class _LastStage(nn.Module):
    """The remaining layers, the final norm and the head, from the hidden states."""

    def __init__(self, model: nn.Module, cut: int) -> None:
        super().__init__()
        self.model, self.lm_head = model.model, model.lm_head
        self.model.layers = nn.ModuleList(list(self.model.layers)[cut:])
        self.model.embed_tokens = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(inputs_embeds=hidden).last_hidden_state)


def pipeline(model: nn.Module, mesh: DeviceMesh, micro_batches: int = 4) -> TorchStep:
    """1F1B over "pp" with two stages, each stage's gradients all-reduced over "dp" in one flat buffer."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage_index, stages = mesh.get_local_rank("pp"), mesh.size(mesh.mesh_dim_names.index("pp"))
    cut = len(model.model.layers) // 2
    last = stage_index == stages - 1
    module = _LastStage(model, cut) if last else _FirstStage(model, cut)
    stage = PipelineStage(module, stage_index, stages, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, micro_batches, loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    dp_group, dp = mesh.get_group("dp"), mesh.size(mesh.mesh_dim_names.index("dp"))
    params = [p for p in module.parameters() if p.requires_grad]

    def run(tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        if stage_index == 0:
            schedule.step(_rows(tokens, mesh, "dp"))
        else:
            schedule.step(target=_rows(targets, mesh, "dp"), losses=losses)
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        flat /= dp
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not last:
            return None
        value = torch.stack(losses).mean().detach()
        dist.all_reduce(value, group=dp_group)
        return value.item() / dp
    return TorchStep(run)
