"""Memory scenarios around the placement ILP: micro-batches, activation checkpointing and
gathering parameters again in backward.

The ILP decides placements, and with them which parameters are stored split on a data
axis (ZeRO/FSDP sharding is a placement). Three choices change what every node costs
rather than which strategy it runs, so they are searched around it, each combination a
``Scenario`` priced by the same functions the plan and the runtime use:
- micro-batches m (the step captured at batch / m: work and collectives run m times,
  activations of one micro-batch are alive at a time, gradients sync once);
- activation checkpointing of the repeated blocks (none, selective, full);
- re-gathering parameters in backward instead of holding them (ZeRO-3);
- optimizer state and fp32 master weights in host memory (offload), tried last.

With memory to spare none of them pays off: each adds time to every plan (a replay, a
second gather, per-micro-batch fixed costs) and frees only memory. So the search first
solves today's scenario without the memory row; if that plan fits, it is the plan (one
solve, as before). Otherwise every candidate scenario is solved under the limit and the
fastest plan wins; the candidate set does not depend on the limit, so a tighter limit
never gives a faster plan. Pinned choices (``MemoryOptions``) fix their dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.solver.memory import CHECKPOINT_POLICIES, MemoryOptions

MICRO_BATCH_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
"""Micro-batch counts the planner tries (those dividing the batch)."""


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One combination of the choices searched around the ILP."""

    micro_batches: int = 1
    checkpoint: str = "none"
    """Policy for every repeated block."""
    regather: bool = False
    """Parameters gathered for a forward use are gathered again in backward (ZeRO-3)."""
    offload: bool = False
    """Optimizer state and master weights of trainable parameters live in host memory."""

    def describe(self) -> str:
        parts = [f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}",
                 f"{self.checkpoint} checkpointing" if self.checkpoint != "none" else "no checkpointing"]
        if self.regather:
            parts.append("parameters gathered again in backward")
        if self.offload:
            parts.append("optimizer state on the host")
        return ", ".join(parts)


def candidates(options: MemoryOptions, batch: int | None, has_blocks: bool, train: bool) -> list[Scenario]:
    """The scenarios to search, cheapest-looking first (the first is today's default)."""
    pinned = Scenario(micro_batches=options.micro_batches or 1, checkpoint=options.checkpoint or "none",
                      regather=_pinned_regather(options) or False, offload=bool(options.offload))
    if not train:
        return [pinned]
    if options.micro_batches:
        counts = [options.micro_batches]
    else:
        counts = [m for m in MICRO_BATCH_CANDIDATES if batch is not None and m <= batch and batch % m == 0] or [1]
    policies = [options.checkpoint] if options.checkpoint else list(CHECKPOINT_POLICIES) if has_blocks else ["none"]
    regathers = [_pinned_regather(options)] if options.zero is not None else [False, True]
    offloads = [options.offload] if options.offload is not None else [False, True]
    return [Scenario(micro_batches=m, checkpoint=c, regather=bool(r), offload=o)
            for o in offloads for m in counts for c in policies for r in regathers]


def leanest(scenarios: list[Scenario]) -> list[Scenario]:
    """The scenarios that may keep the least memory: per micro-batch count, the one that saves
    the most otherwise (offloaded, full checkpointing, re-gathering). More micro-batches are
    not always leaner (their gradient-bucket buffers are held for the whole step), so each
    count is a candidate."""
    order = {p: i for i, p in enumerate(CHECKPOINT_POLICIES)}
    best: dict[int, Scenario] = {}
    for s in scenarios:
        key = (s.offload, order[s.checkpoint], s.regather)
        if s.micro_batches not in best or key > (best[s.micro_batches].offload,
                                                 order[best[s.micro_batches].checkpoint],
                                                 best[s.micro_batches].regather):
            best[s.micro_batches] = s
    return [best[m] for m in sorted(best)]


def _pinned_regather(options: MemoryOptions) -> bool | None:
    if options.zero is None:
        return None
    return any(stage == 3 for stage in options.zero.values())
