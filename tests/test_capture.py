"""Stage 1, capture: models become aten graphs with shapes on every node and the user's FQNs."""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autopar.errors import CaptureError
from autopar.capture import CapturedGraph, capture
from autopar.capture.graph import TensorMeta
from examples import gpt, llama

EXAMPLES = {"gpt": gpt, "llama": llama}


def output_values(cg: CapturedGraph) -> list[object]:
    return [a.meta["val"] for a in tree_leaves(cg.gm.graph.output_node().args[0])]


def assert_every_node_has_shape(cg: CapturedGraph) -> None:
    """Each placeholder and op has ``meta["val"]``; each tensor in it has a concrete shape."""
    tensors = 0
    for node in cg.gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        assert "val" in node.meta, f"{node.format_node()} has no meta['val']"
        for value in tree_leaves(node.meta["val"]):
            if isinstance(value, torch.Tensor):
                assert all(isinstance(s, int) for s in value.shape), f"{node.name}: {value.shape}"
                tensors += 1
    assert tensors > 20


def assert_scalar_loss(cg: CapturedGraph) -> None:
    (loss,) = output_values(cg)
    assert isinstance(loss, torch.Tensor) and loss.shape == () and loss.dtype.is_floating_point
    assert cg.train


def assert_fqns_match(cg: CapturedGraph, model: nn.Module) -> None:
    """One placeholder per parameter, named by the FQN ``model.named_parameters()`` gives it."""
    fqns = list(cg.parameters.values())
    assert sorted(fqns) == sorted(name for name, _ in model.named_parameters())
    nodes = {node.name: node for node in cg.gm.graph.nodes if node.op == "placeholder"}
    for placeholder, fqn in cg.parameters.items():
        assert nodes[placeholder].meta["val"].shape == model.get_parameter(fqn).shape, fqn


def feeds(node: torch.fx.Node, target: object) -> bool:
    """Whether ``node``'s value flows into some op ``target``."""
    seen, todo = set(), list(node.users)
    while todo:
        user = todo.pop()
        if user.target is target:
            return True
        if user not in seen:
            seen.add(user)
            todo.extend(user.users)
    return False


# ---------------------------------------------------------------- examples/gpt.py, examples/llama.py


@pytest.fixture(scope="module", params=sorted(EXAMPLES))
def example(request: pytest.FixtureRequest) -> tuple[nn.Module, tuple[torch.Tensor, ...], CapturedGraph]:
    model, inputs, loss_fn, targets = EXAMPLES[request.param].build(batch=2)
    return model, inputs, capture(model, inputs, loss_fn=loss_fn, example_targets=targets)


def test_example_nodes_have_shapes(example) -> None:
    assert_every_node_has_shape(example[2])


def test_example_output_is_scalar_loss(example) -> None:
    assert_scalar_loss(example[2])


def test_example_parameters_and_buffers(example) -> None:
    model, _, cg = example
    assert_fqns_match(cg, model)
    assert cg.tied == {}
    assert sorted(cg.buffers.values()) == sorted(name for name, _ in model.named_buffers())
    assert len(cg.user_inputs) == 2  # tokens, then the loss targets


def test_example_forward_only_returns_logits(example) -> None:
    model, inputs, _ = example
    cg = capture(model, inputs, train=False)
    (logits,) = output_values(cg)
    assert logits.shape == (*inputs[0].shape, model.cfg.vocab_size)
    assert not cg.train
    assert len(cg.user_inputs) == 1
    assert_fqns_match(cg, model)


# ---------------------------------------------------------------- Hugging Face models


@pytest.fixture(scope="module")
def hf():
    from examples import hf_models  # needs transformers, a dev dependency

    return hf_models


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf_captured(request: pytest.FixtureRequest, hf) -> tuple[str, nn.Module, CapturedGraph]:
    model, (ids,), *_ = getattr(hf, f"build_{request.param}")()
    # HF computes its own loss from labels; the same tensor as input and labels, as HF users do.
    return request.param, model, capture(model, (ids,), example_kwargs={"labels": ids})


