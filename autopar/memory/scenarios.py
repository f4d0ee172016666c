"""Memory scenarios around the placement ILP: micro-batches, activation checkpointing and
gathering parameters again in backward.

The ILP decides placements, and with them which parameters are stored split on a data
axis (ZeRO/FSDP sharding is a placement). Three choices change what every node costs
rather than which strategy it runs, so they are searched around it, each combination a
``Scenario`` priced by the same functions the plan and the runtime use:
- micro-batches m (the step captured at batch / m: work and collectives run m times,
  activations of one micro-batch are alive at a time, gradients sync once);
- activation checkpointing of the repeated blocks (none, selective, full), on all of them
  or on the first quarter, half or three quarters (``CHECKPOINT_FRACTIONS``);
- re-gathering parameters in backward instead of holding them (ZeRO-3): every parameter,
  or those of every repeated block but the last (``REGATHER_HELD``; only where that reaches
  past the checkpointed blocks, whose replay gathers again anyway);
- optimizer state and fp32 master weights in host memory (offload), decided per parameter
  (each placement of a trainable parameter has an offloaded twin strategy, as DeepSpeed's
  ZeRO-Offload++ offloads a share of the state), or, pinned, every trainable parameter's;
- ZeRO-1: the axes (every axis of more than one rank) where the ILP may
  shard a parameter's optimizer state, decided per parameter (each placement replicated
  there has a ZeRO-1 twin strategy: ``problem.graph.state_twins``). One family of scenarios
  with the axes holds every plan of the same scenario without them, so only the first
  scenario (today's default, solved with memory to spare) is also searched without ZeRO-1.
  Pinned (``zero={axis: 1}``), every trainable parameter replicated on the axis is ZeRO-1.
  ZeRO-1 and offload share that family: the runtime's optimizers do not combine them, so the
  ILP picks one of the two for a plan (a binary family variable) and, within it, the
  parameters; two families would each be solved wherever memory binds.

With memory to spare none of them pays off: each adds time to every plan (a replay, a
second gather, per-micro-batch fixed costs) and frees only memory. So the search first
solves today's scenario without the memory row; if that plan fits, it is the plan (one
solve, as before). Otherwise every candidate scenario is solved under the limit and the
fastest plan wins; the candidate set does not depend on the limit, so a tighter limit
never gives a faster plan. Pinned choices (``MemoryOptions``) fix their dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autopar.errors import InputError
from autopar.memory.options import CHECKPOINT_POLICIES, SEARCHED_POLICIES, MemoryOptions

MICRO_BATCH_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
"""Micro-batch counts the planner tries (those dividing the batch)."""
CHECKPOINT_FRACTIONS = (0.25, 0.5, 0.75)
"""Besides all repeated blocks, the shares of them (the first ones, rounded) the planner
tries checkpointing: memory between none and all at a fraction of the recompute."""
REGATHER_HELD = 1
"""Besides every parameter, the planner tries gathering again the parameters of all repeated
blocks but the last this many, which hold theirs (torchtitan's default for FSDP2: the last
block's gathers would be needed again at once). The runtime prefetches each gathering block's
regathers as the next block's backward starts, so this share waits only for what those
windows leave exposed, and saves against every parameter the regathers of the container's
last block (nothing prefetches those) for one block's parameters held; a larger held share
holds more for the same saving when the windows hide their traffic (the first half of the
blocks, the share tried before backward prefetch crossed held blocks, was never chosen over
it). One share: each more is a family of scenarios the memory search solves where memory binds.
``regather_blocks=`` pins any count."""


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One combination of the choices searched around the ILP."""

    micro_batches: int = 1
    checkpoint: str = "none"
    """Policy of the checkpointed repeated blocks."""
    checkpoint_blocks: int | None = None
    """How many repeated blocks (the first ones) checkpoint; None: all of them."""
    regather: bool = False
    """Parameters gathered for a forward use are gathered again in backward (ZeRO-3)."""
    regather_blocks: int | None = None
    """With ``regather``: whose parameters, those of the first this many repeated blocks;
    None: every parameter's."""
    offload: bool = False
    """Optimizer state and master weights of trainable parameters may live in host memory,
    the ILP choosing whose (``CostContext.offload``)."""
    offload_pinned: bool = False
    """Offload is pinned: every trainable parameter's state lives on the host."""
    zero1: tuple[str, ...] = ()
    """Mesh axes where parameters stored replicated may keep a shard of their optimizer state
    (ZeRO-1), the ILP choosing which (``CostContext.zero1``)."""
    zero1_pinned: bool = False
    """ZeRO stage 1 is pinned on ``zero1``: every trainable parameter replicated there is ZeRO-1."""

    def describe(self) -> str:
        parts = [f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}",
                 "no checkpointing" if self.checkpoint == "none" else f"{self.checkpoint} checkpointing"
                 + (f" of {self.checkpoint_blocks} blocks" if self.checkpoint_blocks is not None else "")]
        if self.regather:
            whose = "parameters" if self.regather_blocks is None else f"parameters of {self.regather_blocks} blocks"
            parts.append(f"{whose} gathered again in backward")
        if self.offload and self.zero1:
            parts.append(f"optimizer state on the host or ZeRO-1 on {', '.join(self.zero1)}, per parameter")
        elif self.offload:
            parts.append(f"optimizer state on the host{'' if self.offload_pinned else ' per parameter'}")
        elif self.zero1:
            parts.append(f"ZeRO-1 {'' if self.zero1_pinned else 'per parameter '}on {', '.join(self.zero1)}")
        return ", ".join(parts)

    def saves_at_least(self, other: Scenario) -> bool:
        """Whether this scenario gives up, for memory, at least what ``other`` does: the same
        micro-batches, ZeRO-1 and offload, each of ``other``'s checkpointed blocks checkpointed
        here with the same policy, each of its regathered parameters regathered here. Its leanest
        plan then needs no more memory in practice (each block checkpointed or regathered holds
        less), which ``search._may_fit`` uses to skip a least-memory solve, never to rule a
        scenario out."""
        def first(blocks: int | None) -> float:
            return math.inf if blocks is None else blocks
        rest = replace(self, checkpoint="none", checkpoint_blocks=None, regather=False, regather_blocks=None)
        if rest != replace(other, checkpoint="none", checkpoint_blocks=None, regather=False, regather_blocks=None):
            return False
        checkpoints = other.checkpoint == "none" or (
            other.checkpoint == self.checkpoint and first(other.checkpoint_blocks) <= first(self.checkpoint_blocks))
        regathers = not other.regather or (
            self.regather and first(other.regather_blocks) <= first(self.regather_blocks))
        return checkpoints and regathers


