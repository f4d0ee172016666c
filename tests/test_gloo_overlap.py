"""On gloo, autopar never issues a collective while another one runs on its group.

gloo corrupts the heap when collectives of one process group overlap: a rank aborts with
``malloc(): unaligned tcache chunk detected`` or a segfault, rarely (``benchmarks/gloo_overlap.py``
reproduces it with torch alone). So no test can wait for the crash; instead every collective
the runtime issues is watched (``collective_overlap``) for one left running beside it: a
gather launched ahead, a gradient's reduce-scatter left unwaited, a gradient bucket's
all-reduce, the ring's sends, a pipeline's sends and receives. The cases are one of each of
the suites that aborted (pipeline, experts, context parallelism), and ZeRO-3 and TP x DP
on the GPT example, where all of those run in one step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.distributed.device_mesh import init_device_mesh

import autopar
import collective_overlap
from autopar.runtime.forked import run_ranks
from examples import gpt
from numerics_harness import Reference, reference, run_compiled
import test_numerics_context as context
import test_numerics_moe as moe
import test_numerics_pipeline as pipeline


def _pattern(rank: int, world: int, serial: bool) -> list[str]:
    """The reproducer's repeat: an all-reduce left running while an all-gather is issued."""
    with collective_overlap.watch() as seen:
        work = dist.all_reduce(torch.ones(1024), async_op=True)
        if serial:
            work.wait()
        fc.wait_tensor(fc.all_gather_single(torch.ones(4), 0, dist.group.WORLD))
        work.wait()
    return seen.overlaps


def test_the_watch_sees_the_reproducers_overlap() -> None:
    assert all(len(o) == 1 and "all_gather_single" in o[0] and "all_reduce" in o[0]
               for o in run_ranks(_pattern, 2, False))
    assert run_ranks(_pattern, 2, True) == [[], []]


def _gpt(mesh_shape: tuple[int, ...], names: tuple[str, ...], options: dict[str, Any]
         ) -> Callable[[int, int, Reference], dict[str, Any]]:
    def train(rank: int, world: int, ref: Reference) -> dict[str, Any]:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        model, inputs, loss_fn, targets = gpt.build()
        pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                             **{"pipeline": False, **options})
        return run_compiled(pm, (*inputs, *targets), ref)
    return train


def _case(cases: list[Any], case_id: str) -> Any:
    found, = (c for c in cases if c.id == case_id)
    return found


CASES: dict[str, tuple[Callable[..., dict[str, Any]], Any, Callable[[], Reference], int]] = {
    "gpt-dp2-zero3": (_gpt((2,), ("dp",), {"data_axes": ("dp",), "zero": {"dp": 3}}), None,
                      lambda: reference(gpt.build), 2),
    "gpt-dp2xtp2": (_gpt((2, 2), ("dp", "tp"), {"data_axes": ("dp",)}), None, lambda: reference(gpt.build), 4),
    "pipeline-pp2xdp2-zero3": (pipeline._train, _case(pipeline.CASES, "llama-pp2xdp2-1f1b-m2-v1-data_axes-zero"),
                               lambda: pipeline._reference("llama"), 4),
    "moe-dp2xep2-zero3": (moe.train_on_rank, _case(moe.CASES, "2x2-dpxep-top2-dropless-zero3"), None, 4),
    "context-cp2-ulysses": (context.train_llama_on_rank, _case(context.LLAMA_CASES, "cp2-b1-s16-ulysses"), None, 2),
    "context-cp2-ring": (context.train_llama_on_rank, _case(context.LLAMA_CASES, "cp2-b1-s16-zigzag-ring-selective"),
                         None, 2),
}


def _watched(rank: int, world: int, train: Callable[..., dict[str, Any]], case: Any, ref: Reference
             ) -> tuple[int, list[str]]:
    with collective_overlap.watch() as seen:
        if case is None:
            train(rank, world, ref)
        else:
            train(rank, world, case, ref)
    return seen.issued, seen.overlaps


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_collective_runs_beside_another(name: str) -> None:
    train, case, make_ref, world = CASES[name]
    ref = make_ref() if make_ref is not None else reference(case.build)
    for issued, overlaps in run_ranks(_watched, world, train, case, ref):
        assert issued > 0
        assert overlaps == []