def test_hf_captures_loss_with_sdpa(hf_captured) -> None:
    _, _, cg = hf_captured
    assert_scalar_loss(cg)
    assert_every_node_has_shape(cg)
    targets = {node.target for node in cg.gm.graph.nodes}
    assert torch.ops.aten.scaled_dot_product_attention.default in targets
    assert torch.ops.aten.cross_entropy_loss.default in targets


def test_hf_inputs_and_labels_keep_their_own_placeholders(hf_captured) -> None:
    _, _, cg = hf_captured
    nodes = {node.name: node for node in cg.gm.graph.nodes if node.op == "placeholder"}
    ids, labels = cg.user_inputs
    assert feeds(nodes[ids], torch.ops.aten.embedding.default)
    assert not feeds(nodes[labels], torch.ops.aten.embedding.default)
    assert feeds(nodes[labels], torch.ops.aten.cross_entropy_loss.default)


def test_hf_parameter_fqns_are_hf_names(hf_captured) -> None:
    name, model, cg = hf_captured
    assert_fqns_match(cg, model)
    assert {n for n, _ in model.named_buffers()} <= set(cg.buffers.values())
    if name == "llama":
        assert cg.tied == {} and "lm_head.weight" in cg.parameters.values()
        return
    # GPT-2 ties lm_head.weight to transformer.wte.weight. Export gives each name a placeholder
    # and uses only one; capture keeps the one named_parameters() reports and records the alias.
    assert model.lm_head.weight is model.transformer.wte.weight
    assert cg.tied == {"lm_head.weight": "transformer.wte.weight"}
    (wte,) = [p for p, fqn in cg.parameters.items() if fqn == "transformer.wte.weight"]
    node = next(n for n in cg.gm.graph.nodes if n.name == wte)
    assert {user.target for user in node.users} == {torch.ops.aten.embedding.default,
                                                     torch.ops.aten.linear.default}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_eager_attention(hf, name: str) -> None:
    model, inputs, loss_fn, targets, kwargs = getattr(hf, f"build_{name}")(attn_implementation="eager")
    cg = capture(model, inputs, loss_fn=loss_fn, example_targets=targets, example_kwargs=kwargs)
    assert_scalar_loss(cg)
    targets_ = {node.target for node in cg.gm.graph.nodes}
    assert torch.ops.aten.scaled_dot_product_attention.default not in targets_
    assert torch.ops.aten.softmax.int in targets_


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_step_builder_matches_hf_loss(hf, name: str) -> None:
    """``build_*_step`` has examples/gpt.py's build() shape and computes HF's own loss."""
    model, inputs, loss_fn, targets = getattr(hf, f"build_{name}_step")(batch=2)
    with torch.no_grad():
        torch.manual_seed(1)  # GPT-2 keeps HF's dropout: same seed, same masks
        ours = loss_fn(model(*inputs), *targets)
        torch.manual_seed(1)
        theirs = model(*inputs, labels=inputs[0]).loss
    torch.testing.assert_close(ours, theirs)
    cg = capture(model, inputs, loss_fn=loss_fn, example_targets=targets)
    assert_scalar_loss(cg)
    assert_fqns_match(cg, model)


def test_hf_models_module_imports_transformers_lazily() -> None:
    """transformers takes seconds to import; examples/hf_models.py defers it to the builders."""
    source = Path(__file__).resolve().parents[1] / "examples" / "hf_models.py"
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Import):
            assert not any(alias.name.startswith("transformers") for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("transformers")


# ---------------------------------------------------------------- meta device


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_meta_llama_7b_layers_capture_without_weight_memory() -> None:
    capture(nn.Linear(4, 4), (torch.randn(2, 4),), loss_fn=lambda out: out.sum())  # warm the tracer
    cfg = llama.LlamaConfig(hidden=4096, heads=32, kv_heads=8, ffn_hidden=11008, layers=4,
                            vocab_size=32000, max_seq_len=2048)
    before = resident_bytes()
    with torch.device("meta"):
        model = llama.Llama(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len))
    cg = capture(model, (tokens,), loss_fn=llama.lm_loss, example_targets=(tokens.roll(-1, 1),))
    grown = resident_bytes() - before

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes > 3 * 2**30  # ~3.6 GiB of fp32 weights, were they real
    assert grown < 256 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB"
    assert all(p.is_meta for p in model.parameters())
    assert_scalar_loss(cg)
    assert_fqns_match(cg, model)
    shapes = {tuple(n.meta["val"].shape) for n in cg.gm.graph.nodes
              if n.target is torch.ops.aten.linear.default}
    assert (1, 2048, 11008) in shapes and (1, 2048, 32000) in shapes


