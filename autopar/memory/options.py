"""Memory decisions of a plan: how parameters are stored on data axes (ZeRO stage), which
blocks recompute their activations in backward, whose optimizer state lives in host
memory, and how many micro-batches one step runs.

``MemoryOptions`` is what a user pins (None: the planner chooses); ``MemoryPlan`` is what
a plan decided, the part of ``Plan`` the runtime reads besides placements.

ZeRO stages on a data axis (Rajbhandari et al. 2020), as autopar runs them:
- 0 (DDP): the parameter is replicated on the axis; its gradient is all-reduced.
- 1: replicated as in 0, but its optimizer state is a 1/n shard (of its flattened local
  tensor, padded): at the optimizer step its gradient is reduce-scattered, each rank
  updates its chunk and the chunks are all-gathered into the whole parameter
  (``autopar.cost.zero1``; DeepSpeed's stage 1, Megatron's distributed optimizer). With
  micro-batches it synchronizes once per step, as DDP does. A parameter is ZeRO-1 on one
  axis: the first stage-1 axis it is replicated on. Unpinned, the planner decides per
  parameter (the ILP shards the optimizer state of those whose memory it needs).
- 2: the parameter is stored sharded on the axis (gradient and optimizer state follow
  the shard); it is all-gathered where used in forward and kept until backward (FSDP2's
  ``reshard_after_forward=False``); its gradient is reduce-scattered.
- 3: stored sharded as in 2, but the gathered copy is freed after its forward use and
  gathered again in backward (``reshard_after_forward=True``): the parameter is listed
  in ``MemoryPlan.regather``.
Offloading optimizer state to the host and ZeRO-1 are not combined (pinning both is refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.errors import InputError, InputTypeError

ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages a data axis can be pinned to (see the module docstring)."""
CHECKPOINT_POLICIES = ("none", "selective", "selective_op", "full")
"""Activation checkpointing per repeated block, from most kept to least: keep every saved
activation; keep matmul and attention outputs and recompute the rest (torch's selective
checkpointing); keep attention outputs and every other linear matmul's (torchtitan's "op"
policy, ``cost.recompute``); keep only the block's inputs and recompute the whole block."""
SEARCHED_POLICIES = ("none", "selective", "full")
"""The policies the planner chooses among where none is pinned ('selective_op' runs when pinned)."""

@dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """Memory choices a user pins (each None: the planner decides by the memory limit)."""

    zero: dict[str, int] | None = None
    """Data axis name -> ZeRO stage (0, 1, 2 or 3) for every trainable parameter on that axis."""
    checkpoint: str | None = None
    """Activation checkpointing policy for the repeated blocks: 'none', 'selective', 'selective_op'
    (torchtitan's op-level policy) or 'full' (``CHECKPOINT_POLICIES``)."""
    checkpoint_blocks: int | None = None
    """How many repeated blocks checkpoint, the first ones (Megatron's ``--recompute-method
    block --recompute-num-layers``); None: all of them when ``checkpoint`` is pinned, the
    planner's choice otherwise."""
    regather_blocks: int | None = None
    """With ZeRO-3 pinned: whose parameters are gathered again in backward, those of the first
    this many repeated blocks (FSDP2's ``reshard_after_forward`` per block; the others stay
    gathered from forward to backward); None: every parameter's."""
    offload: bool | None = None
    """True: every trainable parameter keeps its optimizer state (and fp32 master weights) in
    host memory, stepping there; False: none; None: the planner offloads the parameters the
    memory limit needs offloaded, if any (``Strategy.offload``), except where ZeRO-1 is pinned
    (a plan runs one of the two)."""
    micro_batches: int | None = None
    """Run the step's batch as this many micro-batches (gradient accumulation): activations
    scale with batch / micro_batches; gradients are synchronized once per step."""
    zero1_allowed: bool = True
    """False: no parameter's optimizer state is sharded on its own (ZeRO-1; a pipelined step's
    runtime does not run it), unless pinned."""

    def check(self, mesh_names: tuple[str, ...] | list[str]) -> None:
        """Refuse values the planner could only trip over later."""
        check_zero(self.zero)
        for axis, stage in (self.zero or {}).items():
            if axis not in mesh_names:
                raise InputError(f"zero= names axis {axis!r}, which is not an axis of the mesh {tuple(mesh_names)}")
            if isinstance(stage, bool) or stage not in ZERO_STAGES:
                raise InputError(f"zero={{{axis!r}: {stage!r}}}: a ZeRO stage is one of {ZERO_STAGES}")
        if self.offload and 1 in (self.zero or {}).values():
            raise InputError("offload=True with ZeRO-1 (zero stage 1): optimizer state either lives in host memory "
                             "or is sharded on a data axis, not both; pin one of them")
        if self.checkpoint is not None and self.checkpoint not in CHECKPOINT_POLICIES:
            raise InputError(f"checkpoint={self.checkpoint!r}: the policies are {', '.join(CHECKPOINT_POLICIES)}")
        k = self.checkpoint_blocks
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise InputError(f"checkpoint_blocks must be a positive whole number, got {k!r}")
        if k is not None and self.checkpoint == "none":
            raise InputError(f"checkpoint_blocks={k} with checkpoint='none': nothing would be checkpointed")
        r = self.regather_blocks
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise InputError(f"regather_blocks must be a positive whole number, got {r!r}")
        if r is not None and 3 not in (self.zero or {}).values():
            raise InputError(f"regather_blocks={r} needs ZeRO-3 pinned (zero={{axis: 3}}): only parameters stored "
                             "split are gathered again")
        if self.offload is not None and not isinstance(self.offload, bool):
            raise InputError(f"offload must be True, False or None, got {self.offload!r}")
        m = self.micro_batches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise InputError(f"micro_batches must be a positive whole number, got {m!r}")


