"""Brute force of the convolution, batch norm and pooling rules against the unsharded op.

As ``test_rules_bruteforce``: every strategy a rule offers (plus all-Replicate) that
divides evenly is simulated on meshes of 2, 4 and 2x2 ranks, outputs and inputs after
the op (batch norm writes its running statistics in place) compared with the full op.
Backward is autograd on each rank's local op; it is checked too: the gradients each
rank computes, placed as the runtime assumes, must reassemble into the full gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from sharding_sim import (OpCase, ReplicaMismatch, check_strategy, flatten_outputs, simulate_gradients,
                          simulate_with_inputs, strategy_str)
from test_rules_bruteforce import case, expanded_strategies, f64, failures, is_replicate_only, positive

from autopar.cost.compute import op_flops
from autopar.rules import DimStrategy, expand
from autopar.capture.aliasing import written_arg_names
from autopar.rules.strategy import P, R, S, Strategy

aten = torch.ops.aten
_GEN = torch.Generator().manual_seed(7)


def conv_cases() -> list[OpCase]:
    c1, c2, c3 = aten.conv1d.default, aten.conv2d.default, aten.conv3d.default
    t1, t2, t3 = aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input
    conv = aten.convolution.default
    return [
        case(c2, f64(4, 4, 6, 6), f64(8, 4, 3, 3), f64(8), tag="bias"),
        case(c2, f64(4, 4, 7, 7), f64(8, 4, 3, 3), None, [2, 2], [1, 1], [2, 2], tag="nobias-stride-pad-dilation"),
        case(c2, f64(4, 3, 8, 8), f64(8, 3, 4, 4), f64(8), [4, 4], tag="patch-embed"),  # ViT: stride = kernel
        # 2 groups: on 4 ranks the channels divide but the groups do not (offered on 2 only)
        case(c2, f64(4, 8, 6, 6), f64(8, 4, 3, 3), f64(8), [1, 1], [1, 1], [1, 1], 2, tag="groups2"),
        case(c2, f64(4, 8, 6, 6), f64(8, 1, 3, 3), None, [1, 1], [1, 1], [1, 1], 8, tag="depthwise"),
        case(c2, f64(4, 4, 6, 6), f64(8, 1, 3, 3), f64(8), [2, 1], [0, 1], [1, 1], 4, tag="groups4-multiplier2"),
        case(aten.conv2d.padding, f64(4, 4, 6, 6), f64(8, 4, 3, 3), f64(8), [1, 1], "same", tag="same"),
        case(c2, f64(4, 6, 6), f64(8, 4, 3, 3), f64(8), tag="unbatched"),
        case(c1, f64(4, 4, 10), f64(8, 4, 3), f64(8), [2], [1], [1], tag="stride-pad"),
        case(c1, f64(4, 8, 10), f64(8, 2, 3), None, [1], [0], [2], 4, tag="groups4-dilation"),
        case(aten.conv1d.padding, f64(4, 4, 10), f64(8, 4, 3), None, [1], "valid", tag="valid"),
        case(c3, f64(4, 4, 4, 4, 4), f64(8, 4, 2, 2, 2), f64(8), tag="3d"),
        case(aten.conv3d.padding, f64(4, 4, 3, 3, 3), f64(4, 2, 2, 2, 2), None, [1, 1, 1], "same", [1, 1, 1], 2,
             tag="same-groups2"),
        case(t2, f64(4, 4, 5, 5), f64(4, 8, 3, 3), f64(8), [2, 2], [1, 1], [1, 1], tag="stride-outpad"),
        case(t2, f64(4, 8, 5, 5), f64(8, 2, 3, 3), None, [1, 1], [0, 0], [0, 0], 4, tag="groups4"),
        case(t1, f64(4, 4, 6), f64(4, 8, 2), f64(8), [2], tag="stride"),
        case(t3, f64(4, 4, 3, 3, 3), f64(4, 4, 2, 2, 2), tag="3d"),
        case(conv, f64(4, 4, 6, 6), f64(8, 4, 3, 3), f64(8), [1, 1], [1, 1], [1, 1], False, [0, 0], 1, tag="plain"),
        case(conv, f64(4, 8, 5, 5), f64(8, 2, 3, 3), f64(8), [2, 2], [1, 1], [1, 1], True, [1, 1], 4,
             tag="transposed-groups4"),
    ]


def batch_norm_cases() -> list[OpCase]:
    bn = aten.batch_norm.default
    return [
        case(bn, f64(4, 8, 3, 3), f64(8), f64(8), f64(8), positive(8), True, 0.1, 1e-5, False, tag="train-2d"),
        case(bn, f64(4, 8, 5), None, None, f64(8), positive(8), True, 0.3, 1e-5, False, tag="train-1d-noaffine"),
        case(bn, f64(8, 4), f64(4), f64(4), None, None, True, 0.1, 1e-5, False, tag="train-nc-nostats"),
        case(bn, f64(4, 8, 3, 3), f64(8), f64(8), f64(8), positive(8), False, 0.1, 1e-5, False, tag="eval-2d"),
        case(bn, f64(4, 8, 4), None, None, f64(8), positive(8), False, 0.1, 1e-5, False, tag="eval-1d-noaffine"),
    ]


def pool_cases() -> list[OpCase]:
    mp2, mpi2, ap2 = aten.max_pool2d.default, aten.max_pool2d_with_indices.default, aten.avg_pool2d.default
    return [
        case(mp2, f64(4, 4, 6, 6), [2, 2]),
        case(mp2, f64(4, 4, 7, 7), [3, 3], [2, 2], [1, 1], [1, 1], True, tag="stride-pad-ceil"),
        case(mp2, f64(4, 7, 7), [3, 3], [2, 2], [0, 0], [2, 2], tag="unbatched-dilation"),
        case(mpi2, f64(4, 4, 6, 6), [2, 2], [2, 2]),
        case(mpi2, f64(4, 4, 7, 7), [3, 3], [2, 2], [1, 1], [1, 1], True, tag="ceil"),
        case(aten.max_pool1d.default, f64(4, 4, 9), [3], [2], tag="stride"),
        case(aten.max_pool1d_with_indices.default, f64(4, 4, 9), [3], [2], [1], [1], True, tag="ceil"),
        case(aten.max_pool3d.default, f64(4, 4, 4, 4, 4), [2, 2, 2]),
        case(aten.max_pool3d_with_indices.default, f64(4, 4, 4, 4, 4), [2, 2, 2]),
        case(ap2, f64(4, 4, 6, 6), [2, 2]),
        case(ap2, f64(4, 4, 7, 7), [3, 3], [2, 2], [1, 1], True, False, tag="ceil-exclude-pad"),
        case(ap2, f64(4, 4, 6, 6), [3, 3], [1, 1], [1, 1], False, True, 5, tag="divisor"),
        case(aten.avg_pool1d.default, f64(4, 4, 9), [3], [2], [1], True, tag="ceil"),
        case(aten.avg_pool3d.default, f64(4, 4, 4, 4, 4), [2, 2, 2]),
        case(aten.adaptive_avg_pool2d.default, f64(4, 4, 6, 6), [1, 1]),
        case(aten.adaptive_avg_pool2d.default, f64(4, 4, 7, 5), [3, 2], tag="uneven"),
        case(aten._adaptive_avg_pool2d.default, f64(4, 4, 6, 6), [2, 3]),
        case(aten.adaptive_avg_pool1d.default, f64(4, 4, 9), [4]),
        case(aten.adaptive_avg_pool3d.default, f64(4, 4, 4, 4, 4), [2, 1, 2]),
        case(aten.adaptive_max_pool1d.default, f64(4, 4, 9), [4]),
        case(aten.adaptive_max_pool2d.default, f64(4, 4, 7, 5), [3, 2]),
        case(aten.adaptive_max_pool3d.default, f64(4, 4, 4, 4, 4), [2, 2, 2]),
    ]


CASES: list[OpCase] = [*conv_cases(), *batch_norm_cases(), *pool_cases()]
"""Read by ``test_rules_bruteforce``'s coverage checks: these families' cases live here."""

MESHES = [(2,), (4,), (2, 2)]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("op_case", [pytest.param(c, id=c.label) for c in CASES])
def test_rule_matches_unsharded_op(op_case: OpCase, mesh_shape: tuple[int, ...]) -> None:
    strategies = expanded_strategies(op_case, mesh_shape)
    sharded = [s for s in strategies if not is_replicate_only(s)]
    assert sharded, "the rule offers no sharded strategy that divides"
    if len(mesh_shape) == 2:  # some strategy must split on both mesh dims, or nothing 2-D is checked
        assert any(all(any(not p[m].is_replicate() for p in (*s.inputs, *(o for o in s.outputs if o)))
                       for m in (0, 1)) for s in strategies)
    problems = failures(op_case, strategies, mesh_shape)
    assert not problems, f"{op_case.label} on {mesh_shape}:\n" + "\n".join(problems)


NOT_DIFFERENTIABLE = {"running_mean", "running_var"}
"""batch_norm's running statistics: written in training, only read in eval, never differentiated."""


