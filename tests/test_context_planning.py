"""Planning context parallelism: its price (the busiest rank of a causal split), the memory
limit choosing it, and ``context_axes`` (Python and the command line) with its errors."""

from __future__ import annotations

from dataclasses import replace

from pathlib import Path

import pytest
import torch
from test_cli import builder, run
from test_numerics_context import build as build_attention_lm

import autopar
from autopar.cost.collectives import CollectiveCall, collective_time
from autopar.cost.compute import attention_flops, rank_flops
from autopar.rules import DEFAULT_RULES, expand
from autopar.rules.strategy import OpCall, R, S
from autopar.capture.graph import TensorMeta
from examples import llama

aten = torch.ops.aten
SDPA = "aten.scaled_dot_product_attention.default"


def _causal_call(b: int = 1, h: int = 2, s: int = 16, d: int = 8) -> OpCall:
    q = TensorMeta.of(torch.empty(b, h, s, d))
    return OpCall(aten.scaled_dot_product_attention.default, (q, q, q, None, 0.0, True), {}, (q,))


def test_causal_rows_are_priced_at_the_busiest_rank() -> None:
    """Split on heads each rank does half of the causal work; split on its rows (contiguous
    chunks, an explicit mask), the rank with the last rows does its whole rows x keys
    rectangle: half of the non-causal work, twice its causal share."""
    call = _causal_call()
    strategies = expand(call, DEFAULT_RULES.lookup(call.target)(call), (2,))
    by_heads = next(s for s in strategies if s.inputs[0] == (S(1),))
    by_rows = next(s for s in strategies if s.inputs[0] == (S(2),))
    assert by_rows.inputs[1:] == ((R,), (R,))
    assert rank_flops(call, by_heads, 2) == attention_flops(call, causal=True) / 2
    assert rank_flops(call, by_rows, 2) == attention_flops(call, causal=False) / 2 == 2 * rank_flops(call, by_heads, 2)


def test_zigzag_rows_are_priced_near_balanced() -> None:
    """Zig-zag on n=2 ranks (4 chunks of c=4 rows of 16): rank 0 reads c keys for chunk 0 and 4c
    for chunk 3, rank 1 2c and 3c: (2n+1) c^2 = 80 pairs each, 5/4 of a balanced causal share."""
    call = _causal_call()
    by_rows = next(s for s in expand(call, DEFAULT_RULES.lookup(call.target)(call), (4,)) if s.inputs[0] == (S(2),))
    zigzag, contiguous = autopar.Mesh({"cp": 2}, "h100", zigzag=("cp",)), autopar.Mesh({"cp": 2}, "h100")
    assert rank_flops(call, by_rows, 2, contiguous) == attention_flops(call, causal=False) / 2
    assert rank_flops(call, by_rows, 2, zigzag) == attention_flops(call, causal=True) / 2 * 5 / 4


def test_zigzag_collectives_are_priced_with_their_reorder() -> None:
    """A gather on a zig-zag axis puts its pieces back in order (and a reduce-scatter or an
    all-to-all puts them in rank order first): one copy of its bytes at memory bandwidth."""
    zigzag, contiguous = autopar.Mesh({"cp": 2}, "h100", zigzag=("cp",)), autopar.Mesh({"cp": 2}, "h100")
    hw = zigzag.hardware
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        call = CollectiveCall(kind, 0, 2**30)
        extra = collective_time(call, zigzag) - collective_time(call, contiguous)
        assert extra == pytest.approx(2 * 2**30 / (hw.memory_bandwidth * hw.memory_efficiency))
    reduce = CollectiveCall("all_reduce", 0, 2**30)
    assert collective_time(reduce, zigzag) == collective_time(reduce, contiguous)


def _odd_heads_plan(layout: str | None, attention: str | None = "allgather") -> autopar.Plan:
    """12 heads (4 for keys) on cp=8: no heads split, so the sequence's query rows split
    (keys and values all-gathered unless ``attention`` says otherwise). On an H100 profile whose
    runtime ran ring attention (``HardwareProfile.ring_attention``; today's runs it on CPUs only)."""
    cfg = llama.LlamaConfig(vocab_size=32000, max_seq_len=65536, hidden=1536, heads=12, kv_heads=4, ffn_hidden=4096,
                            layers=2)
    with torch.device("meta"):
        model = llama.Llama(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len))
    h100 = replace(autopar.hardware.get_profile("h100"), ring_attention=True)
    return autopar.plan(model, autopar.Mesh({"cp": 8}, h100), (tokens,), loss_fn=llama.lm_loss,
                        example_targets=(tokens,), context_axes=("cp",), context_layout=layout,
                        context_attention=attention)


