"""helgrind finds the race behind issue 26.4 in torch's gloo backend without waiting for a crash.

    python benchmarks/gloo_status_race.py --workers 2   # torch's default: races found, exit 1
    python benchmarks/gloo_status_race.py --workers 1   # autopar's forked ranks: none, exit 0

Two forked gloo ranks issue collectives strictly one at a time (an all-reduce, then two
all-gathers, each waited for before the next is issued), under valgrind's helgrind. It counts
the data races whose two accesses are both in ``ProcessGroupGloo::runLoop``: the unlocked
update of the group's status after a collective completed (``autopar.runtime.gloo``), which
two workers of one group make to the same ``std::string``. helgrind reports a race from the
order of lock operations, not from a collision, so the rare heap corruption it leads to need
not happen for the race to be found; whether it is seen still depends on how valgrind
schedules the two workers (this pattern showed 7 in one run with two workers; a lighter one
none), so only a run with races proves anything. Needs valgrind; about 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's autopar, not an installed one

RUN_LOOP = "ProcessGroupGloo::runLoop"


def _rank(rank: int, port: int, workers: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    from autopar.runtime.gloo import one_worker_per_group
    torch.set_num_threads(1)
    if workers == 1:
        one_worker_per_group()
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(minutes=20))  # helgrind runs ~100x slower
    big = torch.ones(1 << 16)
    for _ in range(repeats):  # each waited for before the next is issued
        dist.all_reduce(big)
        for k in (1, 2):
            fc.wait_tensor(fc.all_gather_single(torch.ones(64 * k), 0, dist.group.WORLD))
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown in a forked child


def _ranks(workers: int, repeats: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [mp.get_context("fork").Process(target=_rank, args=(r, port, workers, repeats)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(abs(p.exitcode or 0) for p in procs)


def run_loop_races(log: str) -> int:
    """Reports in a helgrind log whose access and the access it conflicts with are both in runLoop."""
    count = 0
    for report in log.split("Possible data race")[1:]:
        access, _, rest = report.partition("This conflicts with a previous access")
        conflicting = rest.split("Address ")[0]
        count += RUN_LOOP in access and RUN_LOOP in conflicting
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, choices=(1, 2), default=2, help="gloo worker threads per group")
    parser.add_argument("--repeats", type=int, default=10, help="all-reduce + 2 all-gathers per rank")
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)  # the run under helgrind
    args = parser.parse_args()
    if args.rank_job:
        sys.exit(_ranks(args.workers, args.repeats))
    with tempfile.TemporaryDirectory() as logs:
        command = ["valgrind", "--tool=helgrind", "--history-level=approx", "--num-callers=30",
                   f"--log-file={logs}/%p.log", sys.executable, __file__, "--rank-job",
                   f"--workers={args.workers}", f"--repeats={args.repeats}"]
        done = subprocess.run(command, env={**os.environ, "PYTHONMALLOC": "malloc"}, check=False)
        races = sum(run_loop_races(p.read_text(errors="replace")) for p in Path(logs).glob("*.log"))
    print(f"workers={args.workers}: {races} race(s) between gloo workers in {RUN_LOOP} (ranks exit {done.returncode})")
    sys.exit(1 if races or done.returncode else 0)


if __name__ == "__main__":
    main()
