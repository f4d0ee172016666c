"""``autopar.config``: one options object (frozen, keyword-only, a docstring per field) built from the
keyword arguments ``plan`` and ``compile`` take, and one check of it against a mesh."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

import autopar
from autopar import config
from autopar.config import OPTIONS, PlanConfig, check


def _sections() -> list[type]:
    return [PlanConfig, config.AxesConfig, config.MemoryConfig, config.ContextConfig, config.SolverConfig]


@pytest.mark.parametrize("cls", _sections(), ids=lambda c: c.__name__)
def test_every_field_is_frozen_keyword_only_and_documented(cls: type) -> None:
    params = dataclasses.fields(cls)
    assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert all(f.kw_only for f in params)
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    documented = {node.target.id for node, after in zip(body, body[1:]) if isinstance(node, ast.AnnAssign)
                  and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)}
    sections = {"axes", "memory", "context", "solver"}  # documented by their own classes
    assert {f.name for f in params} - sections <= documented, cls.__name__


def test_every_option_names_a_field_and_every_field_an_option() -> None:
    built = PlanConfig.from_options(data_axes=("dp",), memory_limit=2.0**30, zero={"dp": 3}, context_layout="zigzag",
                                    solver_time_limit_s=5.0, precision="fp32")
    assert built.axes.data == ("dp",) and built.memory.limit_bytes == 2.0**30 and built.memory.zero == {"dp": 3}
    assert built.context.layout == "zigzag" and built.solver.time_limit_s == 5.0 and built.precision == "fp32"
    reached = {(section, attr) for section, attr in OPTIONS.values()}
    for cls, section in ((PlanConfig, ""), (config.AxesConfig, "axes"), (config.MemoryConfig, "memory"),
                         (config.ContextConfig, "context"), (config.SolverConfig, "solver")):
        for f in dataclasses.fields(cls):
            if f.name not in ("axes", "memory", "context", "solver", "masters"):
                assert (section, f.name) in reached, (section, f.name)


def test_an_unknown_option_is_refused_by_name() -> None:
    with pytest.raises(autopar.InputTypeError, match=r"unknown option data_axis=\('dp',\); the options are"):
        PlanConfig.from_options(data_axis=("dp",))
    with pytest.raises(autopar.InputTypeError, match="unknown option memory_limit_gib"):
        autopar.plan(object(), {"dp": 2}, memory_limit_gib=4)  # type: ignore[arg-type]


def test_with_options_changes_only_what_it_names() -> None:
    base = PlanConfig.from_options(data_axes=("dp",), zero={"dp": 2})
    changed = base.with_options(zero={"dp": 3}, train=False)
    assert changed.memory.zero == {"dp": 3} and not changed.train and changed.axes.data == ("dp",)


@pytest.mark.parametrize("options,message", [
    ({"data_axes": "dp"}, r"data_axes must be a tuple of axis names \(write \('dp',\)\)"),
    ({"data_axes": ("x",)}, r"data_axes \('x',\) names 'x', not an axis of the mesh; the mesh's axes are"),
    ({"data_axes": ("dp", "dp")}, "names an axis twice"),
    ({"expert_axes": ("tp",), "data_axes": ("dp",)}, "not in data_axes"),
    ({"input_sharded": True}, "input_sharded=True needs data_axes"),
    ({"context_axes": ("dp",), "data_axes": ("dp",)}, "named in both data_axes and context_axes"),
    ({"constraints": {"x": None}, "constraint_axis": "pp"}, r"constraints apply to mesh axis 'pp' \(constraint_axis=\), not an axis of the mesh"),
    ({"random_stream": "philox"}, "random_stream='philox'"),
    ({"bucket_bytes": 7}, "bucket_bytes must be a positive whole number of bytes"),
    ({"solver_time_limit_s": 0}, "solver_time_limit_s must be a positive number"),
    ({"memory_limit": -1}, "memory_limit must be a positive number"),
    ({"memory_headroom": 1.5}, "headroom is a fraction"),
    ({"zero": 3}, "zero must be a dict"),
    ({"zero": {"dp": 4}}, "a ZeRO stage is one of"),
    ({"context_layout": "spiral"}, "context_layout is 'contiguous', 'zigzag' or None"),
    ({"pipeline": autopar.Pipeline(axis="dp"), "micro_batches": 2}, "micro_batches=2 with a pipeline"),
    ({"pipeline": autopar.Pipeline(axis="dp"), "data_axes": ("dp",)}, "data_axes names the pipeline axis"),
    ({"pipeline": "1f1b"}, "pipeline must be an autopar.Pipeline"),
], ids=lambda v: str(v)[:40])
def test_check_refuses_what_no_plan_takes_naming_the_option(options: dict, message: str) -> None:
    with pytest.raises(autopar.InputError, match=message):
        check(PlanConfig.from_options(**options), autopar.Mesh({"dp": 2, "tp": 2}, "cpu"))
