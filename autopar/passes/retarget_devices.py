"""retarget_devices: tensors the step creates go to this rank's device.

A step captured from a meta-device model creates its own tensors (``arange``, masks)
on ``meta``; at run time they belong on the mesh's device. Inside the subgraphs of
higher-order ops (a ``torch.no_grad()`` block) too.
"""

from __future__ import annotations

import torch
import torch.fx

from autopar.capture.subgraphs import nested_graph_modules
from autopar.passes.context import PassContext


def retarget_devices(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    target = torch.device(pc.device_type)

    def swap(value: object) -> object:
        return target if isinstance(value, torch.device) and value != target else value

    for module in (gm, *nested_graph_modules(gm)):
        for node in module.graph.nodes:
            if node.op == "call_function":
                node.args = tuple(swap(a) for a in node.args)
                node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}
        module.recompile()
    return gm
