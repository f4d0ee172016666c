"""``runtime.stages.StageModule``: what a pipeline stage sends on."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from autopar.passes.split_stages import StageProgram
from autopar.runtime.stages import StageModule


def test_a_stage_sends_a_copy_of_the_state_it_bumps() -> None:
    """A stage whose program returns one of its buffers (a counter it bumps in place, read by a later
    stage) sends a copy: the send runs beside the next micro-batch's forward, whose in-place update
    would otherwise change what the later stage receives (seen as a first loss off by 1.1 under load)."""
    graph = torch.fx.Graph()
    x, count = graph.placeholder("x"), graph.placeholder("count")
    graph.call_function(torch.Tensor.add_, (count, 1))
    graph.output((graph.call_function(torch.mul, (x, 2.0)), count))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    buffer = torch.zeros(())
    stage = StageModule(StageProgram(index=0, gm=gm, inputs=["x"], outputs=["mul", "count"], state=["count"]),
                        [buffer])
    _, sent = stage(torch.ones(2))
    assert sent is not buffer and sent.item() == 1.0
    stage(torch.ones(2))  # the next micro-batch bumps the buffer again: what was sent stays 1
    assert sent.item() == 1.0 and buffer.item() == 2.0