def test_the_faster_layout_is_kept() -> None:
    """Causal rows split on cp: zig-zag chunks balance them, so the planner (which prices both
    layouts) keeps the zig-zag plan, faster than the contiguous one (64k tokens: 32.8 against
    48.0 ms); the plan says so."""
    contiguous, chosen = _odd_heads_plan("contiguous"), _odd_heads_plan(None)
    assert {tuple(n.inputs) for n in chosen.nodes if n.op == SDPA} == {("S(2)", "R", "R")}
    assert chosen.mesh.get("zigzag") == ["cp"] and "zigzag" not in contiguous.mesh
    assert chosen.predicted.step_time_s < 0.8 * contiguous.predicted.step_time_s
    assert any("zig-zag" in n for n in chosen.notes), chosen.notes


def test_ring_attention_is_chosen_where_its_sends_hide() -> None:
    """The same 64k tokens, free to choose: ring attention, its K/V blocks (1.3 MB a step) sent
    under each block's attention (zig-zag: 2 chunk pairs, 4 ms a step forward), beats gathering
    K/V (32.4 against 32.8 ms: each rank's causal pairs exactly a balanced share, against
    (2n+1)/2n of it with rows, and no gathered K/V kept: 4.5 against 4.7 GiB); the plan says so."""
    ring, gathered = _odd_heads_plan(None, None), _odd_heads_plan(None)
    assert {tuple(n.inputs) for n in ring.nodes if n.op == SDPA} == {("S(2)", "S(2)", "S(2)")}
    assert ring.predicted.step_time_s < gathered.predicted.step_time_s
    assert ring.predicted.peak_memory_bytes < gathered.predicted.peak_memory_bytes
    sends = [c for c in ring.collectives if c.kind == "send_recv"]
    assert sends and all(c.waited_s is not None and c.waited_s < c.time_s for c in sends if c.phase == "forward")
    assert any("ring attention (" in n and "in 2 of 2 calls" in n and "zig-zag" in n for n in ring.notes), ring.notes


