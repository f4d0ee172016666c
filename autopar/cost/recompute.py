"""What activation checkpointing keeps and recomputes, shared by pricing and the runtime.

Under the "selective" policy a checkpointed block keeps the outputs of its matmuls and
attention (the expensive ops; torchtitan's "op" selective checkpointing keeps mm and SDPA
outputs) and recomputes everything else in backward. Under "full" it keeps nothing inside
the block but what leaves it. Either way recomputation replays the whole block's forward,
so every forward collective in it runs again (phase "recompute").
"""

from __future__ import annotations

SELECTIVE_KEEPS_FAMILIES = frozenset({"matmul", "attention"})
"""Rule families (``autopar.rules``) whose outputs the selective policy keeps."""


def kept_by_policy(policy: str, family: str | None) -> bool:
    """True when ``policy`` keeps the outputs of an op of ``family`` inside a checkpointed block."""
    return policy == "selective" and family in SELECTIVE_KEEPS_FAMILIES
