"""Brute force of the mixture-of-experts routing rules (``autopar/rules/routing.py``) against the
unsharded op, forward and backward, as ``test_rules_conv`` does: every strategy a rule offers
that divides is simulated on meshes of 2, 4 and 2x2 ranks; the local autograd of each rank,
placed as the runtime assumes, must reassemble into the full gradients.
"""

from __future__ import annotations

import pytest
import torch
from sharding_sim import OpCase, check_strategy, strategy_str
from test_rules_bruteforce import (bools, case, expanded_strategies, f64, failures, ints, is_replicate_only,
                                   rule_strategies)
from test_rules_conv import MESHES, gradient_failure

from autopar.capture.moe import MOE_EXPERTS
from autopar.cost.compute import op_flops
from autopar.cost.moe import expert_dims
from autopar.rules import DimStrategy, expand
from autopar.rules.strategy import P, R, S, strided

aten = torch.ops.aten
_GEN = torch.Generator().manual_seed(11)


def _distinct_rows(n: int, size: int, picked: int, *rest: int) -> torch.Tensor:
    """(n, picked, *rest) positions < size along dim 1, distinct within each column: a scatter
    writing one position twice keeps whichever write lands last, so the op would be ill-defined."""
    order = torch.rand((n, size, *rest), generator=_GEN).argsort(dim=1)
    return order[:, :picked]