def test_a_zigzag_layout_is_refused_where_it_cannot_be() -> None:
    model, inputs, loss_fn, targets = build_attention_lm(None, masked=True)
    with pytest.raises(autopar.InputError, match="context_layout='zigzag': zig-zag balances causal attention"):
        autopar.plan(model, autopar.Mesh({"cp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     context_axes=("cp",), context_layout="zigzag")
    with pytest.raises(autopar.InputError, match="context_layout is 'contiguous', 'zigzag' or None"):
        autopar.plan(model, autopar.Mesh({"cp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     context_axes=("cp",), context_layout="ring")


def _long_llama() -> tuple[torch.nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """One head (nothing to split there), a batch of 1 and 512 tokens: the activations are
    the memory, and only the sequence splits them."""
    cfg = llama.LlamaConfig(vocab_size=64, max_seq_len=512, hidden=32, heads=1, kv_heads=1, ffn_hidden=64, layers=2)
    return llama.build(cfg, batch=1)


def test_a_binding_memory_limit_picks_context_parallelism() -> None:
    """With memory to spare the attention runs whole on every rank (the cheapest step); at a
    limit the activations do not fit under, its rows split over cp, keys and values gathered."""
    model, inputs, loss_fn, targets = _long_llama()
    mesh = autopar.Mesh({"cp": 2}, "h100")
    free = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets)
    assert all(n.inputs == ["R", "R", "R"] for n in free.nodes if n.op == SDPA)
    # 0.6 of it fits with the blocks' parameters gathered again in backward and attention whole (1.318 of
    # 1.320 MB) since the compute copy is planned (bf16 internals, the fp32 the model upcasts to)
    limit = 0.55 * free.predicted.peak_memory_bytes
    tight = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, memory_limit=limit)
    assert tight.predicted.peak_memory_bytes <= limit
    assert [n.inputs for n in tight.nodes if n.op == SDPA] == [["S(2)", "R", "R"]] * 2
    assert tight.predicted.comm_bytes["cp"] > free.predicted.comm_bytes.get("cp", 0.0)
    assert "context parallel attention on cp: all-gather K/V (query rows split, keys and values gathered) " \
           "in 2 of 2 calls" in tight.notes  # the plan says which kind
    assert not any("context parallel" in n for n in free.notes)


def test_zero3_on_the_context_axis_stores_parameters_split() -> None:
    """``zero={"cp": 3}`` with ``context_axes=("cp",)``: parameters are stored split on cp (FSDP
    over the context axis, as Llama 3 trained), not pinned replicated as plain context
    parallelism pins them; the sequence stays split."""
    model, inputs, loss_fn, targets = _long_llama()
    mesh = autopar.Mesh({"cp": 2}, "h100")
    plan = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, context_axes=("cp",),
                        zero={"cp": 3})
    weights = [n for n in plan.nodes if n.op == "parameter" and n.name.endswith("_wq_weight")]
    assert weights and all(n.outputs[0].startswith("S(") for n in weights), [n.outputs for n in weights]
    inputs_placed = [n.outputs[0] for n in plan.nodes if n.op == "input"]
    assert inputs_placed and all(p == "S(1)" for p in inputs_placed), inputs_placed


def test_a_heads_split_on_a_sequence_axis_is_noted_as_ulysses() -> None:
    """Attention split on heads on an axis the inputs are split on by sequence reaches its heads
    by all-to-alls (Ulysses), and the plan says so; a heads split on a tensor-parallel axis
    (inputs whole there) is Megatron TP, not context parallelism."""
    cfg = llama.LlamaConfig(vocab_size=64, max_seq_len=16, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, layers=2)
    model, inputs, loss_fn, targets = llama.build(cfg, batch=1)
    cp = autopar.plan(model, autopar.Mesh({"cp": 2}, "h100"), inputs, loss_fn=loss_fn, example_targets=targets,
                      context_axes=("cp",), zero={"cp": 3})
    assert [n.inputs[0] for n in cp.nodes if n.op == SDPA] == ["S(1)", "S(1)"]
    assert any(n.startswith("context parallel attention on cp: Ulysses") and n.endswith("in 2 of 2 calls")
               for n in cp.notes), cp.notes
    tp = autopar.plan(model, autopar.Mesh({"tp": 2}, "h100"), inputs, loss_fn=loss_fn, example_targets=targets,
                      constraints=llama.TP_PLAN)
    assert [n.inputs[0] for n in tp.nodes if n.op == SDPA] == ["S(1)", "S(1)"]
    assert not any("context parallel" in n for n in tp.notes)


@pytest.mark.parametrize("mesh,layout,heads,splits", [
    ({"cp": 4}, None, (4, 2), False), ({"cp": 2}, "zigzag", (4, 2), False), ({"cp": 2}, "zigzag", (4, 4), True)],
    ids=["cp4-kv2", "zigzag-cp2-kv2", "zigzag-cp2-kv4"])
def test_ulysses_needs_heads_that_divide(mesh: dict[str, int], layout: str | None, heads: tuple[int, int],
                                          splits: bool) -> None:
    """Pinned Ulysses splits heads and key/value heads on cp (a zig-zag axis cuts every dim it
    splits into 2n chunks, heads too), and the activations must stay split there: where they do
    not divide it is refused by name, not left to the solver with no strategy to choose."""
    cfg = llama.LlamaConfig(vocab_size=64, max_seq_len=16, hidden=32, heads=heads[0], kv_heads=heads[1],
                            ffn_hidden=64, layers=1)
    model, inputs, loss_fn, targets = llama.build(cfg, batch=1)
    options = {"loss_fn": loss_fn, "example_targets": targets, "context_axes": ("cp",),
               "context_attention": "ulysses", "context_layout": layout}
    if not splits:
        with pytest.raises(autopar.InputError, match="no strategy splitting its heads"):
            autopar.plan(model, autopar.Mesh(mesh, "cpu"), inputs, **options)
        return
    plan = autopar.plan(model, autopar.Mesh(mesh, "cpu"), inputs, **options)
    assert [n.inputs for n in plan.nodes if n.op == SDPA] == [["S(1)"] * 3] and plan.mesh["zigzag"] == ["cp"]


@pytest.mark.parametrize("options,message", [
    ({"context_axes": ("sp",)}, "context axis 'sp' is not an axis of the mesh"),
    ({"context_axes": "cp"}, "must be a tuple of axis names"),
    ({"context_axes": ("cp", "cp")}, "names an axis twice"),
    ({"context_axes": ("cp",), "data_axes": ("cp",)}, "both data_axes and context_axes"),
    ({"context_axes": ("cp",), "data_axes": ("dp",), "input_sharded": True}, "inputs arrive split along data axes"),
], ids=["unknown", "string", "twice", "also-data", "input-sharded"])
def test_bad_context_axes_are_refused(options: dict[str, object], message: str) -> None:
    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(max_seq_len=8, layers=1), batch=2)
    with pytest.raises(autopar.InputError, match=message):
        autopar.plan(model, autopar.Mesh({"dp": 2, "cp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                     example_targets=targets, **options)


def test_context_axes_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = """
    from examples import llama

    def tiny():
        return llama.build(llama.LlamaConfig(max_seq_len=8, layers=1), batch=1)
    """
    path = builder(tmp_path, body)
    code, out, err = run(["plan", f"{path}:tiny", "--mesh", "cp=2", "--hardware", "cpu", "--context-axes", "cp",
                          "--width", "200"], capsys)
    assert (code, err) == (0, "")
    assert "context parallel (sequence split)" in out, out
    code, out, err = run(["plan", f"{path}:tiny", "--mesh", "cp=2", "--hardware", "cpu", "--context-axes", "cp",
                          "--context-layout", "zigzag", "--width", "200"], capsys)
    assert (code, err) == (0, "")
    assert "cp zig-zag" in out and "context parallel (sequence split), zig-zag" in out, out
    code, out, err = run(["plan", f"{path}:tiny", "--mesh", "cp=2", "--hardware", "cpu", "--context-axes", "sp"],
                         capsys)
    assert code == 2 and "context axis 'sp' is not an axis of the mesh" in err, err