def gradient_failure(c: OpCase, strategy: Strategy, mesh_shape: tuple[int, ...]) -> str | None:
    """None when local autograd, placed as the runtime assumes, gives the full gradients."""
    call = c.op_call()
    inputs = c.tensor_inputs()
    names = [a.name for a, v in zip(c.op._schema.arguments, c.args)  # a tensor list (index_put's) names each
             for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]
    written = written_arg_names(c.op, c.args, c.kwargs)
    wanted = [i for i, t in enumerate(inputs) if (t.is_floating_point() or t.is_complex()) and names[i] not in written
              and names[i] not in NOT_DIFFERENTIABLE]
    full = [t.clone().requires_grad_(i in wanted) for i, t in enumerate(inputs)]
    replaced = iter(full)
    args = [[next(replaced) if isinstance(t, torch.Tensor) else t for t in a] if isinstance(a, (list, tuple))
            else next(replaced) if isinstance(a, torch.Tensor) else a for a in c.args]
    outputs = flatten_outputs(c.op(*args, **c.kwargs))
    output_grads = [torch.randn(o.shape, generator=_GEN, dtype=o.dtype)
                    if o is not None and (o.is_floating_point() or o.is_complex())
                    else None for o in outputs]
    used = [i for i, g in enumerate(output_grads) if g is not None]
    expected = torch.autograd.grad([outputs[i] for i in used], [full[i] for i in wanted],
                                   [output_grads[i] for i in used], allow_unused=True)
    try:
        actual = simulate_gradients(c, strategy, mesh_shape, wanted, output_grads)
    except Exception as e:  # noqa: BLE001 - a replica mismatch or a local error is a wrong backward
        return f"{strategy_str(strategy)}: backward failed: {type(e).__name__}: {str(e)[:300]}"
    for i, e, a in zip(wanted, expected, actual):
        e = torch.zeros_like(inputs[i]) if e is None else e
        if not torch.allclose(a, e, rtol=1e-9, atol=1e-9):
            return f"{strategy_str(strategy)}: gradient of input {i} wrong: max |diff| {(a - e).abs().max():.3g}"
    return None


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("op_case", [pytest.param(c, id=c.label) for c in CASES])
def test_local_backward_matches_full_gradients(op_case: OpCase, mesh_shape: tuple[int, ...]) -> None:
    strategies = [s for s in expanded_strategies(op_case, mesh_shape) if not is_replicate_only(s)]
    problems = [f for f in (gradient_failure(op_case, s, mesh_shape) for s in strategies) if f is not None]
    assert not problems, f"{op_case.label} on {mesh_shape}:\n" + "\n".join(problems)


