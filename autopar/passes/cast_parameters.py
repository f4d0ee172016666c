"""cast_parameters: mixed precision. Parameters arrive as fp32 masters; each use reads them
in the dtype the step was captured in (bf16), and their gradients are reduced in fp32.

The step is captured from a bf16 copy of the model (``autopar.runtime.mixed``), so every
op, dtype argument and fake value in the graph is what a bf16 model runs; only the
parameter placeholders receive another dtype than captured. This pass restores the
captured dtype where a parameter is read:

- a reshard or regather of the parameter casts before its collectives (``dtype=``), so a
  gather moves bf16, and its backward reduces the gradient in ``grad_dtype=`` fp32 before
  handing the master its fp32 gradient (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``). Cast and reshard are one autograd op: after a separate cast node
  autograd would give the reshard's backward a bf16 gradient;
- every other use reads one ``_to_copy`` of the parameter (its backward returns the fp32
  gradient, which the buckets all-reduce in fp32 like any parameter's).

A parameter captured in a low precision without fp32 masters (a bf16 model) is not cast,
but its reshards still reduce its gradient in fp32 (``grad_dtype=``): the plan prices every
parameter gradient's reduction at fp32, buckets included (``runtime.grad_sync``).
A parameter the step writes in place cannot be read through a cast copy: refused.
"""

from __future__ import annotations

import torch
import torch.fx

from autopar.capture.aliasing import written_placeholders
from autopar.passes.context import PassContext, plan_name
from autopar.problem.nodes import PARAM

aten = torch.ops.aten
RESHARDS = ("reshard", "regather")
REDUCE_DTYPE = torch.float32
"""What a parameter's gradient is reduced in, whatever the compute dtype."""


def cast_parameters(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    written = written_placeholders(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or not _low_precision_param(node, pc):
            continue
        dtype = node.meta["val"].dtype
        cast = pc.master_dtype is not None and pc.master_dtype != dtype
        if cast and node in written:
            raise RuntimeError(f"parameter {pc.graph.nodes[plan_name(node) or node.name].fqn} is written in place by "
                               f"the step: mixed precision reads a {dtype} copy of it and would lose the write; "
                               "compile the model in fp32, or cast it to bf16 first")
        direct = []
        for user in list(node.users):
            if user.op == "call_module" and user.target in RESHARDS and user.args[0] is node:
                user.kwargs = {**user.kwargs, **({"dtype": dtype} if cast else {}), "grad_dtype": REDUCE_DTYPE}
            else:
                direct.append(user)
        if cast and direct:
            # just before its first reader: the copy lives no longer than it must
            with gm.graph.inserting_before(min(direct, key=order.__getitem__)):
                copy = gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
            copy.meta["val"] = node.meta["val"]  # the value the captured graph read here
            for user in direct:
                user.replace_input_with(node, copy)
    gm.graph.lint()
    gm.recompile()
    return gm


def _low_precision_param(node: torch.fx.Node, pc: PassContext) -> bool:
    """A floating parameter captured below fp32 (bf16, fp16)."""
    plan_node = pc.graph.nodes.get(plan_name(node) or node.name)
    val = node.meta.get("val")
    return (plan_node is not None and plan_node.kind == PARAM and isinstance(val, torch.Tensor)
            and val.is_floating_point() and val.dtype.itemsize < REDUCE_DTYPE.itemsize)
