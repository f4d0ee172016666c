"""``runtime.stages.StageModule``: what a pipeline stage reads and sends on."""

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
    stage = StageModule(StageProgram(index=0, gm=gm, inputs=[], user_inputs=["x"], outputs=["mul", "count"],
                                     state=["count"]), [buffer], slots=[0])
    stage.set_inputs([[torch.ones(2)], [torch.ones(2)]])
    _, sent = stage()
    assert sent is not buffer and sent.item() == 1.0
    stage.at_chunk(1)
    stage()  # the next micro-batch bumps the buffer again: what was sent stays 1
    assert sent.item() == 1.0 and buffer.item() == 2.0


def test_a_stage_reads_the_user_inputs_of_the_micro_batch_it_runs() -> None:
    """A later stage reads the user inputs it needs (the targets of its loss) from the micro-batch
    the schedule runs (``MicroBatchStage`` passes its index on), not from the stage before; one it
    returns goes out as a copy, as a value it received would."""
    graph = torch.fx.Graph()
    h, t = graph.placeholder("h"), graph.placeholder("t")
    graph.output((graph.call_function(torch.sub, (h, t)), t))
    stage = StageModule(StageProgram(index=1, gm=torch.fx.GraphModule(nn.Module(), graph), inputs=["h"],
                                     user_inputs=["t"], outputs=["sub", "t"], state=[]), [], slots=[1])
    micro = [[torch.zeros(2), torch.full((2,), float(i))] for i in range(3)]
    stage.set_inputs(micro)
    for i in (2, 0):
        stage.at_chunk(i)
        out, passed = stage(torch.ones(2))
        assert out.tolist() == [1.0 - i] * 2 and passed is not micro[i][1] and passed.tolist() == [float(i)] * 2
    assert stage.sent_bytes == [16, 16]