def check_zero(zero: object) -> None:
    """``zero=`` is a dict of data axis -> stage (or None), before anything reads it."""
    if zero is not None and not isinstance(zero, dict):
        raise InputTypeError(f"zero must be a dict of data axis -> ZeRO stage, such as {{'dp': 3}}, got {zero!r}")


@dataclass(kw_only=True)
class MemoryPlan:
    """What a plan decided about memory (the runtime executes exactly this)."""

    micro_batches: int = 1
    """The step runs as this many micro-batches of the captured (micro-batch) size; gradients
    are accumulated and synchronized once, after the last."""
    checkpoint: str = "none"
    """Activation checkpointing policy of the blocks in ``checkpoint_blocks``."""
    checkpoint_blocks: list[str] = field(default_factory=list)
    """Module paths of the blocks that recompute activations in backward ('layers.0', ...):
    a node belongs to a block when its module path is the block's or starts with it + '.'."""
    regather: list[str] = field(default_factory=list)
    """Parameter FQNs gathered for each forward use and freed after it, gathered again for
    backward (ZeRO-3 / FSDP ``reshard_after_forward=True``); the others stay gathered from
    their forward use until backward."""
    offload: list[str] = field(default_factory=list)
    """Parameter FQNs whose optimizer state (and fp32 master weights) live in host memory;
    their update runs on the host (the ILP chooses whose: ``Strategy.offload``)."""
    zero: dict[str, int] = field(default_factory=dict)
    """Data axis -> ZeRO stage of its parameters (for display; where parameters differ, the
    highest stage any trainable parameter uses on the axis)."""
    zero1: dict[str, str] = field(default_factory=dict)
    """Parameter FQN -> the mesh axis its optimizer state is sharded on (ZeRO-1: gradient
    reduce-scattered, chunk updated, parameter all-gathered at the optimizer step)."""
    trainable_parameters: int = 0
    """Trainable parameters of a training step (what ``describe`` counts ``zero1`` and
    ``offload`` against)."""

    def describe(self) -> str:
        """One line for the plan's table."""
        parts = [f"{self.micro_batches} micro-batch{'es' if self.micro_batches != 1 else ''}"]
        if self.checkpoint != "none":
            parts.append(f"checkpointing {self.checkpoint} ({len(self.checkpoint_blocks)} blocks)")
        parts += [self._zero(axis, stage) for axis, stage in self.zero.items() if stage]
        if self.regather:
            parts.append(f"{len(self.regather)} parameters gathered again in backward")
        if self.offload:
            of = f" of {self.trainable_parameters}" if len(self.offload) < self.trainable_parameters else ""
            parts.append(f"optimizer state of {len(self.offload)}{of} parameters on the host")
        return ", ".join(parts)

    def _zero(self, axis: str, stage: int) -> str:
        """'ZeRO-1 on dp', or with the count where only some trainable parameters are ZeRO-1 there."""
        some = sum(1 for a in self.zero1.values() if a == axis)
        if stage == 1 and some < self.trainable_parameters:
            return f"ZeRO-1 on {axis} for {some} of {self.trainable_parameters} parameters"
        return f"ZeRO-{stage} on {axis}"
