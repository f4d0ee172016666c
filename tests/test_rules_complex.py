"""Brute force of the complex-number rules (``autopar/rules/complex_numbers.py``) against the
unsharded op, forward and backward, as ``test_rules_conv`` does: every strategy a rule offers
that divides is simulated on meshes of 2, 4 and 2x2 ranks, and the local autograd of each rank,
placed as the runtime assumes, must reassemble into the full gradients. The rotary embedding's
own complex product goes through the generic pointwise rule: checked here on complex values.
"""

from __future__ import annotations

import pytest
import torch
from sharding_sim import OpCase
from test_rules_bruteforce import case, expanded_strategies, f64, failures, is_replicate_only, rule_strategies
from test_rules_conv import MESHES, gradient_failure

from autopar.rules.strategy import P, S

aten = torch.ops.aten
_GEN = torch.Generator().manual_seed(5)


def c128(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_GEN, dtype=torch.complex128)


def complex_cases() -> list[OpCase]:
    return [
        case(aten.view_as_complex.default, f64(4, 8, 4, 2), tag="rotary-pairs"),
        case(aten.view_as_real.default, c128(4, 8, 4), tag="rotary-pairs"),
        case(aten.real.default, c128(4, 8)),
        case(aten.imag.default, c128(4, 8)),
        case(aten.conj.default, c128(4, 8)),
        case(aten._conj.default, c128(4, 8)),
        case(aten.resolve_conj.default, c128(4, 8)),
        case(aten.complex.default, f64(4, 8), f64(4, 8)),
        case(aten.complex.default, f64(4, 8), f64(8), tag="broadcast"),
        case(aten.polar.default, torch.ones(8, 4, dtype=torch.float64), f64(8, 4), tag="rotary-angles"),
        case(aten.mul.Tensor, c128(4, 8, 4), c128(8, 4), tag="complex-rotation"),
    ]


CASES: list[OpCase] = complex_cases()
"""Read by ``test_rules_bruteforce``'s coverage checks: this family's cases live here."""


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("op_case", [pytest.param(c, id=c.label) for c in CASES])
def test_rule_matches_unsharded_op(op_case: OpCase, mesh_shape: tuple[int, ...]) -> None:
    strategies = expanded_strategies(op_case, mesh_shape)
    assert any(not is_replicate_only(s) for s in strategies), "the rule offers no sharded strategy that divides"
    problems = failures(op_case, strategies, mesh_shape)
    assert not problems, f"{op_case.label} on {mesh_shape}:\n" + "\n".join(problems)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("op_case", [pytest.param(c, id=c.label) for c in CASES])
def test_local_backward_matches_full_gradients(op_case: OpCase, mesh_shape: tuple[int, ...]) -> None:
    strategies = [s for s in expanded_strategies(op_case, mesh_shape) if not is_replicate_only(s)]
    problems = [f for f in (gradient_failure(op_case, s, mesh_shape) for s in strategies) if f is not None]
    assert not problems, f"{op_case.label} on {mesh_shape}:\n" + "\n".join(problems)


def test_the_pair_dim_is_never_split() -> None:
    """A rank holding half of each (real, imaginary) pair would hold no complex number."""
    for c in CASES[:2]:
        call, dims = rule_strategies(c)
        pair = call.args[0].ndim - 1 if c.op is aten.view_as_complex.default else call.outputs[0].ndim - 1
        assert all(S(pair) not in (*d.inputs, *d.outputs) for d in dims if c.op is aten.view_as_complex.default) \
            and all(S(pair) not in d.outputs for d in dims), c.label
        assert all(P not in (*d.inputs, *d.outputs) for d in dims), "no Partial complex tensors"
