"""Context parallelism in the attention rule: queries split on the sequence (L), keys and
values whole, brute-forced forward and backward.

``test_rules_bruteforce`` runs every attention case's strategies forward (the causal ones
on each rank's query rows, as ``runtime.attention`` runs them). Here backward too: each
rank's local autograd, placed as the runtime assumes (the gradients of the whole keys and
values Partial, summed by the reduce-scatter that is the backward of their all-gather),
must reassemble into the full gradients; and the simulator must reject what is wrong
(keys split with the queries; a causal call run as captured on its rows).
"""

from __future__ import annotations

import pytest
import torch
from sharding_sim import OpCase, check_strategy, strategy_str
from test_rules_bruteforce import attention_cases, bools, case, dropout_cases, f64, rule_strategies
from test_rules_conv import gradient_failure

import sharding_sim
from autopar.rules import DimStrategy, expand
from autopar.rules.strategy import R, S, Strategy, shard_dim

aten = torch.ops.aten


def _splits_queries(c: OpCase, s: Strategy) -> bool:
    q_rows = c.op_call().tensor_inputs[0].ndim - 2
    return any(shard_dim(p) == q_rows for p in s.inputs[0])


def _cp_strategies(c: OpCase, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    call, dims = rule_strategies(c)
    return [s for s in expand(call, dims, mesh_shape) if _splits_queries(c, s)]


def context_cases() -> list[OpCase]:
    """Every attention case (none draws dropout), and cross attention with a padding mask."""
    b, h, s, d = 2, 2, 8, 4
    padding = bools(b, 1, 1, 6)
    padding[..., 0] = True  # every query keeps a key
    return [*attention_cases(),
            case(aten.scaled_dot_product_attention.default, f64(b, h, s, d), f64(b, h, 6, d), f64(b, h, 6, d),
                 padding, tag="cross-padding")]


CASES = context_cases()
BACKWARD_CASES = [c for c in CASES if c.op is aten.scaled_dot_product_attention.default
                  and not any(isinstance(v, torch.Tensor) for v in c.kwargs.values())]
"""``gradient_failure`` differentiates every floating output and names tensors passed
positionally: the CPU flash kernel (its logsumexp has no gradient) and masks passed by
keyword run forward only (``test_rules_bruteforce``)."""


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("op_case", [pytest.param(c, id=c.label) for c in BACKWARD_CASES])
def test_query_split_backward_matches_full_gradients(op_case: OpCase, mesh_shape: tuple[int, ...]) -> None:
    strategies = _cp_strategies(op_case, mesh_shape)
    assert strategies, "no strategy splits the queries"
    problems = [f for f in (gradient_failure(op_case, s, mesh_shape) for s in strategies) if f is not None]
    assert not problems, f"{op_case.label} on {mesh_shape}:\n" + "\n".join(problems)


def _causal_case() -> OpCase:
    return next(c for c in CASES if c.label.endswith("-causal") and "gqa" not in c.label and "3d" not in c.label)


def test_keys_split_with_the_queries_is_wrong() -> None:
    """Each rank attending to its own chunk of keys only is not attention over the sequence."""
    c = _causal_case()
    (wrong,) = expand(c.op_call(), [DimStrategy((S(2),), (S(2), S(2), S(2)))], (2,))[-1:]
    assert check_strategy(c, wrong, (2,)) is not None


def test_causal_rows_run_as_captured_are_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """``is_causal=True`` on a rank's rows aligns them with the first keys: the rewrite is needed."""
    c = _causal_case()
    (strategy,) = _cp_strategies(c, (2,))
    assert strategy.inputs[1:] == ((R,), (R,)), strategy_str(strategy)
    assert check_strategy(c, strategy, (2,)) is None
    monkeypatch.setattr(sharding_sim, "splits_causal_rows", lambda *args: False)
    assert check_strategy(c, strategy, (2,)) is not None


def test_causal_attention_with_dropout_keeps_its_rows_whole() -> None:
    c = next(c for c in dropout_cases() if c.label.endswith("dropout-causal"))
    assert not _cp_strategies(c, (2,))
    non_causal = next(c for c in dropout_cases() if c.label.endswith("-dropout"))
    assert _cp_strategies(non_causal, (2,))
