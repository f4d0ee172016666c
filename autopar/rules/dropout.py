"""Random ops: dropout in every form export records, and samplers (rand/randn(_like),
bernoulli, uniform_/normal_, ...).

Their placements mean what any op's do, because the runtime keeps one random stream for
the whole mesh (``autopar.runtime.random``): each element's value is a function of the
seed, the draw and its global index (or, with ``random_stream='torch'``, every rank draws
the global tensor and keeps its slice), so a replicated output is the same mask on every
rank and a sharded one is disjoint slices of one global mask, the mask one device would
draw from that stream. ``drawn_numel`` counts the global elements a call draws;
``cost.draws`` prices a rank's share of them.

Dropout and the samplers are elementwise in their tensor arguments (any dim splits).
Feature dropout draws one value per (batch, channel): only those two dims split.
Factories (``rand(size)``) are built replicated. Attention dropout lives in
``attention.py``; ``draws_random`` names it too. Samplers whose consumption of the
stream depends on the values (gamma, poisson) have no rule: they run replicated.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from autopar.rules.pointwise import broadcast_strategies
from autopar.rules.strategy import DimStrategy, OpCall, S, schema_arg
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("dropout")

DROPOUTS = frozenset({
    aten.dropout.default, aten.dropout_.default, aten.native_dropout.default,
    aten.alpha_dropout.default, aten.alpha_dropout_.default,
})
FEATURE_DROPOUTS = frozenset({
    aten.feature_dropout.default, aten.feature_dropout_.default,
    aten.feature_alpha_dropout.default, aten.feature_alpha_dropout_.default,
})
ELEMENTWISE_SAMPLERS = frozenset({
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
    aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli.Tensor, aten.bernoulli_.float, aten.bernoulli_.Tensor,
    aten.uniform.default, aten.uniform_.default, aten.normal_.default, aten.normal.Tensor_float,
    aten.normal.float_Tensor, aten.normal.Tensor_Tensor, aten.exponential.default, aten.exponential_.default,
    aten.cauchy.default, aten.cauchy_.default, aten.log_normal.default, aten.log_normal_.default,
    aten.geometric.default, aten.geometric_.default,
})
"""Samplers whose i-th output element is drawn for the i-th element of their (broadcast)
tensor arguments, consuming the stream independently of the values."""
RANDOM_FACTORIES = frozenset({
    aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low, aten.normal.float_float,
    aten.randperm.default,
})
ATTENTION_DROPOUT = {aten.scaled_dot_product_attention.default: "dropout_p"}
"""Attention ops that drop attention probabilities, with the schema name of their probability
(the CPU flash kernel refuses dropout; fused CUDA kernels draw inside, see ``draws_random``)."""


@TABLE.register(*DROPOUTS, *ELEMENTWISE_SAMPLERS)
def elementwise_random_rule(call: OpCall) -> list[DimStrategy]:
    return broadcast_strategies(call)


@TABLE.register(*FEATURE_DROPOUTS)
def feature_dropout_rule(call: OpCall) -> list[DimStrategy]:
    """One draw per (batch, channel) broadcast over the rest: split batch or channels."""
    x = call.args[0]
    return [DimStrategy((S(d),), (S(d),)) for d in range(min(2, x.ndim))]


@TABLE.register(*RANDOM_FACTORIES)
def random_factory_rule(call: OpCall) -> list[DimStrategy]:
    return []  # the all-Replicate strategy is always added


def draws_random(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when this call draws from the random stream (dropout with p > 0 in training,
    attention with dropout_p > 0, any sampler)."""
    if target in DROPOUTS or target in FEATURE_DROPOUTS:
        train = schema_arg(target, args, kwargs, "train", True)
        return _positive(schema_arg(target, args, kwargs, "p", 0.0)) and train is not False
    if target in ATTENTION_DROPOUT:
        return _positive(schema_arg(target, args, kwargs, ATTENTION_DROPOUT[target], 0.0))
    if target in ELEMENTWISE_SAMPLERS or target in RANDOM_FACTORIES:
        return True
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    # Other seeded kernels (fused attention, RNNs) draw only for their dropout.
    names = {a.name for a in target._schema.arguments}
    for name in ("dropout_p", "dropout"):
        if name in names:
            return _positive(schema_arg(target, args, kwargs, name, 0.0))
    return True


def _positive(p: Any) -> bool:
    """A probability that may draw: positive, or not a plain number (symbolic)."""
    return not isinstance(p, (int, float)) or p > 0


def drawn_numel(call: OpCall) -> int:
    """Elements of the global tensor this call draws (0 if it draws nothing)."""
    if not draws_random(call.target, call.args, call.kwargs):
        return 0
    if call.target in FEATURE_DROPOUTS:
        x = call.args[0]
        return math.prod(x.shape[:2])
    if call.target in ATTENTION_DROPOUT:
        q, k = call.args[0], call.args[1]
        return math.prod(q.shape[:-1]) * k.shape[-2]  # one draw per attention probability
    return sum(o.numel for o in call.outputs[:1] if o is not None)
