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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from autopar.errors import InputError
from autopar.runtime.compile import _gather_errors, compile
from autopar.runtime.module import ParallelModule

_REFUSED = {"train": "serving steps are forward-only (train=False)",
            "pipeline": "pipelined serving is not supported yet",
            "loss_fn": "serving steps return the model's outputs, not a loss",
            "example_targets": "serving steps return the model's outputs, not a loss",
            "micro_batches": "micro_batches applies to training steps",
            "input_sharded": "serving ranks each pass the whole step's inputs",
            "example_kwargs": "pass each step's keyword inputs as prefill_kwargs= and decode_kwargs=",
            "state_placements": "the prefill step's state is placed as the decode step's",
            "_shared_state": "the prefill step runs on the decode step's state"}


class ServingModule(nn.Module):
    """This rank's prefill and decode programs on one copy of its parameter and KV-cache shards.

    ``prefill(*inputs)`` and ``decode(*inputs)`` run a step (without autograd) on inputs shaped as
    compiled (another shape is refused by name, as ``ParallelModule`` refuses it) and return its
    outputs as DTensors placed as planned. ``state_dict()`` and ``parameters()`` are the decode
    module's, which owns the state; ``placements`` maps each FQN to the placements both plans give it.
    """

    def __init__(self, *, prefill: ParallelModule, decode: ParallelModule) -> None:
        super().__init__()
        self.decode_module = decode  # owns the state (the only submodule: each tensor listed once)
        object.__setattr__(self, "prefill_module", prefill)

    @property
    def placements(self) -> dict[str, tuple[Placement, ...]]:
        return dict(self.decode_module._placements)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.decode_module.device_mesh

    @torch.no_grad()
    def prefill(self, *inputs: Any, **kwargs: Any) -> Any:
        """One prefill step (a chunk of one request's prompt, as compiled): the model's outputs."""
        return self.prefill_module(*inputs, **kwargs)

    @torch.no_grad()
    def decode(self, *inputs: Any, **kwargs: Any) -> Any:
        """One decode step (a token of every slot, as compiled): the model's outputs."""
        return self.decode_module(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        raise InputError("a ServingModule runs two programs: call .prefill(...) or .decode(...)")

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.decode_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> Any:
        """Copy values into the shared shards (both programs read them)."""
        return self.decode_module.load_state_dict(state_dict, strict, assign)


def compile_serving(model: nn.Module, mesh: DeviceMesh, prefill_inputs: tuple[Any, ...],
                    decode_inputs: tuple[Any, ...], *, prefill_kwargs: dict[str, Any] | None = None,
                    decode_kwargs: dict[str, Any] | None = None, **options: Any) -> ServingModule:
    """Plan and build this rank's serving programs for ``model`` on ``mesh`` (call on every rank
    with the same arguments, as :func:`autopar.compile`).

    ``decode_inputs`` (and ``decode_kwargs``) are an example of a decode step, ``prefill_inputs``
    (``prefill_kwargs``) of a prefill step; the model's KV cache is its buffers, written in place
    (e.g. the example Llama after ``setup_cache``: ``(tokens, positions, slots)`` of shapes
    ``(1, chunk), (1, chunk), (1,)`` and ``(slots, 1), (slots, 1), (slots,)``). ``options`` go to
    ``autopar.compile`` for both steps (``constraints``, ``hardware``, ``precision``, ...), each
    compiled ``train=False``. The decode step is planned first and freely; the prefill step's
    parameters and buffers are pinned to the decode plan's placements, and its program runs on
    the decode module's shards (see the module docstring). Errors (an option serving does not
    take, a prefill step that cannot take the decode plan's placements) are raised on every rank.
    """
    refused = next((f"{k}=: {why}" for k, why in _REFUSED.items() if k in options), "")
    _gather_errors("checking the serving options", refused, InputError)
    decode = compile(model, mesh, decode_inputs, example_kwargs=decode_kwargs, train=False, **options)
    assert isinstance(decode, ParallelModule)  # no pipeline (refused above)
    shared = {fqn: decode.get_parameter(fqn) if kind == "param" else decode.get_buffer(fqn)
              for _, kind, fqn in decode._placeholders if kind in ("param", "buffer")}
    prefill = compile(model, mesh, prefill_inputs, example_kwargs=prefill_kwargs, train=False,
                      state_placements=decode._placements, _shared_state=shared, **options)
    assert isinstance(prefill, ParallelModule)
    _gather_errors("sharing the state of the prefill and decode steps", _disagreement(decode, prefill))
    return ServingModule(prefill=prefill, decode=decode)


def _disagreement(decode: ParallelModule, prefill: ParallelModule) -> str:
    """What keeps the two programs from sharing their state ("" if nothing): a tensor both read,
    placed differently (the pins keep this from happening; checked since a wrong shard is silent)."""
    differ = [f"{fqn}: decode {decode._placements[fqn]}, prefill {placements}"
              for fqn, placements in prefill._placements.items()
              if fqn in decode._placements and tuple(decode._placements[fqn]) != tuple(placements)]
    return f"placed differently by the two plans: {'; '.join(differ[:4])}" if differ else ""
