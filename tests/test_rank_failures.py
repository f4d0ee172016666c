"""A failing or stuck rank: every rank errors within the timeout, and the report names the rank that raised.

``init_process_group(timeout=)`` sets the world group's timeout; a compiled module's mesh
groups take it too (``runtime.groups``), so a rank stuck outside a collective makes its
peers' collectives with it time out, not wait torch's 30 minutes. ``run_ranks`` reports the
rank that raised first (its peers then fail with "Connection closed by peer"), and never
kills a healthy rank for working long; only a rank silent past the run's whole limit
(stuck where no timeout reaches) fails.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime.forked import RankFailure, run_ranks
from autopar.runtime.groups import group_timeout, inherit_world_timeout

TIMEOUT_S = 2.0
ASLEEP_S = 8.0


def _stuck(rank: int, world: int) -> tuple[float, str]:
    """Rank 3 falls asleep; the others run a tp then a dp all-reduce on the mesh's own groups."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    inherit_world_timeout(mesh)
    dist.barrier()
    start = time.monotonic()
    try:
        if rank == 3:
            time.sleep(ASLEEP_S)
        for dim in ("tp", "dp"):
            fc.wait_tensor(fc.all_reduce(torch.ones(4), "sum", mesh.get_group(dim)))
    except RuntimeError as exc:
        return time.monotonic() - start, str(exc).splitlines()[0]
    return time.monotonic() - start, "no error"


def test_a_stuck_rank_fails_every_rank_within_the_timeout() -> None:
    results = run_ranks(_stuck, 4, timeout_s=TIMEOUT_S)
    assert all(message != "no error" for _, message in results), results
    # its peers within about the timeout (its tp peer times out; the others then find it gone), not 30 minutes
    assert all(elapsed < TIMEOUT_S + 4 for elapsed, _ in results[:3]), results
    assert results[3][0] >= ASLEEP_S  # the sleeper errors at its first collective after waking


def _mesh_timeouts(rank: int, world: int) -> list[float]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Linear(8, 8)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    autopar.compile(model, mesh, (x,), loss_fn=torch.nn.functional.mse_loss, example_targets=(y,),
                    data_axes=("dp",), pipeline=False)
    return [group_timeout(mesh.get_group(d)).total_seconds() for d in ("dp", "tp")]


def test_compile_gives_the_mesh_groups_the_users_timeout() -> None:
    """The mesh's groups were made with torch's default (30 minutes); compiling on it gives them the world's."""
    assert run_ranks(_mesh_timeouts, 4, timeout_s=45) == [[45.0, 45.0]] * 4


def _one_raises(rank: int, world: int) -> None:
    if rank == 2:
        raise ValueError("rank 2's own error")
    dist.all_reduce(torch.ones(2))  # fails once rank 2 has closed its connections


def test_the_report_names_the_rank_that_raised_first() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_one_raises, 3, timeout_s=10)
    message = str(failure.value)
    assert message.startswith("rank 2 failed first (then ranks [")
    assert "ValueError: rank 2's own error" in message


def _works_long(rank: int, world: int, seconds: float) -> int:
    time.sleep(seconds)  # working, not in a collective
    dist.barrier()
    return rank


def test_a_rank_working_long_is_not_killed() -> None:
    """Longer than the timeout and the grace after it together (a last-resort timer armed at their sum
    killed such ranks): nothing kills a rank that works."""
    assert run_ranks(_works_long, 2, 4.0, timeout_s=1, grace_s=1) == [0, 1]


def _hangs_outside_collectives(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(60)  # no collective's timeout reaches a rank that never calls one
    return rank


def test_a_rank_silent_past_the_limit_fails_the_run() -> None:
    """The suite's last resort: a rank that neither reports nor fails fails its test at ``limit_s``."""
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[1\] did not report within the run's limit"):
        run_ranks(_hangs_outside_collectives, 2, timeout_s=1, limit_s=3)
    assert time.monotonic() - start < 30


def test_group_timeout_reads_what_the_group_waits() -> None:
    def check(rank: int, world: int) -> float:
        group = dist.new_group([0, 1], timeout=timedelta(seconds=7))
        return group_timeout(group).total_seconds()
    assert run_ranks(check, 2) == [7.0, 7.0]


def _world_timeout(rank: int, world: int) -> float:
    return group_timeout(dist.group.WORLD).total_seconds()


def test_the_world_group_waits_the_timeout_once_every_rank_joined() -> None:
    """Joining (store, gloo's connections, a barrier) waits ``JOIN_S`` on a busy machine; the collectives
    the function then runs wait ``timeout_s``."""
    assert run_ranks(_world_timeout, 2, timeout_s=3) == [3.0, 3.0]


def test_forking_beside_a_live_process_group_is_refused() -> None:
    """A process group's threads (its store's, gloo's loops) forked mid-lock can hang a rank's own
    ``init_process_group``: run_ranks refuses to fork while they run, and forks again once the
    group is destroyed and collected."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        with pytest.raises(RuntimeError, match="still runs process-group threads"):
            run_ranks(_works_long, 2, 0.0)
    finally:
        dist.destroy_process_group()
        del store
    assert run_ranks(_works_long, 2, 0.0) == [0, 1]
