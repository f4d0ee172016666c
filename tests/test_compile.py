"""``autopar.compile`` as a first-time user calls it: Hugging Face models with ``labels=``,
keyword inputs by name, and clear errors when a call does not match the compiled step."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel

import autopar
from autopar.runtime.forked import run_ranks
from examples import gpt, hf_models


HF_CASES = {"llama": (hf_models.build_llama, (2, 2), ("dp", "tp")), "gpt2": (hf_models.build_gpt2, (2,), ("dp",))}


def _hf(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    model, (ids,), _, _, _ = HF_CASES[name][0]()
    model.eval()  # dropout off: masks cannot match across layouts
    return model, ids


def _hf_labels_rank(rank: int, world: int, name: str) -> dict[str, Any]:
    _, shape, names = HF_CASES[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model, ids = _hf(name)
    pm = autopar.compile(model, mesh, (ids,), example_kwargs={"labels": ids}, pipeline=False)
    loss = pm(ids, labels=ids)
    loss.backward()
    grads = {k: DTensor.from_local(p.grad, mesh, pm.state_dict()[k].placements, run_check=False).full_tensor().tolist()
             for k, p in pm.named_parameters()}
    errors = {}
    for case, call in {"missing": lambda: pm(ids), "unexpected": lambda: pm(ids, labels=ids, mask=ids),
                       "positional": lambda: pm(ids, ids, labels=ids), "none": lambda: pm(labels=ids)}.items():
        with pytest.raises(TypeError) as info:
            call()
        errors[case] = str(info.value)
    return {"loss": loss.full_tensor().item(), "grads": grads, "names": [k for k, _ in pm.named_parameters()],
            "errors": errors}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_hf_model_called_with_labels_compiles_under_its_own_names(name: str) -> None:
    """``compile(..., example_kwargs={"labels": ids})`` with ``loss_fn=None``, called as
    ``pm(ids, labels=ids)``: HF's parameter names, HF's loss and every gradient (GPT-2's
    ``lm_head`` tied to ``wte``)."""
    model, ids = _hf(name)
    ref = model(ids, labels=ids).loss
    ref.backward()
    world = math.prod(HF_CASES[name][1])
    for r in run_ranks(_hf_labels_rank, world, name):
        assert r["names"] == [k for k, _ in model.named_parameters()]
        assert r["loss"] == pytest.approx(ref.item(), rel=1e-5)
        for k, p in model.named_parameters():
            torch.testing.assert_close(torch.tensor(r["grads"][k]), p.grad, rtol=1e-4, atol=1e-5, msg=k)
        errors = r["errors"]
        assert "missing keyword input 'labels'" in errors["missing"]
        assert "unexpected keyword input 'mask'" in errors["unexpected"] and "labels" in errors["unexpected"]
        assert "1 positional value" in errors["positional"] and "got 2" in errors["positional"]
        assert "got 0" in errors["none"]


def _counting_solves_rank(rank: int, world: int) -> dict[str, Any]:
    from autopar.search import ilp

    calls = []
    real = ilp.solve_ilp

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(rank)
        return real(*args, **kwargs)

    ilp.solve_ilp = counted  # this forked process only
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, inputs, loss_fn, targets = gpt.build()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, pipeline=False)
    return {"solves": len(calls), "hash": pm.plan.plan_hash(), "loss": pm(*inputs, *targets).full_tensor().item()}


def test_compile_solves_the_plan_on_rank_zero_only() -> None:
    """Every rank captures and lists strategies; only rank 0 runs the ILP; all build its plan."""
    model, inputs, loss_fn, targets = gpt.build()
    expected = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                            example_targets=targets, pipeline=False)  # as the ranks compile it
    results = run_ranks(_counting_solves_rank, 4)
    assert [r["solves"] for r in results] == [1, 0, 0, 0]
    assert {r["hash"] for r in results} == {expected.plan_hash()}
    assert [r["loss"] for r in results] == pytest.approx([loss_fn(model(*inputs), *targets).item()] * 4, rel=1e-5)


def _rank_zero_solve_fails(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build()
    with pytest.raises(autopar.MemoryLimitError, match="planning failed on rank 0: MemoryLimitError") as info:
        autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, memory_limit=1024,
                        pipeline=False)
    return str(info.value)


def _ranks_pass_other_limits(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build()
    with pytest.raises(autopar.CompileError, match="planned differently .*captured steps differ") as info:
        autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, memory_limit=2**30 + rank,
                        pipeline=False)
    return str(info.value)


def _rank_passes_bad_input(rank: int, world: int) -> str:
    """What the user handed in, refused while planning on every rank: an InputError of its own type."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build()
    with pytest.raises(autopar.InputTypeError, match="checking the options failed on rank 0 .*zero must be a dict") as info:
        autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, zero=3,
                        pipeline=False)  # type: ignore[arg-type]
    return str(info.value)