def _grouped_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8 token rows (in 16) in groups of 3 and 5, two experts' (16, 16) weights. 16 wide: the CPU
    kernel wants rows of 16-byte multiples, and a quarter of 16 fp32 columns is 16 bytes."""
    x = torch.randn(8, 16, generator=_GEN, dtype=dtype)
    w = torch.randn(2, 16, 16, generator=_GEN, dtype=dtype)
    return x, w, torch.tensor([3, 8], dtype=torch.int32)


def routing_cases() -> list[OpCase]:
    expert_ids = ints(4, 16).double()
    return [
        case(aten.topk.default, f64(4, 8, 4), 2, tag="last-dim"),
        case(aten.topk.default, f64(4, 8, 4), 3, 1, tag="dim1"),
        case(aten.sort.default, f64(4, 8), 1),
        case(aten.sort.stable, f64(4, 8, 4), stable=True, dim=1, descending=True),
        case(aten.argsort.default, f64(4, 8)),
        case(aten.argsort.stable, ints(4, 4, 16), stable=True, dim=-1, tag="ties"),  # the dropless dispatch's
        case(aten.gather.default, f64(4, 8, 4), 1, ints(8, 4, 6, 4)),
        case(aten.gather.default, f64(4, 8, 4), 1, ints(8, 4, 6, 1).expand(4, 6, 4), tag="expanded"),
        case(aten.gather.default, f64(4, 8), 1, ints(8, 2, 8), tag="fewer-rows"),  # dim 0 cannot split
        case(aten.scatter.src, f64(4, 8, 4), 1, _distinct_rows(4, 8, 6, 4), f64(4, 6, 4)),
        case(aten.scatter.value, f64(4, 8), 1, _distinct_rows(4, 8, 6), 1.5),
        case(aten.scatter_add.default, f64(4, 8, 4), 1, ints(8, 4, 12, 4), f64(4, 12, 4)),
        case(aten.index_add.default, f64(4, 8), 1, ints(8, 12), f64(4, 12)),
        case(aten.index_add.default, f64(8, 4), 0, ints(8, 12), f64(12, 4), alpha=0.5, tag="alpha"),
        case(aten.index_copy.default, f64(4, 2, 8, 4), 2, _distinct_rows(1, 8, 3).view(3), f64(4, 2, 3, 4),
             tag="kv-cache-write"),
        case(aten.index_copy_.default, f64(8, 4), 0, _distinct_rows(1, 8, 6).view(6), f64(6, 4)),
        case(aten.index_add_.default, f64(8, 4), 0, ints(8, 12), f64(12, 4), tag="hf4-experts-combine"),
        case(aten.one_hot.default, ints(4, 8, 2), 4, tag="hf4-expert-mask"),
        case(aten.one_hot.default, ints(4, 8), tag="classes-from-the-data", replicate_only=True),
        case(aten.where.default, bools(8, 2), tag="tokens-routed-to-an-expert", replicate_only=True),
        case(aten.nonzero.default, bools(8, 2), replicate_only=True),
        case(aten.slice_scatter.default, f64(4, 2, 8, 4), f64(4, 2, 3, 4), 2, 5, 8, tag="kv-cache-range"),
        case(aten.slice_scatter.default, f64(8, 6), f64(8, 3), 1, 0, 6, 2, tag="strided"),
        case(aten.index_put.default, f64(8, 4), [_distinct_rows(1, 8, 6).view(6)], f64(6, 4)),
        case(aten.index_put.default, f64(8, 4), [ints(8, 12)], f64(4), True, tag="accumulate-broadcast"),
        case(aten.index_put_.default, f64(4, 8, 4), [ints(4, 6), ints(8, 6)], f64(6, 4), True, tag="two-indices"),
        case(aten.index_put.default, ints(9, 8), [_distinct_rows(1, 8, 8).view(8)], torch.arange(8),
             tag="hf-inverse-permutation", replicate_only=True),
        case(aten.repeat_interleave.self_int, f64(4, 8), 2, 0, tag="hf-token-per-choice"),
        case(aten.repeat_interleave.self_int, f64(4, 8, 4), 3, 1),
        case(aten.histc.default, expert_ids.view(4, 4), 4, 0, 3, tag="hf-tokens-per-expert"),
        case(aten.histc.default, f64(4, 4), 4, tag="bins-over-the-data-range", unhandled=True),
        case(aten._grouped_mm.default, *_grouped_inputs(torch.float32)),
    ]


CASES: list[OpCase] = routing_cases()
"""Read by ``test_rules_bruteforce``'s coverage checks: this family's cases live here."""
NO_BACKWARD = {aten.histc.default: "counts have no gradient", aten.one_hot.default: "integer output",
               aten.where.default: "positions have no gradient", aten.nonzero.default: "positions have no gradient",
               aten.argsort.default: "indices have no gradient",
               aten.argsort.stable: "indices have no gradient",
               aten._grouped_mm.default: "fp32 only on CPU: its backward is checked in fp64 through HF's op below"}
BACKWARD_CASES = [c for c in CASES if c.op not in NO_BACKWARD and not getattr(c, "replicate_only", False)]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("op_case", [pytest.param(c, id=c.label) for c in CASES])
def test_rule_matches_unsharded_op(op_case: OpCase, mesh_shape: tuple[int, ...]) -> None:
    strategies = expanded_strategies(op_case, mesh_shape)
    sharded = [s for s in strategies if not is_replicate_only(s)]
    assert bool(sharded) != getattr(op_case, "replicate_only", False), [strategy_str(s) for s in sharded]
    problems = failures(op_case, strategies, mesh_shape)
    assert not problems, f"{op_case.label} on {mesh_shape}:\n" + "\n".join(problems)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("op_case", [pytest.param(c, id=c.label) for c in BACKWARD_CASES])
def test_local_backward_matches_full_gradients(op_case: OpCase, mesh_shape: tuple[int, ...]) -> None:
    strategies = [s for s in expanded_strategies(op_case, mesh_shape) if not is_replicate_only(s)]
    problems = [f for f in (gradient_failure(op_case, s, mesh_shape) for s in strategies) if f is not None]
    assert not problems, f"{op_case.label} on {mesh_shape}:\n" + "\n".join(problems)


def test_gather_with_fewer_index_rows_keeps_that_dim_whole() -> None:
    """An index shorter than its source along a dim would give ranks rows of different lengths."""
    c = next(c for c in CASES if c.label.endswith("fewer-rows"))
    _, dims = rule_strategies(c)
    assert DimStrategy((S(0),), (S(0), S(0))) not in dims


def test_hf_grouped_mm_is_ruled_by_name() -> None:
    """Transformers' opaque grouped matmul gets the grouped-matmul rule and FLOPs once it exists."""
    pytest.importorskip("transformers.integrations.moe")
    op = torch.ops.transformers.grouped_mm_fallback.default
    c = case(op, *_grouped_inputs(torch.float64))
    _, dims = rule_strategies(c)
    assert DimStrategy((S(1),), (R, S(2), R)) in dims and DimStrategy((P,), (S(1), S(1), R)) in dims
    for mesh_shape in ((2,), (2, 2)):
        strategies = expanded_strategies(c, mesh_shape)
        problems = failures(c, strategies, mesh_shape)
        problems += [f for f in (gradient_failure(c, s, mesh_shape) for s in strategies if not is_replicate_only(s))
                     if f is not None]
        assert not problems, "\n".join(problems)
    assert op_flops(c.op_call()) == 2.0 * 8 * 16 * 16  # 8 rows x 16 out x 16 in