# ---------------------------------------------------------------- errors


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            y = y * 2
        return y


def test_data_dependent_branch_names_the_source_line() -> None:
    lines, first = inspect.getsourcelines(DataDependent.forward)
    offset = next(i for i, line in enumerate(lines) if "if y.sum() > 0:" in line)
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(2, 8),), loss_fn=lambda out: out.sum())
    message = str(info.value)
    assert f"{Path(__file__).name}:{first + offset}: if y.sum() > 0:" in message
    assert "data-dependent" in message


def test_non_scalar_loss_fn_is_rejected() -> None:
    with pytest.raises(CaptureError, match="loss_fn must return a one-element tensor"):
        capture(nn.Linear(8, 8), (torch.randn(2, 8),), loss_fn=lambda out: out * 2)


def test_model_returning_logits_needs_a_loss_fn() -> None:
    with pytest.raises(CaptureError, match="loss_fn"):
        capture(nn.Linear(8, 8), (torch.randn(2, 8),))


def test_forward_only_accepts_a_model_returning_logits() -> None:
    cg = capture(nn.Linear(8, 8), (torch.randn(2, 8),), train=False)
    assert [tuple(v.shape) for v in output_values(cg)] == [(2, 8)]
    assert sorted(cg.parameters.values()) == ["bias", "weight"]



def test_reuse_captures_traces_each_shape_once() -> None:
    """Inside ``reuse_captures`` the same model, loss and argument shapes give the graph captured first;
    another shape traces again; a plan made on a reused capture is the same plan. Outside, the
    process keeps a model's captures while the model is unchanged (``capture.kept``): a parameter
    frozen since, or ``forget``, traces again."""
    import autopar
    from autopar.capture import kept, reuse_captures

    kept.forget()
    model, inputs, loss_fn, targets = gpt.build(batch=4)
    with reuse_captures():
        first = capture(model, inputs, loss_fn=loss_fn, example_targets=targets)
        again = capture(model, (inputs[0].clone(),), loss_fn=loss_fn, example_targets=targets)
        other = capture(model, (inputs[0][:2],), loss_fn=loss_fn, example_targets=(targets[0][:2],))
        reused = autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets)
        assert capture(model, inputs, loss_fn=loss_fn, example_targets=targets) is first
    assert again is first and other is not first
    assert capture(model, inputs, loss_fn=loss_fn, example_targets=targets) is first  # kept for the process
    kept.forget()
    traced = capture(model, inputs, loss_fn=loss_fn, example_targets=targets)
    assert traced is not first
    plan = autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets)
    assert reused.predicted == plan.predicted and reused.plan_hash() == plan.plan_hash()
    next(model.parameters()).requires_grad_(False)  # the step changed: traced again
    assert capture(model, inputs, loss_fn=loss_fn, example_targets=targets) is not traced


class LoopMoE(nn.Module):
    """Mixtral as transformers 4 wrote it: a loop over experts, each taking the tokens routed to it
    (``torch.where``), so each expert's batch has a size only the routing knows."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


def test_data_dependent_sizes_are_kept_symbolic_and_planned_at_their_example_size() -> None:
    """torch.export captures the loop with unbacked sizes: the graph keeps them symbolic, planning reads
    each at its size on the example inputs (the tokens routed to that expert), those dims marked ragged."""
    torch.manual_seed(0)
    model, x = LoopMoE(), torch.randn(16, 8)
    captured = capture(model, (x,), loss_fn=lambda y, t: (y - t).square().mean(), example_targets=(x,))
    with torch.no_grad():
        chosen = model.router(x).softmax(-1).topk(2, dim=-1)[1]
    counts = sorted(int((chosen == e).sum()) for e in range(4))
    assert sorted(captured.size_hints.values()) == counts and sum(counts) == 32
    wheres = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.where.default]
    assert len(wheres) == 4 and all(free_unbacked_symbols(n.meta["val"][0].shape[0]) for n in wheres)
    metas = [TensorMeta.of(n.meta["val"][0], captured.size_hints) for n in wheres]
    assert sorted(m.shape[0] for m in metas) == counts and all(m.ragged == frozenset({0}) for m in metas)
    assert any("data-dependent sizes planned at their size on the example inputs" in n for n in captured.notes)


def test_blocks_making_data_dependent_sizes_are_traced_in_full() -> None:
    """A stack of such blocks is not replicated from a short trace (each copy would need sizes of its own):
    traced in full, every block's experts get their own symbols and hints."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(LoopMoE() for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = x + layer(x)
            return x

    x = torch.randn(16, 8)
    captured = capture(Stack(), (x,), loss_fn=lambda y, t: (y - t).square().mean(), example_targets=(x,))
    assert any("blocks not replicated: layers: the blocks make data-dependent sizes" in n for n in captured.notes)
    assert len(captured.size_hints) == 16