def _rank_passes_another_world_size(rank: int, world: int) -> str:
    """An int mesh is the number of devices: one that is not the world's is refused alike on every rank."""
    model, inputs, loss_fn, targets = gpt.build()
    with pytest.raises(autopar.InputError, match=r"compile\(mesh=3\): an int is the number of devices, which must "
                                                 r"be the world size \(2 ranks\)") as info:
        autopar.compile(model, 3, inputs, loss_fn=loss_fn, example_targets=targets)
    return str(info.value)


@pytest.mark.parametrize("scenario", [_rank_zero_solve_fails, _ranks_pass_other_limits, _rank_passes_bad_input,
                                      _rank_passes_another_world_size],
                         ids=["solver-error-on-rank-0", "ranks-disagree-before-solving", "bad-input", "world-size"])
def test_planning_errors_reach_every_rank(scenario: Any) -> None:
    messages = run_ranks(scenario, 2)
    assert len(set(messages)) == 1  # every rank raised, the same error


def test_compile_refuses_a_planning_mesh() -> None:
    """``autopar.Mesh`` plans; compile runs on a DeviceMesh (it was "'int' object is not callable")."""
    model, inputs, loss_fn, targets = gpt.build()
    with pytest.raises(autopar.InputTypeError, match="compile runs on a torch DeviceMesh .*got Mesh: an "
                                                     "autopar.Mesh describes a mesh for planning only"):
        autopar.compile(model, autopar.Mesh({"dp": 2}), inputs, loss_fn=loss_fn,  # type: ignore[arg-type]
                        example_targets=targets, pipeline=False)


def test_a_call_binds_to_the_captured_leaves_and_keeps_non_tensor_inputs_fixed() -> None:
    """The compiled step was specialized on non-tensor inputs: another value is an error, not ignored."""
    from autopar.capture.step import StepSignature

    x, y, mask = torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 4)
    sig = StepSignature.of((x, 3), {"mask": mask, "scale": None, "pair": (x, 2)}, (y,))
    assert sig.labels == ("input 0", "input 1", "keyword input 'mask'", "keyword input 'scale'",
                          "keyword input 'pair'[0]", "keyword input 'pair'[1]", "target 0")
    leaves = sig.bind((x, 3, y), {"pair": (x, 2), "scale": None, "mask": mask})
    assert [v is w for v, w in zip(leaves, [x, 3, mask, None, x, 2, y])] == [True] * 7
    with pytest.raises(ValueError, match=r"input 1 was 3 at compile time and is 4 \(int\) now"):
        sig.bind((x, 4, y), {"mask": mask, "scale": None, "pair": (x, 2)})
    with pytest.raises(ValueError, match=r"keyword input 'pair'\[1\] was 2"):
        sig.bind((x, 3, y), {"mask": mask, "scale": None, "pair": (x, 5)})
    with pytest.raises(TypeError, match="keyword input 'mask' must be a tensor"):
        sig.bind((x, 3, y), {"mask": None, "scale": None, "pair": (x, 2)})
    with pytest.raises(TypeError, match="nested differently"):
        sig.bind((x, 3, y), {"mask": mask, "scale": None, "pair": (x,)})


def _precision_rank(rank: int, world: int, precision: str | None, dtype: torch.dtype,
                    hardware: str | None = None) -> str:
    model, inputs, loss_fn, targets = gpt.build()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    try:
        pm = autopar.compile(model.to(dtype), mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                             precision=precision, hardware=hardware, pipeline=False)
    except autopar.InputError as exc:
        return str(exc)
    return f"{pm.plan.precision} {next(pm.parameters()).dtype}"


def test_the_plan_prices_the_precision_the_model_runs_in() -> None:
    """An fp32 model runs as asked: fp32 by default on the cpu profile, bf16 mixed precision
    (fp32 masters) when asked or by default on a GPU profile. A bf16 model runs in bf16, and
    fp32 asked of it is refused on every rank (there are no fp32 weights to keep)."""
    assert run_ranks(_precision_rank, 2, None, torch.bfloat16) == ["bf16 torch.bfloat16"] * 2
    assert run_ranks(_precision_rank, 2, None, torch.float32) == ["fp32 torch.float32"] * 2
    assert run_ranks(_precision_rank, 2, "bf16", torch.float32) == ["bf16 torch.float32"] * 2
    assert run_ranks(_precision_rank, 2, None, torch.float32, "h100") == ["bf16 torch.float32"] * 2
    for message in run_ranks(_precision_rank, 2, "fp32", torch.bfloat16):
        assert "precision='fp32' but the model's parameters are bf16" in message


