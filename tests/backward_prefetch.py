"""What ZeRO-3's backward prefetch did on a rank (``autopar.runtime.regather``), for tests:
each handle saved, each block's backward start, each regather issued (a group's as one issue
per member, in a row) and each handle unpacked, in the order they happened, with how many
regather collectives the log held (a group's listed once per member)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import autopar
from autopar.runtime import regather as regather_module
from autopar.problem.block_paths import block_of

Event = tuple[str, str, int]
"""(what, block, regather collectives logged so far): what is 'pack' (forward saved a
handle), 'starts' (the block's backward started), 'issue' (a regather was issued) or
'unpack' (backward read a handle)."""


def watch(pm: autopar.ParallelModule) -> list[Event]:
    """The list the events of ``pm``'s steps go to, from now on. Patches the runtime's
    classes: call it in a forked rank only, whose process ends with the test."""
    events: list[Event] = []

    def note(what: str, block: str | None) -> None:
        log = pm._comm.log
        events.append((what, block or "", len(log.regathers) if log is not None else 0))

    cls, source, grouped = regather_module._Prefetcher, regather_module._Source, regather_module._GroupedRegathers
    pack, unpack, starts, launch = cls.pack, cls.unpack, cls.backward_starts, source.launch
    launch_group = grouped.launch

    def watch_pack(self: Any, t: torch.Tensor) -> Any:
        saved = pack(self, t)
        if isinstance(saved, regather_module._Saved):
            note("pack", block_of(saved.source.fqn))
        return saved

    def watch_unpack(self: Any, saved: Any) -> torch.Tensor:
        if isinstance(saved, regather_module._Saved):
            note("unpack", block_of(saved.source.fqn))
        return unpack(self, saved)

    def watch_starts(self: Any, block: str, previous: str) -> None:
        if block not in self.started:
            note("starts", block)
        starts(self, block, previous)

    def watch_launch(self: Any) -> Any:
        out = launch(self)
        note("issue", block_of(self.fqn))  # after: the count includes this regather's collectives
        return out

    def watch_group(self: Any, tag: str) -> None:
        issued = tag in self.launched
        launch_group(self, tag)
        for member in () if issued else self.members[tag].values():  # one collective: an issue per member
            note("issue", block_of(member.fqn))
    cls.pack, cls.unpack, cls.backward_starts = watch_pack, watch_unpack, watch_starts  # type: ignore[method-assign]
    source.launch = watch_launch  # type: ignore[method-assign]
    grouped.launch = watch_group  # type: ignore[method-assign]
    return events


def runs(events: list[Event]) -> list[list[Event]]:
    """The events of each program run (a step, or a micro-batch of one): forward's saved
    handles, then its backward's events."""
    out: list[list[Event]] = []
    backward = True  # the run before (none yet) is in its backward: a handle saved starts the next
    for event in events:
        if event[0] == "pack" and backward:
            out.append([])
            backward = False
        backward = backward or event[0] == "unpack"
        out[-1].append(event)
    return out


@dataclass(frozen=True, kw_only=True)
class BlockOrder:
    """One block's handles in one step's backward (``block_order``)."""

    saved: int
    """Handles its forward saved."""
    issued: list[int]
    """Positions of its regathers' issues in the step's events."""
    unpacked: list[int]
    """Positions of its handles' unpacks."""
    logged_at_first_unpack: int
    """Regather collectives the log held when its first handle was unpacked."""


def block_order(events: list[Event], block: str) -> BlockOrder:
    issued = [i for i, (what, b, _) in enumerate(events) if what == "issue" and b == block]
    unpacked = [i for i, (what, b, _) in enumerate(events) if what == "unpack" and b == block]
    return BlockOrder(saved=sum(1 for what, b, _ in events if what == "pack" and b == block), issued=issued,
                      unpacked=unpacked, logged_at_first_unpack=events[unpacked[0]][2] if unpacked else 0)


def assert_prefetched(events: list[Event], block: str, after: str) -> None:
    """``block``'s regathers were all issued as ``after``'s backward started, before ``block``
    unpacked any handle; and the log listed them by then."""
    starts = [i for i, (what, b, _) in enumerate(events) if what == "starts" and b == after]
    assert len(starts) == 1, f"{after}'s backward start fired {len(starts)} times"
    order = block_order(events, block)
    assert order.saved > 0 and len(order.issued) == len(order.unpacked) == order.saved, order
    # issued together right after the start: nothing of this rank's backward in between
    assert order.issued == list(range(starts[0] + 1, starts[0] + 1 + order.saved)), (order, starts)
    assert max(order.issued) < min(order.unpacked), order
    logged_before = events[starts[0]][2]
    assert order.logged_at_first_unpack >= logged_before + order.saved, order


def assert_on_demand(events: list[Event], block: str) -> None:
    """``block``'s regathers were issued as its handles were unpacked (nothing prefetched them):
    each as its own, or a group's all as the first of them (``runtime.regather``)."""
    order = block_order(events, block)
    assert order.saved > 0 and len(order.issued) == len(order.unpacked) == order.saved, order
    alone = all(u == i - 1 for i, u in zip(order.issued, order.unpacked))
    together = order.issued == list(range(order.unpacked[0] + 1, order.unpacked[0] + 1 + order.saved))
    assert alone or together, order
