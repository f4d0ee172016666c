"""Forked ranks run every gloo group on one worker thread (``autopar.runtime.gloo``).

With torch's two workers per group, a worker records a finished collective in the group's
status without a lock while the other one may be recording the next: two assignments of one
``std::string`` at once, which corrupts the heap now and then (issue 26.4: "malloc(): unaligned
tcache chunk detected" in a ZeRO-3 test's final ``state_dict`` after its collectives had all
been issued one at a time). The crash is far too rare to wait for in a test; what the fix
guarantees is checked instead: no group a rank makes, the world's or a mesh's, runs two workers.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.runtime import groups
from autopar.runtime.forked import run_ranks
from autopar.runtime.gloo import workers


def _gloo_workers(group: dist.ProcessGroup) -> int:
    return workers(group._get_backend(torch.device("cpu")))


def _runloop_threads() -> int:
    """Worker threads of the gloo groups alive in this process (torch names them)."""
    return sum((t / "comm").read_text().strip() == "pt_gloo_runloop" for t in Path("/proc/self/task").iterdir())


def _mesh_groups(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    found = [dist.group.WORLD, mesh.get_group(0), mesh.get_group(1)]
    sums = []
    for group in found:  # each group still runs collectives (and makes its backend, if lazy)
        x = torch.ones(3)
        dist.all_reduce(x, group=group)
        sums.append(x.tolist())
    default = groups.group_timeout(mesh.get_group(0))
    return {"workers": [_gloo_workers(g) for g in found], "threads": _runloop_threads(), "sums": sums,
            "default_timeout_s": default.total_seconds()}


def test_every_gloo_group_of_a_forked_rank_runs_one_worker() -> None:
    for r in run_ranks(_mesh_groups, 4):
        assert r["workers"] == [1, 1, 1]
        assert r["threads"] == 3  # one per group: none runs a second worker beside it
        assert r["sums"] == [[4.0] * 3, [2.0] * 3, [2.0] * 3]
        # torch's own default timeout for a group made without one (``groups.inherit_world_timeout`` reads it)
        assert r["default_timeout_s"] == datetime.timedelta(minutes=30).total_seconds()


def _compile_on_two_workers(rank: int, world: int) -> list[str]:
    """A mesh made with torch's two workers per group (this rank's patch undone first; dp is the world group,
    made before, with one): compile says which dims run two."""
    import warnings

    from torch._C._distributed_c10d import ProcessGroupGloo

    import autopar
    from examples import gpt

    ProcessGroupGloo.__init__ = ProcessGroupGloo.__init__.__wrapped__  # type: ignore[attr-defined]
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    model, inputs, loss_fn, targets = gpt.build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, pipeline=False)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_compile_warns_where_a_mesh_runs_two_gloo_workers() -> None:
    for messages in run_ranks(_compile_on_two_workers, 2):
        assert any("gloo groups on tp run two worker threads" in m and "one_worker_per_group()" in m
                   for m in messages), messages