def test_a_call_must_pass_the_compiled_shapes_and_dtypes() -> None:
    """The program is specialized on the captured shapes (view sizes, a mean loss's count):
    another batch size or dtype is refused by name, not run to a wrong loss."""
    from autopar.capture.step import StepSignature

    x, y = torch.randn(4, 8), torch.randn(4, 2)
    sig = StepSignature.of((x,), {}, (y,))
    assert sig.tensors == {0: ((4, 8), torch.float32), 1: ((4, 2), torch.float32)}
    sig.bind((torch.randn(4, 8), torch.randn(4, 2)), {})
    with pytest.raises(autopar.InputError, match=r"input 0 is a torch.float32 tensor of shape \(8, 8\), but the "
                                                 r"step was compiled for a torch.float32 tensor of shape "
                                                 r"\(4, 8\): .*compile again"):
        sig.bind((torch.randn(8, 8), torch.randn(8, 2)), {})
    with pytest.raises(ValueError, match=r"target 0 is a torch.float64 tensor of shape \(4, 2\), but .*"
                                         r"torch.float32 tensor of shape \(4, 2\)"):
        sig.bind((x, y.double()), {})
    local = sig.sharded({0: (2, 8), 1: (2, 2)}, " (this rank's shard)")
    local.bind((x[:2], y[:2]), {})
    with pytest.raises(ValueError, match=r"input 0 .* shape \(4, 8\), but .* shape \(2, 8\) \(this rank's shard\)"):
        local.bind((x, y), {})


def _other_batch_rank(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    x4, y4, x8, y8 = torch.randn(4, 8), torch.randn(4, 4), torch.randn(8, 8), torch.randn(8, 4)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    step = dict(loss_fn=torch.nn.functional.mse_loss, data_axes=("dp",))
    whole = autopar.compile(model, mesh, (x4,), example_targets=(y4,), **{"pipeline": False, **step})
    sharded = autopar.compile(model, mesh, (x4[:2],), example_targets=(y4[:2],), input_sharded=True,
                              **{"pipeline": False, **step})
    errors = {}
    for what, pm, args in (("whole", whole, (x8, y8)), ("sharded", sharded, (x4, y4)),
                           ("dtype", whole, (x4.double(), y4))):
        with pytest.raises(ValueError) as info:
            pm(*args)
        errors[what] = str(info.value)
    return {"errors": errors, "whole": whole(x4, y4).full_tensor().item(),
            "sharded": sharded(x4[2 * rank: 2 * rank + 2], y4[2 * rank: 2 * rank + 2]).full_tensor().item(),
            "expected": torch.nn.functional.mse_loss(model(x4), y4).item()}


def test_a_compiled_module_refuses_another_batch_size_on_every_rank() -> None:
    """Compiled at batch 4 and called at 8, the loss's static count was 4: a wrong loss, silently."""
    for r in run_ranks(_other_batch_rank, 2):
        assert r["whole"] == pytest.approx(r["expected"], rel=1e-5)
        assert r["sharded"] == pytest.approx(r["expected"], rel=1e-5)
        errors = r["errors"]
        assert "input 0 is a torch.float32 tensor of shape (8, 8), but the step was compiled for a " \
               "torch.float32 tensor of shape (4, 8):" in errors["whole"]
        assert "input 0 is a torch.float32 tensor of shape (4, 8), but the step was compiled for a " \
               "torch.float32 tensor of shape (2, 8) (this rank's shard" in errors["sharded"]
        assert "input 0 is a torch.float64 tensor" in errors["dtype"]


def _bad_axes_rank(rank: int, world: int) -> dict[str, str]:
    named = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    unnamed = init_device_mesh("cpu", (2,))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    step = dict(loss_fn=torch.nn.functional.mse_loss, example_targets=(y,))
    cases = {"unknown": (named, dict(data_axes=("data",), input_sharded=True)),
             "unnamed": (unnamed, dict(data_axes=("dp",), input_sharded=True)),
             "unnamed-default": (unnamed, dict(input_sharded=True)),
             "string": (named, dict(data_axes="dp")),
             "twice": (named, dict(data_axes=("dp", "dp"), input_sharded=True)),
             "constraint-axis": (named, dict(constraints={"": ColwiseParallel()}))}
    errors = {}
    for what, (mesh, kwargs) in cases.items():
        with pytest.raises(autopar.InputError) as info:
            autopar.compile(torch.nn.Linear(8, 4), mesh, (x,), **step,
                            **{"pipeline": False, **kwargs})  # type: ignore[arg-type]
        errors[what] = str(info.value)
    return errors


def test_mesh_axes_the_options_name_are_checked_against_the_device_mesh() -> None:
    """A data or constraint axis the DeviceMesh lacks is named with the mesh's axes, on every
    rank, before planning (it was a bare tuple.index or NoneType error)."""
    results = run_ranks(_bad_axes_rank, 2)
    assert results[0] == results[1]
    errors = results[0]
    assert all(e.startswith("checking the options failed on rank 0 (of 2 failing)") for e in errors.values())
    assert "data_axes ('data',) names 'data', not an axis of the mesh; the mesh's axes are ('dp',) (dp=2)" \
        in errors["unknown"]
    assert "data_axes, input_sharded name mesh axes, and the mesh (2 devices, axes open) leaves its axes to the " \
        "planner" in errors["unnamed"]  # a 1-D mesh without names: its axes the planner's
    assert "input_sharded names mesh axes" in errors["unnamed-default"]
    assert "data_axes must be a tuple of axis names (write ('dp',))" in errors["string"]
    assert "names an axis twice" in errors["twice"]
    assert "constraints apply to mesh axis 'tp' (constraint_axis=), not an axis of the mesh; the mesh's axes " \
           "are ('dp',)" in errors["constraint-axis"]