def test_wrong_grouped_mm_split_is_detected() -> None:
    """Splitting the token rows is wrong (the offsets count global rows): the simulator says so."""
    c = case(aten._grouped_mm.default, *_grouped_inputs(torch.float32))
    wrong = expand(c.op_call(), [DimStrategy((S(0),), (S(0), R, R))], (2,))[-1]
    assert check_strategy(c, wrong, (2,)) is not None


def _moe_case() -> OpCase:
    """A whole dropless expert layer (``autopar::moe_experts``): 8 tokens of 16, top-2 of 4 experts of
    F = 8 (gate and up stacked: 16), fp64, with HF's grouped matmul (its loop runs any dtype)."""
    pytest.importorskip("transformers.integrations.moe")
    ids = torch.rand(8, 4, generator=_GEN).argsort(dim=1)[:, :2]  # distinct experts per token, as top-k
    weights = torch.rand(8, 2, generator=_GEN, dtype=torch.float64)
    return case(MOE_EXPERTS, f64(8, 16), ids, weights, f64(4, 16, 16), f64(4, 16, 8),
                "transformers::grouped_mm_fallback")


def test_moe_experts_rule_local_strategies_match_the_whole_layer() -> None:
    """The strategies a rank runs on its own (tokens split with every expert, ``F`` split inside the
    experts: gate_up strided, down on ``F``, Partial) match the whole layer forward and backward on
    2, 4 and 2x2 ranks; the expert-parallel one (experts split with the tokens) is not local: a rank
    holds other ranks' experts' pairs, so the simulator, which runs no all-to-all, says it is wrong
    (``runtime.moe`` runs it; ``test_numerics_moe`` checks it), and it is exclusive (one mesh dim)."""
    c = _moe_case()
    _, dims = rule_strategies(c)
    assert DimStrategy((S(0),), (S(0),) * 5, exclusive=True) in dims
    assert DimStrategy((P,), (R, R, R, strided(1, 2), S(2))) in dims
    for mesh_shape in MESHES:
        strategies = expanded_strategies(c, mesh_shape)
        local = [s for s in strategies if not expert_dims(s, mesh_shape)]
        problems = failures(c, local, mesh_shape)
        problems += [f for f in (gradient_failure(c, s, mesh_shape) for s in local if not is_replicate_only(s))
                     if f is not None]
        assert not problems, f"{mesh_shape}:\n" + "\n".join(problems)
        expert_parallel = [s for s in strategies if expert_dims(s, mesh_shape)]
        assert expert_parallel and all(len(expert_dims(s, mesh_shape)) == 1 for s in expert_parallel)
        assert check_strategy(c, expert_parallel[0], mesh_shape) is not None
    pairs, hidden, ffn = 16, 16, 8
    assert op_flops(c.op_call()) == 2.0 * pairs * hidden * 2 * ffn + 2.0 * pairs * ffn * hidden + 3.0 * pairs * ffn
