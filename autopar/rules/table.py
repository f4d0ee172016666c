"""Rule tables: each op family file fills one table; ``rules/__init__`` merges them explicitly."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from autopar.rules.strategy import DimStrategy, OpCall


@dataclass(frozen=True)
class Unhandled:
    """A rule's answer for a call it does not handle (a shape or argument form it has no
    strategies for): the call runs replicated and the plan lists it as a fallback, with
    ``reason``. An empty strategy list means something else: replication is the complete
    answer (a factory has nothing to split)."""

    reason: str
    """Why, for the person reading the plan ('vector operand', 'ellipsis in the equation')."""


NO_RULE = "no sharding rule for this op"

Rule = Callable[[OpCall], list[DimStrategy] | Unhandled]
"""Single-mesh-dimension strategies of one op call (the all-Replicate one is added for free),
or ``Unhandled`` for a call the rule does not cover."""


class RuleTable:
    """Rules of one op family, keyed by aten overload (or another FX call target), or by the
    qualified name of a library's custom op (``"transformers::grouped_mm_fallback"``), which
    exists only once that library is imported and so cannot be looked up when autopar is."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.rules: dict[Any, Rule] = {}

    def register(self, *targets: Any) -> Callable[[Rule], Rule]:
        def decorate(rule: Rule) -> Rule:
            for t in targets:
                if t in self.rules:
                    raise ValueError(f"{self.family}: two rules for {t}")
                self.rules[t] = rule
            return rule
        return decorate

    def add(self, targets: Iterable[Any], rule: Rule) -> None:
        self.register(*targets)(rule)


class RuleSet:
    """Several tables looked up as one; a target in two tables is a mistake."""

    def __init__(self, tables: Iterable[RuleTable]) -> None:
        self.tables = list(tables)
        self.rules: dict[Any, Rule] = {}
        self.family: dict[Any, str] = {}
        for table in self.tables:
            for target, rule in table.rules.items():
                if target in self.rules:
                    raise ValueError(f"{target} has rules in {self.family[target]} and {table.family}")
                self.rules[target] = rule
                self.family[target] = table.family

    def lookup(self, target: Any) -> Rule | None:
        rule = self.rules.get(target)
        if rule is None and isinstance(target, torch._ops.OpOverload) and target.namespace != "aten":
            rule = self.rules.get(target.name())  # a custom op, registered by name
        return rule

    def family_of(self, target: Any) -> str | None:
        """The family whose rule ``lookup`` finds for ``target``."""
        if target in self.family:
            return self.family[target]
        return self.family.get(target.name()) if isinstance(target, torch._ops.OpOverload) else None

    def strategies(self, call: OpCall) -> tuple[list[DimStrategy], str | None]:
        """The call's single-dim strategies, and why it falls back to replication (None when
        a rule handled it): no rule for the op, or its rule said ``Unhandled``."""
        rule = self.lookup(call.target)
        if rule is None:
            return [], NO_RULE
        result = rule(call)
        if isinstance(result, Unhandled):
            return [], result.reason
        return result, None
