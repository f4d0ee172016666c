"""A checkpoint's files on disk: saves that commit atomically across ranks, loads that refuse
a checkpoint no save completed or whose keys differ from what is loaded.

Atomic saves. DCP's ``FileSystemWriter`` has rank 0 write ``.metadata`` (through a temporary
file renamed into place) only once every rank's shards are written, and reports a rank's
failure to every rank together. What it lacks is a fresh name for each save's shard files:
it writes ``__{rank}_0.distcp`` over the previous save's, so a save failing on one rank
leaves the old ``.metadata`` over the other ranks' new shards, a mixture that loads. Here each
save names its shards after its save id, so until ``.metadata`` is renamed into place the
previous checkpoint's files are untouched: that rename is the one commit of a save. Rank 0
then removes the shard files the committed ``.metadata`` does not name (the previous save's,
or a failed save's own).

Complete loads. A load first checks, on rank 0 for every rank, that ``.metadata`` exists and
that every shard file it names holds the bytes it names (a directory where no save completed,
a copy cut short).

Strict loads. DCP itself refuses (by one name) a key the loading state dict has and the
checkpoint lacks, and silently skips one the checkpoint has and the loading ranks lack
(a 2-block checkpoint into a 1-block model). ``strict`` refuses both, naming them, from DCP's
global plan (so every rank raises together, and a pipeline's ranks count together);
``strict=False`` loads the keys both hold.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan

from autopar.errors import CheckpointError, InputError

METADATA = ".metadata"
"""DCP's file naming every tensor's bytes; written last by a save."""
SHARDS = "*.distcp"
"""DCP's shard files."""
LISTED = 24
"""Keys named in a strictness error (then a count of the rest)."""

StatePath = tuple[str | int, ...]
"""Where a value sits in a nested state dict (dict keys and list indices)."""


class _OwnFilesWriter(FileSystemWriter):
    """DCP's file writer with each save's shard files named after its save id
    (``__{rank}_{save_id}_0.distcp``): a save never writes a file a committed ``.metadata`` names."""

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=dataclasses.replace(p.storage_data,
                                                                        prefix=f"{p.storage_data.prefix}{self.save_id}_"))
                for p in super().prepare_global_plan(plans)]


def save(state: dict[str, Any], path: Path) -> None:
    """Every rank writes its shards of ``state`` under ``path``; committed once all have."""
    writer = _OwnFilesWriter(path)
    failure: CheckpointException | None = None
    try:
        with warnings.catch_warnings():  # overwriting is safe here: the old files stay until the commit
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            dcp.save(state, storage_writer=writer)
    except CheckpointException as exc:  # every rank gets it, once every rank has finished writing
        failure = exc
    if not dist.is_initialized() or dist.get_rank() == 0:
        _remove_uncommitted(path, writer.save_id, committed=failure is None)
    if failure is not None:
        raise CheckpointError(f"checkpoint.save to {path} failed on {_summary(failure)}; nothing was committed: "
                              f"a checkpoint there is the last complete save, unchanged") from failure


def _remove_uncommitted(path: Path, save_id: str, committed: bool) -> None:
    """Shard files no committed ``.metadata`` names: the previous save's after a commit, this save's after a failure."""
    for file in path.glob(SHARDS):
        if (f"_{save_id}_" in file.name) != committed:
            file.unlink(missing_ok=True)


def _summary(failure: CheckpointException) -> str:
    return "; ".join(f"rank {rank} ({type(exc).__name__}: {exc})" for rank, (exc, _) in sorted(failure.failures.items()))


def refuse_incomplete(path: Path, agree: bool) -> None:
    """``InputError`` unless ``path`` holds a complete checkpoint; ``agree``: rank 0 looks and
    every rank raises together (a collective), else this process looks for itself."""
    lead = not agree or dist.get_rank() == 0
    problem = [_incomplete(path) if lead else None]
    if agree:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise InputError(problem[0])


def _incomplete(path: Path) -> str | None:
    """Why ``path`` holds no complete checkpoint, or None."""
    head = f"{path} holds no complete checkpoint"
    if not (path / METADATA).is_file():
        return (f"{head}: it has no {METADATA}, which checkpoint.save writes last, once every rank's shards are "
                f"written (a save that failed or did not finish, or no checkpoint)")
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is reported, on every rank
        return f"{head}: its {METADATA} does not read ({type(exc).__name__}: {exc})"
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            return f"{head}: its {METADATA} names {end} bytes of {name}, which is missing"
        if file.stat().st_size < end:
            return f"{head}: its {METADATA} names {end} bytes of {name}, which holds {file.stat().st_size} bytes"
    return None


class _KeyCheckingPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also records the keys the checkpoint lacks and, when
    ``strict``, refuses keys that differ (checkpoint keys under ``skip`` prefixes aside)."""

    def __init__(self, strict: bool, skip: tuple[str, ...]) -> None:
        super().__init__(allow_partial_load=True)  # a strict load names every missing key, below
        self.strict = strict
        self.skip = skip
        self.absent: list[StatePath] = []

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        held = set(self.metadata.state_dict_metadata) if self.metadata is not None else set()
        self.absent = [self.mappings[k] for k in sorted(set(self.state_dict) - held)]
        return dataclasses.replace(plan, planner_data=sorted(self.state_dict))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        if self.strict and self.metadata is not None:
            wanted = {k for plan in global_plan for k in plan.planner_data}
            saved = {k for k in self.metadata.state_dict_metadata if not k.startswith(self.skip)}
            if wanted != saved:
                raise InputError(f"the checkpoint's keys differ from the model's (strict=False loads the keys both "
                                 f"hold): in the checkpoint, not in the model: {_listed(saved - wanted)}; in the "
                                 f"model, not in the checkpoint: {_listed(wanted - saved)}")
        return super().create_global_plan(global_plan)


def _listed(keys: Iterable[str]) -> str:
    names = sorted(keys)
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return f"{len(names)} keys ({', '.join(names[:LISTED])}{more})" if names else "no keys"


def load(state: dict[str, Any], path: Path, strict: bool, skip: tuple[str, ...]) -> list[StatePath]:
    """DCP loads the checkpoint at ``path`` into ``state``'s tensors, in place; returns where
    the values the checkpoint lacks sit (only ``strict=False`` gets that far with any)."""
    planner = _KeyCheckingPlanner(strict, skip)
    try:
        dcp.load(state, storage_reader=FileSystemReader(path), planner=planner)
    except CheckpointException as exc:  # every rank gets it
        errors = [e for e, _ in exc.failures.values()]
        if all(isinstance(e, InputError) for e in errors):
            raise InputError(f"checkpoint {path}: {errors[0]}") from exc
        raise CheckpointError(f"checkpoint.load from {path} failed on {_summary(exc)}") from exc
    return planner.absent


def put_back(state: dict[str, Any], original: dict[str, Any], paths: list[StatePath]) -> None:
    """``original``'s values at ``paths`` into ``state`` (a load's templates the checkpoint did not fill)."""
    for path in paths:
        into, source = state, original
        for key in path[:-1]:
            into, source = into[key], source[key]
        into[path[-1]] = source[path[-1]]
