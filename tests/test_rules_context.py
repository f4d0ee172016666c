"""Context parallelism in the attention rule, brute-forced forward and backward: queries split
on the sequence (L) with keys and values whole, and ring attention (keys and values split too,
run by ``runtime.ring`` on threads, ``ring_threads``).

``test_rules_bruteforce`` runs every attention case's strategies forward (the causal ones
on each rank's query rows, as ``runtime.attention`` runs them). Here backward too: each
rank's local autograd, placed as the runtime assumes (the gradients of the whole keys and
values Partial, summed by the reduce-scatter that is the backward of their all-gather),
must reassemble into the full gradients; and the simulator must reject what is wrong
(keys split with the queries run as captured; a causal call run as captured on its rows).
"""

from __future__ import annotations

import pytest
import torch
from sharding_sim import OpCase, check_strategy
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


def test_keys_split_with_the_queries_is_ring_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys split with the queries is ring attention (the rule offers it, on one mesh dim), right
    run as the ring (``runtime.ring``); each rank attending to its own chunk of keys only, as
    captured, is not attention over the sequence."""
    c = _causal_case()
    ring = DimStrategy((S(2),), (S(2), S(2), S(2)), exclusive=True)
    assert ring in rule_strategies(c)[1]
    (strategy,) = expand(c.op_call(), [ring], (2,))[-1:]
    assert check_strategy(c, strategy, (2,)) is None
    monkeypatch.setattr(sharding_sim, "_ring_of", lambda *args: None)
    assert check_strategy(c, strategy, (2,)) is not None


def test_ring_attention_runs_on_one_mesh_dim() -> None:
    """Two rings at once (keys split on the sequence on both mesh dims) are never offered: the
    ring runs on one process group."""
    c = _causal_case()
    strategies = _cp_strategies(c, (2, 2))
    rings = [s for s in strategies if sum(shard_dim(p) == 2 for p in s.inputs[1]) > 0]
    assert rings and all(sum(shard_dim(p) == 2 for p in s.inputs[1]) == 1 for s in rings)


def test_float_bias_and_dropout_calls_have_no_ring() -> None:
    """A float mask may want a gradient the kernel's backward does not give; dropout would be
    drawn per block: neither is offered the ring."""
    for c in [*CASES, *dropout_cases()]:
        call = c.op_call()
        mask = call.get("attn_mask")
        if (isinstance(mask, torch.Tensor) or getattr(mask, "dtype", torch.bool) != torch.bool
                or float(call.get("dropout_p", 0.0) or 0.0) > 0):
            assert not any(shard_dim(s.inputs[1][0]) == call.tensor_inputs[1].ndim - 2
                           for s in _cp_strategies(c, (2,))), c.label


def test_causal_rows_run_as_captured_are_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """``is_causal=True`` on a rank's rows aligns them with the first keys: the rewrite is needed."""
    c = _causal_case()
    (strategy,) = [s for s in _cp_strategies(c, (2,)) if s.inputs[1:] == ((R,), (R,))]
    assert check_strategy(c, strategy, (2,)) is None
    monkeypatch.setattr(sharding_sim, "splits_causal_rows", lambda *args: False)
    assert check_strategy(c, strategy, (2,)) is not None


def test_causal_attention_with_dropout_keeps_its_rows_whole() -> None:
    c = next(c for c in dropout_cases() if c.label.endswith("dropout-causal"))
    assert not _cp_strategies(c, (2,))
    non_causal = next(c for c in dropout_cases() if c.label.endswith("-dropout"))
    assert _cp_strategies(non_causal, (2,))
