"""Which edges share a reshard: every consumer of one tensor that needs the same placement
(and sends back the same gradient placement) uses one ``reshard``, so its collectives are
paid once per tensor, not once per consumer. A tensor written in place between two reads
is two versions (``PlanNode.read_versions``): their reads share nothing.

With repeated blocks folded, sharing is counted on the real graph: real tensors whose
consumers map to the same set of representative edges form a class, and the class pays
each distinct reshard once per member.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from autopar.problem.folding import Folding
from autopar.problem.nodes import PlanGraph

EdgeKey = tuple[str, int, str, int]
"""(representative producer, output index, representative consumer, consumer arg)."""


def sharing_classes(graph: PlanGraph, folding: Folding) -> Counter[tuple[EdgeKey, ...]]:
    """Sorted representative-edge sets of real tensors -> how many real tensors have that set."""
    rep = folding.representative
    uses: dict[tuple[str, int, int], set[EdgeKey]] = defaultdict(set)
    for name in graph.order:
        node = graph.nodes[name]
        for arg, (src, idx) in enumerate(node.args):
            uses[(src, idx, node.version(arg))].add((rep[src], idx, rep[name], arg))
    return Counter(tuple(sorted(keys)) for keys in uses.values())