def test_data_dependent_sizes_on_the_meta_device_are_planned_at_their_expectation() -> None:
    """A meta-device model cannot route its example inputs: a top-k choice of one expert is planned at
    its expectation (tokens x k / experts); a data-dependent size of another kind is refused by name."""
    with torch.device("meta"):
        model = LoopMoE()
    captured = capture(model, (torch.randn(16, 8),), loss_fn=lambda y, t: (y - t).square().mean(),
                       example_targets=(torch.randn(16, 8),))
    assert sorted(captured.size_hints.values()) == [8] * 4  # 16 tokens x top-2 / 4 experts
    assert any("planned at the expected tokens per expert" in n for n in captured.notes)

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x[x[:, 0] > 0]).sum(0)

    with torch.device("meta"):
        masked = Masked()
    with pytest.raises(CaptureError, match=r"(?s)data-dependent size.*no size is known for u\d+ \(the model is on "
                                           r"the meta device.*in module 'model'"):
        capture(masked, (torch.randn(16, 8),), loss_fn=lambda y: y.sum())


def test_hf_eager_experts_are_refused_with_what_to_use_instead() -> None:
    """HF's "eager" experts loop over the experts a batch routes to (a trip count from data, which no
    captured graph holds): the error says to build the model with the default experts instead."""
    pytest.importorskip("transformers")
    from examples import hf_models
    model, inputs, loss_fn, targets = hf_models.build_mixtral_step(
        batch=2, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=64, seq=8, experts_implementation="eager")
    with pytest.raises(CaptureError, match="experts_implementation='eager'.*'grouped_mm'"):
        capture(model, inputs, loss_fn=loss_fn, example_targets=targets)


def test_a_dense_hf_model_branching_on_data_gets_no_experts_hint() -> None:
    """Transformers sets ``config._experts_implementation = "eager"`` on every model, experts or not:
    a dense Llama whose step branches on a value is told about the branch, not about experts."""
    pytest.importorskip("transformers")
    from examples import hf_models
    model, inputs, loss_fn, targets = hf_models.build_llama_step(batch=2, layers=1, hidden=16, heads=2, kv_heads=2,
                                                                 intermediate=32, vocab=32, seq=8)
    assert model.config._experts_implementation == "eager"

    def branching_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(out, labels)
        return loss if loss > 1 else 2 * loss

    with pytest.raises(CaptureError, match="branches or loops on values") as info:
        capture(model, inputs, loss_fn=branching_loss, example_targets=targets)
    assert "experts" not in str(info.value)


