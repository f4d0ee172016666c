"""Stage 2: sharding strategies per aten op, one file per op family.

Each family module fills its own ``TABLE``; this module lists them, so which rules
exist is visible here and nothing registers itself on import elsewhere.
"""

from __future__ import annotations

from autopar.rules import (attention, batch_norm, complex_numbers, conv, dropout, embedding, factory, indexing, loss,
                           matmul, norm, pointwise, pool, reduction, routing, softmax, view)
from autopar.rules.strategy import DimStrategy, OpCall, Strategy, expand, placement_str
from autopar.rules.table import NO_RULE, Rule, RuleSet, RuleTable, Unhandled

FAMILIES: tuple[RuleTable, ...] = (
    matmul.TABLE, pointwise.TABLE, reduction.TABLE, softmax.TABLE, norm.TABLE, embedding.TABLE,
    view.TABLE, indexing.TABLE, attention.TABLE, loss.TABLE, dropout.TABLE, factory.TABLE, conv.TABLE,
    batch_norm.TABLE, pool.TABLE, routing.TABLE, complex_numbers.TABLE,
)

DEFAULT_RULES = RuleSet(FAMILIES)
"""Every rule autopar ships, looked up by aten overload."""

__all__ = ["DEFAULT_RULES", "FAMILIES", "NO_RULE", "DimStrategy", "OpCall", "Strategy", "Rule", "RuleSet",
           "RuleTable", "Unhandled", "expand", "placement_str"]