def candidates(options: MemoryOptions, batch: int | None, blocks: int, train: bool,
               axes: tuple[str, ...] = ()) -> list[Scenario]:
    """The scenarios to search, cheapest-looking first (the first is today's default).
    ``blocks``: how many repeated blocks the step has; ``axes``: the mesh axes of more than
    one rank (where ZeRO-1 may shard optimizer state)."""
    for name, k in (("checkpoint_blocks", options.checkpoint_blocks), ("regather_blocks", options.regather_blocks)):
        if k is not None and k > blocks:
            raise InputError(f"{name}={k} pins the first {k} repeated blocks, but the model has {blocks}"
                             + (f": pass at most {blocks}" if blocks else f": leave {name} out"))
    pinned_zero1 = _pinned_zero1(options)
    pinned = Scenario(micro_batches=options.micro_batches or 1, checkpoint=options.checkpoint or "none",
                      checkpoint_blocks=_first_blocks(options.checkpoint_blocks, blocks),
                      regather=_pinned_regather(options) or False,
                      regather_blocks=_first_blocks(options.regather_blocks, blocks),
                      offload=bool(options.offload), offload_pinned=bool(options.offload),
                      zero1=pinned_zero1 or (), zero1_pinned=bool(pinned_zero1))
    if not train:
        return [pinned]
    if options.micro_batches:
        counts = [options.micro_batches]
    else:
        counts = [m for m in MICRO_BATCH_CANDIDATES if batch is not None and m <= batch and batch % m == 0] or [1]
    families = _state_families(options, axes, pinned_zero1)
    found = [replace(family, micro_batches=m, checkpoint=c, checkpoint_blocks=k, regather=r, regather_blocks=rk)
             for family in families for m in counts for c, k in _checkpointing(options, blocks)
             for r, rk in _regathering(options, blocks, c, k)]
    if len(families) == 1:
        return found
    # the ILP chooses ZeRO-1 or offload per parameter: a scenario allowing them holds every plan of the same
    # one without, which stays only first (today's default, whose free solve is the plan with memory to spare)
    return [s for i, s in enumerate(found) if i == 0 or s.zero1 or s.offload]


