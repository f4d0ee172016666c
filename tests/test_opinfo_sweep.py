"""Inputs nobody here chose: PyTorch's OpInfo samples through the brute-force rule checker.

``test_rules_bruteforce`` checks cases written by the people who wrote the rules. Here
the inputs come from PyTorch's OpInfo database, which DTensor's ``test_dtensor_ops.py``
sweeps too: samples of every OpInfo (float64 where the op allows it, else int64 or
bool), traced to the aten calls autopar would capture (``opinfo_samples``). Every traced
call whose overload has a rule is replayed with its actual arguments, and every strategy
the rule offers (plus all-Replicate) that divides evenly on the mesh is simulated per
rank by ``sharding_sim`` and compared with the unsharded call: outputs, and inputs after
the call (in-place writes).

Caps, for runtime (~1.5 min on 2 cores; tracing costs most): ``SAMPLES_PER_OP`` samples
per OpInfo spread over its sample list (``AUTOPAR_OPINFO_SAMPLES`` raises it for a deeper
local sweep; sample ids then change), meshes of 2, 2x2 and 5. The 5-rank mesh is there
because OpInfo sizes are mostly 5, 10 and 20: on 2 ranks a dim of 5 never splits, on 5
every rank holds one element of it.

A sample that fails for a known reason goes in ``EXPECTED_FAILURES`` with the reason
(strict xfail: it must keep failing, so the list stays honest). It is empty: every
failure the sweep found was a rule or simulator bug, fixed (see the cases tagged "OpInfo
sweep" in ``test_rules_bruteforce``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from opinfo_samples import Sample, sweep
from sharding_sim import OpCase, check_strategy

from autopar.rules import DEFAULT_RULES, FAMILIES, Strategy, Unhandled, expand

pytestmark = pytest.mark.sweep

MESHES = [(2,), (2, 2), (5,)]

EXPECTED_FAILURES: dict[str, str] = {}
"""``opinfo-sINDEX`` (every mesh) or ``opinfo-sINDEX-MESH`` -> why that sample fails."""

_DATA_DEPENDENT = "reads a tensor's value in Python (.item(), equal): export cannot trace it either"
_CUDA_ONLY = "jiterator ops run on CUDA only"
_SPARSE = "sparse CSR inputs: export does not trace them"
_NO_DTYPE = "no CPU kernel for float64, int64 or bool (complex-only, CUDA-only, or no tensor input)"
NOT_SWEPT: dict[str, str] = {
    "item": _DATA_DEPENDENT, "allclose": _DATA_DEPENDENT, "equal": _DATA_DEPENDENT,
    "nn.functional.gaussian_nll_loss": _DATA_DEPENDENT,
    "jiterator_unary": _CUDA_ONLY, "jiterator_binary": _CUDA_ONLY, "jiterator_4inputs_with_extra_args": _CUDA_ONLY,
    "jiterator_binary_return_by_ref": _CUDA_ONLY, "jiterator_2inputs_2outputs": _CUDA_ONLY,
    "sparse.sampled_addmm": _SPARSE, "sparse.mm.reduce": _SPARSE,
    "broadcast_shapes": _NO_DTYPE, "view_as_real": _NO_DTYPE, "imag": _NO_DTYPE, "istft": _NO_DTYPE,
    "nn.functional.silu.complex": _NO_DTYPE, "nn.functional.batch_norm.without_cudnn": _NO_DTYPE,
    "torch._scaled_mm": _NO_DTYPE, "torch._scaled_mm_v2": _NO_DTYPE,
    "torch.ops.aten._flash_attention_forward": _NO_DTYPE, "torch.ops.aten._efficient_attention_forward": _NO_DTYPE,
}
"""OpInfos whose samples (all, as it happens) are not swept, and why (checked: a new one must be explained)."""


@functools.cache
def swept() -> tuple[list[Sample], dict[str, str]]:
    return sweep()


def strategies(c: OpCase, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """What the planner would choose from for this call (an Unhandled call: all-Replicate).
    Raises AssertionError when the rule describes placements that do not fit the call."""
    call = c.op_call()
    result = DEFAULT_RULES.lookup(c.op)(call)
    dims = [] if isinstance(result, Unhandled) else result
    for s in dims:
        assert len(s.inputs) == len(call.tensor_inputs) and len(s.outputs) == len(call.outputs), \
            f"{s}: placements for {len(s.inputs)} inputs and {len(s.outputs)} outputs, the call has " \
            f"{len(call.tensor_inputs)} and {len(call.outputs)}"
    return expand(call, dims, mesh_shape)


def failures(c: OpCase, mesh_shape: tuple[int, ...]) -> list[str]:
    """What is wrong with the rule for one call on one mesh (empty when nothing is)."""
    try:
        offered = strategies(c, mesh_shape)
    except Exception as e:  # noqa: BLE001 - a rule that crashes on a legal call stops the planner
        return [f"rule failed: {type(e).__name__}: {str(e)[:200]}"]
    return [f for f in (check_strategy(c, s, mesh_shape) for s in offered) if f is not None]


def _mesh_id(mesh: tuple[int, ...]) -> str:
    return "x".join(map(str, mesh))


def _params() -> list[Any]:
    params = []
    for sample in swept()[0]:
        for mesh in MESHES:
            param_id = f"{sample.id}-{_mesh_id(mesh)}"
            reason = EXPECTED_FAILURES.get(param_id, EXPECTED_FAILURES.get(sample.id))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(sample, mesh, id=param_id, marks=marks))
    return params


@pytest.mark.parametrize(("sample", "mesh_shape"), _params())
def test_opinfo_sample(sample: Sample, mesh_shape: tuple[int, ...]) -> None:
    problems = [f"{c.label}: {p}" for c in sample.cases for p in failures(c, mesh_shape)]
    assert not problems, f"{sample.id} ({sample.dtype}) on {mesh_shape}:\n" + "\n".join(problems[:20])


def test_expected_failures_name_swept_samples() -> None:
    """Every EXPECTED_FAILURES key names a sample the sweep runs (else it is stale)."""
    ids = {s.id for s in swept()[0]}
    ids |= {f"{i}-{_mesh_id(m)}" for i in ids for m in MESHES}
    assert not [k for k in EXPECTED_FAILURES if k not in ids]


def test_opinfos_not_swept_are_explained() -> None:
    left_out = swept()[1]
    assert set(left_out) == set(NOT_SWEPT), {k: left_out.get(k, "swept now") for k in set(left_out) ^ set(NOT_SWEPT)}


def test_sweep_reaches_every_family() -> None:
    """Guard against a vacuous sweep: OpInfo samples reach a rule of every family."""
    reached = {DEFAULT_RULES.family[c.op] for s in swept()[0] for c in s.cases}
    assert reached == {t.family for t in FAMILIES}, {t.family for t in FAMILIES} - reached


@pytest.mark.parametrize("mesh_shape", MESHES, ids=_mesh_id)
def test_sweep_checks_split_strategies(mesh_shape: tuple[int, ...]) -> None:
    """Guard against sizes that leave only all-Replicate: on every mesh most swept calls get
    some split strategy (Shard or Partial) checked."""
    calls = [c for s in swept()[0] for c in s.cases]
    split = sum(1 for c in calls if len(strategies(c, mesh_shape)) > 1)
    assert split > len(calls) // 2, f"{split} of {len(calls)} calls"
