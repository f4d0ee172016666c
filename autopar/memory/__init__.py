"""Memory decisions and what they do to the planning problem: the options a user pins and the plan's
choices (``options``), the scenarios searched around the ILP (``memory.scenarios``), activation checkpointing
(``recompute``), gathering again in backward (``regather``), ZeRO-1's buckets (``zero1``) and backward's largest
working set in the peak (``backward``)."""
