"""``passes.split_stages`` cuts a rank's program into pipeline stages so that what crosses a cut is
what the plan prices (``pipeline.stages.crossing_bytes``: each value once, as its producer placed it)."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

from autopar.errors import InputError
from autopar.passes.context import PLAN_NAME
from autopar.passes.split_stages import split_stages


def _chain_of_reshards() -> tuple[torch.fx.GraphModule, dict[str, int]]:
    """x -> h -> reshard r1 (read by stage 0's op a and by stage 1's op c) -> reshard r2 of r1 (read by
    stage 0's op a2 and stage 1's op b): as ``insert_reshards`` shares a reshard among readers of
    several stages, and reshards a reshard's result again for another placement."""
    root = nn.Module()
    root.reshard = nn.Identity()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    h = graph.call_function(torch.neg, (x,))
    r1 = graph.call_module("reshard", (h,))
    a = graph.call_function(torch.add, (r1, 1.0))
    r2 = graph.call_module("reshard", (r1,))
    a2 = graph.call_function(torch.sub, (r2, 1.0))
    b = graph.call_function(torch.mul, (r2, 2.0))
    c = graph.call_function(torch.mul, (r1, 3.0))
    d = graph.call_function(torch.add, (b, c))
    e = graph.call_function(torch.add, (d, a))
    f = graph.call_function(torch.add, (e, a2))
    graph.output(f)
    stage_of = {}
    for node, stage in ((h, 0), (a, 0), (a2, 0), (b, 1), (c, 1), (d, 1), (e, 1), (f, 1)):
        node.meta[PLAN_NAME] = node.name
        stage_of[node.name] = stage
    return torch.fx.GraphModule(root, graph), stage_of


def test_a_chain_of_reshards_is_computed_in_each_stage_reading_it() -> None:
    """Stage 1 reads r1 (by c) and r2 (a reshard of r1, by b): both are computed again in stage 1
    from h, which crosses the cut once, as the plan counts it; no reshard crosses it (before,
    stage 1 received h for its copy of r1 and r1 itself for its copy of r2)."""
    gm, stage_of = _chain_of_reshards()
    first, second = split_stages(gm, stage_of, 2, ["x"])
    assert sorted(second.inputs) == ["add", "neg", "sub"], second.inputs
    assert (first.user_inputs, second.user_inputs) == (["x"], [])
    x = torch.randn(3)
    sent = dict(zip(first.outputs, first.gm(x)))
    out = second.gm(*[sent[name] for name in second.inputs])
    torch.testing.assert_close(out, (-x * 2 + -x * 3) + (-x + 1) + (-x - 1))