def test_groups_that_do_not_divide_are_not_split() -> None:
    """2 groups on 4 ranks: the channels divide, the groups do not, so no group split."""
    c = next(c for c in conv_cases() if c.label.endswith("groups2"))
    on4 = expanded_strategies(c, (4,))
    assert all(s.inputs[1][0] != S(0) for s in on4), [strategy_str(s) for s in on4]
    assert any(s.inputs[1][0] == S(0) for s in expanded_strategies(c, (2,)))
    assert any(s.inputs[1] == (S(0), R) for s in expanded_strategies(c, (2, 2)))  # on one mesh dim of a 2x2
    assert not any(s.inputs[1] == (S(0), S(0)) for s in expanded_strategies(c, (2, 2)))


def test_training_batch_norm_splits_channels_only() -> None:
    train, _, _, evaluation, _ = batch_norm_cases()
    assert {s.inputs[0] for s in expanded_strategies(train, (2,))} == {(R,), (S(1),)}
    # spatial dims of size 3 do not divide by 2: batch and channels remain
    assert {s.inputs[0] for s in expanded_strategies(evaluation, (2,))} == {(R,), (S(0),), (S(1),)}


def test_written_inputs() -> None:
    """Batch norm writes its running statistics in training although its schema does not say so."""
    train, noaffine, nostats, evaluation, _ = batch_norm_cases()

    def written(c: OpCase) -> set[str]:
        return written_arg_names(c.op, c.args, c.kwargs)

    assert written(train) == written(noaffine) == {"running_mean", "running_var"}
    assert written(nostats) == written(evaluation) == set()
    assert written(case(aten.add_.Tensor, f64(4), f64(4))) == {"self"}
    assert written(case(aten.add.Tensor, f64(4), f64(4))) == set()