def _mixtral_graph(dtype: torch.dtype = torch.float32, **config: Any) -> tuple[Any, CapturedGraph]:
    """A tiny HF Mixtral (default experts) in ``dtype`` with ``config`` overrides, and its captured step."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=64, max_position_embeddings=16, num_local_experts=4,
                        num_experts_per_tok=2, use_cache=False, **config)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).to(dtype)
    ids = torch.randint(0, 64, (2, 16))
    return model, capture(model, (ids,), loss_fn=lambda out, t: out.logits.float().mean(), example_targets=(ids,))


def test_hf_sorted_expert_region_is_captured_as_one_op() -> None:
    """HF's default experts (sort, gather, two grouped matmuls, inverse permutation, sum) become one
    ``autopar::moe_experts`` call per layer, reading the tokens, the router's choices and weights and
    the two stacked weights, which computes what the region did; in bf16 too (compile's mixed
    precision captures a bf16 copy: ``aten._grouped_mm``, the rows weighted and summed in fp32 and
    cast back); a region of another form (a GELU between the grouped matmuls) is left as captured."""
    pytest.importorskip("transformers")
    from autopar.capture.moe import MOE_EXPERTS

    model, captured = _mixtral_graph()
    calls = [n for n in captured.gm.graph.nodes if n.target is MOE_EXPERTS]
    assert len(calls) == 2 and any("2 sorted dropless expert regions" in note for note in captured.notes)
    targets = {str(n.target) for n in captured.gm.graph.nodes}
    assert not targets & {"aten.sort.default", "transformers.grouped_mm_fallback.default", "aten.histc.default"}
    params = [captured.parameters[a.name] for a in calls[0].args[3:5]]
    assert params == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    experts = model.model.layers[0].mlp.experts
    x, weights = torch.randn(32, 32), torch.rand(32, 2)
    ids = torch.rand(32, 4).argsort(dim=1)[:, :2]
    op = MOE_EXPERTS(x, ids, weights, experts.gate_up_proj, experts.down_proj, calls[0].args[5])
    torch.testing.assert_close(op, experts(x, ids, weights), rtol=1e-5, atol=1e-6)
    _, bf16 = _mixtral_graph(torch.bfloat16)
    assert [str(n.args[5]) for n in bf16.gm.graph.nodes if n.target is MOE_EXPERTS] == ["aten::_grouped_mm"] * 2
    _, other = _mixtral_graph(hidden_act="gelu")
    assert not any(n.target is MOE_EXPERTS for n in other.gm.graph.nodes)
    assert sum(str(n.target) == "transformers.grouped_mm_fallback.default" for n in other.gm.graph.nodes) == 4


class _CacheHolder:
    """Not a module: the way a Hugging Face ``Cache`` holds its tensors."""

    def __init__(self) -> None:
        self.keys = torch.zeros(4, 8)


class _CacheThroughObject(nn.Module):
    """Registers the holder's tensor as a buffer (as transformers' export wrapper registers its
    ``StaticCache``) but writes and reads it through the holder."""

    def __init__(self) -> None:
        super().__init__()
        self.holder = _CacheHolder()
        self.register_buffer("cache", self.holder.keys, persistent=False)

    def forward(self, x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        self.holder.keys.index_copy_(0, at, x)
        return self.holder.keys.sum(0)


def test_a_buffer_reached_through_another_object_is_read_as_the_buffer() -> None:
    """Export lifts such a tensor again as a constant; capture reads the buffer instead, so the
    write lands in the module's state (the program is handed the buffer), not in a copy."""
    cg = capture(_CacheThroughObject(), (torch.ones(1, 8), torch.tensor([2])), train=False)
    assert cg.constants == {}
    writes = [n for n in cg.gm.graph.nodes if n.target is torch.ops.aten.index_copy_.default]
    assert len(writes) == 1 and cg.buffers.get(writes[0].args[0].name) == "cache", cg.buffers


def test_a_kept_capture_serves_only_an_unchanged_model() -> None:
    """What a trace may read besides tensor values changes the model's fingerprint (``capture.kept``):
    a hyperparameter, the mode, a forward set on the instance, a Hugging Face config, a parameter's
    shape or ``requires_grad``, a tied weight. Tensor values do not."""
    from types import MethodType

    from autopar.capture.kept import fingerprint
    from examples.hf_models import build_llama

    model = gpt.build()[0]
    before = fingerprint(model)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert fingerprint(model) == before
    changes = [lambda m: m.eval(), lambda m: setattr(m.blocks[0].attn, "heads", 2),
               lambda m: setattr(m.ln_f, "forward", MethodType(lambda self, x: x, m.ln_f)),
               lambda m: m.lm_head.weight.requires_grad_(False),
               lambda m: setattr(m.lm_head, "weight", m.wte.weight)]
    for change in changes:
        model = gpt.build()[0]
        change(model)
        assert fingerprint(model) != before
    llama = build_llama()[0]
    seen = fingerprint(llama)
    llama.config.rms_norm_eps = 1e-3
    assert fingerprint(llama) != seen