def test_a_cast_of_a_tied_weight_is_computed_in_each_stage_reading_it() -> None:
    """A parameter read by stages 0 and 1 through one cast (mixed precision reads a tied weight's
    bf16 copy, ``passes.cast_parameters``): each stage casts the parameter it holds, so the cast
    does not cross the cut (the plan prices no such send) and each stage's reads reach its own
    copy of the weight, whose gradient the pipeline sums between the stages (``runtime.tied``)."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    cast = graph.call_function(torch.ops.aten._to_copy.default, (w,), {"dtype": torch.float64})
    a = graph.call_function(torch.mul, (x, cast))
    b = graph.call_function(torch.add, (a, cast))
    graph.output(b)
    for node in (a, b):
        node.meta[PLAN_NAME] = node.name
    gm = torch.fx.GraphModule(nn.Module(), graph)
    first, second = split_stages(gm, {"mul": 0, "add": 1}, 2, ["x"])
    assert (first.inputs, first.user_inputs, first.state, first.outputs) == ([], ["x"], ["w"], ["mul"])
    assert (second.inputs, second.user_inputs, second.state) == (["mul"], [], ["w"])
    x_, w_ = torch.randn(3), torch.randn(3)
    (sent,) = first.gm(x_, w_)
    torch.testing.assert_close(second.gm(sent, w_), x_.double() * w_.double() + w_.double())


def _rotary_like() -> tuple[torch.fx.GraphModule, dict[str, int]]:
    """x (tokens), t (targets), inv (a buffer like rotary's ``inv_freq``): table = cos(reshard(cast(arange(3)
    * inv))), the plan's ops arange, mul and cos of constants alone with a cast and a reshard the passes
    put between; stage 0 computes y = x * table; stage 1 reads the table again and the targets."""
    root = nn.Module()
    root.reshard = nn.Identity()
    graph = torch.fx.Graph()
    x, t, inv = graph.placeholder("x"), graph.placeholder("t"), graph.placeholder("inv")
    ar = graph.call_function(torch.ops.aten.arange.default, (3,), {"dtype": torch.float32}, name="arange")
    freqs = graph.call_function(torch.ops.aten.mul.Tensor, (ar, inv), name="freqs")
    cast = graph.call_function(torch.ops.aten._to_copy.default, (freqs,), {"dtype": torch.float64}, name="cast")
    table = graph.call_function(torch.ops.aten.cos.default, (graph.call_module("reshard", (cast,)),), name="table")
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, table), name="y")
    z = graph.call_function(torch.ops.aten.add.Tensor, (y, table), name="z")
    loss = graph.call_function(torch.ops.aten.sub.Tensor, (z, t), name="loss")
    graph.output(loss)
    stage_of = {}
    for node, stage in ((ar, 0), (freqs, 0), (table, 0), (y, 0), (z, 1), (loss, 1)):
        node.meta[PLAN_NAME] = node.name
        stage_of[node.name] = stage
    return torch.fx.GraphModule(root, graph), stage_of


def test_user_inputs_and_values_of_constants_alone_do_not_cross() -> None:
    """The last stage reads the targets from its own micro-batch (every rank is handed the step's
    inputs), and computes the table of constants again from its own copy of the buffer (the plan's
    ``constant_ops``, with the cast and the reshard between them): only y crosses the cut (before,
    the targets and the table crossed too, and more than the plan prices)."""
    gm, stage_of = _rotary_like()
    first, second = split_stages(gm, stage_of, 2, ["x", "t"], frozenset({"arange", "freqs", "table"}))
    assert (first.inputs, first.user_inputs, first.state, first.outputs) == ([], ["x"], ["inv"], ["y"])
    assert (second.inputs, second.user_inputs, second.state) == (["y"], ["t"], ["inv"])
    assert [n.target for n in second.gm.graph.nodes if n.op == "call_function"][:3] == [
        torch.ops.aten.arange.default, torch.ops.aten.mul.Tensor, torch.ops.aten._to_copy.default]
    x, t, inv = torch.randn(3), torch.randn(3), torch.randn(3)
    (sent,) = first.gm(x, inv)
    table = torch.cos((torch.arange(3.0) * inv).double())
    torch.testing.assert_close(second.gm(sent, t, inv), x * table + table - t)


def test_a_plan_op_of_constants_the_plan_sends_crosses() -> None:
    """Without the plan naming them ``constants`` (an input arriving by a collective, say), the ops
    of the table run once, in stage 0, and the table crosses, as the plan then prices it."""
    gm, stage_of = _rotary_like()
    first, second = split_stages(gm, stage_of, 2, ["x", "t"])
    assert (first.inputs, first.user_inputs, first.outputs) == ([], ["x"], ["table", "y"])
    assert (second.inputs, second.user_inputs, second.state) == (["table", "y"], ["t"], [])
    x, t, inv = torch.randn(3), torch.randn(3), torch.randn(3)
    table = torch.cos((torch.arange(3.0) * inv).double())
    torch.testing.assert_close(second.gm(*first.gm(x, inv), t), x * table + table - t)


def test_a_reshard_of_constants_read_by_two_later_stages_is_computed_in_each() -> None:
    """arange (stage 0) is resharded for readers in stages 1 and 2 (the reshard joins stage 1): stage 1
    computes arange again for its reshard, and stage 2 both again, rather than receive stage 1's copy
    (as the example Llama's rotary slices are read under interleaving)."""
    root = nn.Module()
    root.reshard = nn.Identity()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ar = graph.call_function(torch.ops.aten.arange.default, (3,), {"dtype": torch.float32}, name="arange")
    a = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0), name="a")
    r = graph.call_module("reshard", (ar,))
    b = graph.call_function(torch.ops.aten.add.Tensor, (a, r), name="b")
    c = graph.call_function(torch.ops.aten.mul.Tensor, (b, r), name="c")
    graph.output(c)
    for node, stage in ((ar, 0), (a, 0), (b, 1), (c, 2)):
        node.meta[PLAN_NAME] = node.name
    gm = torch.fx.GraphModule(root, graph)
    programs = split_stages(gm, {"arange": 0, "a": 0, "b": 1, "c": 2}, 3, ["x"], frozenset({"arange"}))
    assert [p.inputs for p in programs] == [[], ["a"], ["b"]]
    x = torch.randn(3)
    (sent,) = programs[0].gm(x)
    (sent,) = programs[1].gm(sent)
    torch.testing.assert_close(programs[2].gm(sent), (x * 2 + torch.arange(3.0)) * torch.arange(3.0))


def test_a_user_input_written_in_place_and_read_by_a_later_stage_is_refused() -> None:
    """Each stage reads the user inputs from its own micro-batch of them: one stage 0 writes in place
    would reach stage 1 unwritten, so the cut is refused (before, stage 1 received the written value)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    written = graph.call_function(torch.ops.aten.add_.Tensor, (x, 1.0))
    a = graph.call_function(torch.neg, (written,))
    b = graph.call_function(torch.mul, (x, a))
    graph.output(b)
    stage_of = {}
    for node, stage in ((written, 0), (a, 0), (b, 1)):
        node.meta[PLAN_NAME] = node.name
        stage_of[node.name] = stage
    gm = torch.fx.GraphModule(nn.Module(), graph)
    with pytest.raises(InputError, match="writes into its input x in place"):
        split_stages(gm, stage_of, 2, ["x"])
    split_stages(gm, {**stage_of, b.name: 0}, 1, ["x"])  # read only where written: fine