def _wrong(op_case: OpCase, outputs: tuple, inputs: tuple) -> tuple[OpCase, Strategy]:
    return op_case, expand(op_case.op_call(), [DimStrategy(outputs, inputs)], (2,))[-1]


def _conv() -> OpCase:
    return case(aten.conv2d.default, f64(4, 4, 6, 6), f64(8, 4, 3, 3), f64(8), [1, 1], [1, 1])


def _bn() -> OpCase:
    return batch_norm_cases()[0]


WRONG: list[tuple[str, Callable[[], tuple[OpCase, Strategy]]]] = [
    # A spatial split without halos: border outputs miss their neighbours' rows.
    ("conv-spatial", lambda: _wrong(_conv(), (S(2),), (S(2), R, R))),
    # A contraction whose bias is replicated adds the bias once per rank.
    ("conv-contraction-bias-R", lambda: _wrong(_conv(), (P,), (S(1), S(1), R))),
    # Training batch norm split on the batch: each rank normalizes with its own statistics,
    # and its replicated running statistics diverge.
    ("bn-train-batch", lambda: _wrong(_bn(), (S(0),), (S(0), R, R, R, R))),
    # Max is not linear.
    ("maxpool-partial", lambda: _wrong(case(aten.max_pool2d.default, f64(4, 4, 6, 6), [2, 2]), (P,), (P,))),
    # A pooled spatial dim split: windows cross the cut (3x3 windows, stride 2).
    ("avgpool-spatial", lambda: _wrong(case(aten.avg_pool2d.default, f64(4, 4, 8, 8), [3, 3], [2, 2], [1, 1]),
                                       (S(2),), (S(2),))),
]


@pytest.mark.parametrize("build", [pytest.param(b, id=name) for name, b in WRONG])
def test_simulator_detects_wrong_strategy(build: Callable[[], tuple[OpCase, Strategy]]) -> None:
    op_case, strategy = build()
    assert not is_replicate_only(strategy)
    assert check_strategy(op_case, strategy, (2,)) is not None


def test_running_stats_replicas_are_checked() -> None:
    """Inputs are compared after the op too: training batch norm split on the batch leaves
    its replicated running statistics different on each rank."""
    op_case = case(aten.batch_norm.default, f64(4, 8, 3, 3), None, None, f64(8), positive(8), True, 0.1, 1e-5, False)
    strategy = expand(op_case.op_call(), [DimStrategy((S(0),), (S(0), R, R))], (2,))[-1]
    with pytest.raises(ReplicaMismatch, match="Replicate on mesh dim 0"):
        simulate_with_inputs(op_case, strategy, (2,))


@pytest.mark.parametrize("op_case", [pytest.param(c, id=c.label) for c in conv_cases()])
def test_conv_flops_match_torch_flop_counter(op_case: OpCase) -> None:
    """op_flops prices a convolution as torch's FlopCounterMode counts it (forward)."""
    with FlopCounterMode(display=False) as counter:
        op_case.run_full()
    assert op_flops(op_case.op_call()) == counter.get_total_flops()


def test_conv_flops_by_hand() -> None:
    """2 * output elements * in_channels / groups * kernel elements, written out."""
    c = case(aten.conv2d.default, f64(2, 4, 6, 6), f64(8, 2, 3, 3), None, [1, 1], [1, 1], [1, 1], 2)
    assert op_flops(c.op_call()) == 2 * (2 * 8 * 6 * 6) * (4 // 2) * (3 * 3)