def _state_families(options: MemoryOptions, axes: tuple[str, ...], pinned_zero1: tuple[str, ...] | None
                    ) -> list[Scenario]:
    """Where optimizer state may live, as scenarios: a pin of offload or of ZeRO-1 is the only
    family; else the plain one and one letting the ILP choose per parameter: ZeRO-1 on the axes
    or (one or the other in a plan: ``ilp``'s family row) offload, as far as they are allowed."""
    if options.offload:
        return [Scenario(offload=True, offload_pinned=True)]
    if pinned_zero1:
        return [Scenario(zero1=pinned_zero1, zero1_pinned=True)]
    zero1 = axes if pinned_zero1 is None and options.zero1_allowed else ()
    offload = options.offload is None
    return [Scenario()] + ([Scenario(zero1=zero1, offload=offload)] if zero1 or offload else [])


def _checkpointing(options: MemoryOptions, blocks: int) -> list[tuple[str, int | None]]:
    """(policy, blocks checkpointed or None for all) pairs to search, least recompute first."""
    if options.checkpoint is not None:
        return [(options.checkpoint, _first_blocks(options.checkpoint_blocks, blocks))]
    if options.checkpoint_blocks is not None:  # how many is pinned, not how
        return [(policy, _first_blocks(options.checkpoint_blocks, blocks)) for policy in SEARCHED_POLICIES[1:]]
    if not blocks:
        return [("none", None)]
    shares = sorted({k for f in CHECKPOINT_FRACTIONS if 0 < (k := round(f * blocks)) < blocks})
    return [("none", None)] + [(policy, k) for policy in SEARCHED_POLICIES[1:] for k in (*shares, None)]


def _regathering(options: MemoryOptions, blocks: int, checkpoint: str, checkpointed: int | None
                 ) -> list[tuple[bool, int | None]]:
    """(gather again, blocks or None for every parameter) pairs to search beside a
    checkpointing choice: none, the first blocks' (only counts beyond the checkpointed
    blocks: a replay gathers again anyway), every parameter's."""
    if options.zero is not None:
        pinned = bool(_pinned_regather(options))
        return [(pinned, _first_blocks(options.regather_blocks, blocks) if pinned else None)]
    done = 0 if checkpoint == "none" else blocks if checkpointed is None else checkpointed
    share = blocks - REGATHER_HELD
    return [(False, None)] + [(True, share)] * (done < share < blocks) + [(True, None)]


def _first_blocks(k: int | None, blocks: int) -> int | None:
    """A pinned count of the first blocks, None for all (a pin of all is all)."""
    return None if k is None or k >= blocks else k


def leanest(scenarios: list[Scenario]) -> list[Scenario]:
    """The scenarios that may keep the least memory: per micro-batch count, the one that saves
    the most otherwise (offloaded, full checkpointing, re-gathering, ZeRO-1). More micro-batches are
    not always leaner (their gradient-bucket buffers are held for the whole step), so each
    count is a candidate."""
    order = {p: i for i, p in enumerate(CHECKPOINT_POLICIES)}
    best: dict[int, Scenario] = {}
    for s in scenarios:
        if s.micro_batches not in best or _leanness(s, order) > _leanness(best[s.micro_batches], order):
            best[s.micro_batches] = s
    return [best[m] for m in sorted(best)]


def _leanness(s: Scenario, order: dict[str, int]) -> tuple[bool, int, bool, int, bool, bool, int, bool]:
    return (s.offload, order[s.checkpoint], s.checkpoint_blocks is None, s.checkpoint_blocks or 0, s.regather,
            s.regather_blocks is None, s.regather_blocks or 0, bool(s.zero1))


def _pinned_zero1(options: MemoryOptions) -> tuple[str, ...] | None:
    """The axes pinned to ZeRO stage 1 (None: ZeRO is not pinned)."""
    if options.zero is None:
        return None
    return tuple(axis for axis, stage in options.zero.items() if stage == 1)


def _pinned_regather(options: MemoryOptions) -> bool | None:
    if options.zero is None:
        return None
    return any(stage == 3 for stage in options.zero.values())


def zero1_note(scenario: Scenario, found_s: float, free_s: float, *, taken: bool = False) -> str:
    """What a plan says about a plan with ZeRO-1 on some parameters, found in ``scenario``,
    predicted faster than the plan with memory to spare: searched as a memory saving only (a
    tighter limit must never predict a faster step), it is taken only when nothing else fits."""
    head = f"a plan with ZeRO-1 ('{scenario.describe()}') is predicted faster ({found_s * 1e3:.3f} ms) than " \
           f"the plan with memory to spare ({free_s * 1e3:.3f} ms)"
    if taken:
        return f"{head}, which does not fit; nothing else fits"
    return f"{head}; it is searched only as a memory saving, so that a tighter limit never predicts a faster " \
           "step: pin zero={axis: 1} to run it"
