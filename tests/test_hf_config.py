"""Hugging Face models from a ``config.json``: ``autopar.hf.from_config`` builds the published shapes
shipped under ``examples/configs/`` on the meta device, and ``autopar plan --hf-config`` plans one,
its loss the one the model computes from ``labels``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.cli.main import main
from autopar.errors import InputError
from autopar.hf import from_config

pytest.importorskip("transformers")

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
PUBLISHED = {"llama-3-8b": ("LlamaForCausalLM", 8.03e9), "llama-3-70b": ("LlamaForCausalLM", 70.55e9),
             "mixtral-8x7b": ("MixtralForCausalLM", 46.70e9), "qwen1.5-moe-a2.7b": ("Qwen2MoeForCausalLM", 14.32e9),
             "gpt2": ("GPT2LMHeadModel", 0.124e9), "bert-base-uncased": ("BertForMaskedLM", 0.110e9)}
"""Each shipped config's class and its published parameter count (the model cards': 8B, 70B, 46.7B,
14.3B, 124M, 110M), to 1%."""

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
        "max_position_embeddings": 64}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_configs_build_the_published_shapes_on_meta(name: str) -> None:
    step = from_config(CONFIGS / f"{name}.json", batch=2, seq=128)
    cls, count = PUBLISHED[name]
    assert type(step.model).__name__ == cls
    assert all(p.device.type == "meta" for p in step.model.parameters())
    assert sum(p.numel() for p in step.model.parameters()) == pytest.approx(count, rel=0.01)
    (ids,) = step.example_inputs
    assert ids.shape == (2, 128) and step.example_kwargs["labels"] is ids and step.loss_fn is None


def test_every_shipped_config_names_its_source() -> None:
    readme = (CONFIGS / "README.md").read_text()
    assert {p.stem for p in CONFIGS.glob("*.json")} == set(PUBLISHED)
    for path in CONFIGS.glob("*.json"):
        assert f"`{path.name}`" in readme, path.name


def test_bad_configs_are_input_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such config file"):
        from_config(tmp_path / "missing.json", batch=1, seq=8)
    with pytest.raises(InputError, match="model_type"):
        from_config({"hidden_size": 8}, batch=1, seq=8)
    with pytest.raises(InputError, match="exceeds the 64 positions"):
        from_config(TINY, batch=1, seq=65)
    with pytest.raises(InputError, match="batch must be a positive"):
        from_config(TINY, batch=0, seq=8)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_plan_from_a_config_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``autopar plan --hf-config`` plans the HF model itself (its FQNs, its own loss from labels);
    a builder and a config together, or a config without the step's size, exit 2 saying why."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    code, out, err = run(["plan", "--hf-config", str(config), "--batch", "4", "--seq", "32", "--mesh", "dp=2,tp=2",
                          "--hardware", "cpu", "--width", "200", "--no-pipeline"], capsys)
    assert (code, err) == (0, ""), err
    assert "model.layers.0-1" in out and "self_attn.q_proj.weight" in out and "lm_head" in out
    code, _, err = run(["plan", "--hf-config", str(config), "--mesh", "dp=2"], capsys)
    assert code == 2 and "needs --batch and --seq" in err
    code, _, err = run(["plan", "x.py:build", "--hf-config", str(config), "--batch", "2", "--seq", "8",
                        "--mesh", "dp=2"], capsys)
    assert code == 2 and "one of the two" in err
    code, _, err = run(["plan", "--mesh", "dp=2"], capsys)
    assert code == 2 and "one of the two" in err


@pytest.mark.slow
def test_serving_plan_of_an_hf_model_as_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``plan_serving`` takes an HF causal LM itself (its slot-indexed cache adapter inside autopar), and
    ``autopar serve-plan --hf-config`` the config of one, built on the meta device in the config's dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import autopar

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}))
    workload = autopar.Workload(prompt_tokens=32, output_tokens=16, arrival_rate=10.0)
    slo = autopar.SLO(ttft_s=0.5, tpot_s=0.05)
    plan = autopar.plan_serving(model.to(torch.bfloat16), autopar.Cluster(devices=2), workload, slo, max_batch=8,
                                token_budget=64, disaggregated=False, tp_degrees=(2,), pp_degrees=(1,))
    assert plan.goodput_rps > 0
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY, "torch_dtype": "bfloat16"}))
    code, out, err = run(["serve-plan", "--hf-config", str(config), "--devices", "2", "--prompt", "32", "--output",
                          "16", "--rate", "10", "--ttft", "0.5", "--tpot", "0.05", "--max-batch", "8",
                          "--token-budget", "64", "--no-disaggregated", "--tp", "2", "--pp", "1", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["goodput_rps"] == pytest.approx(plan.goodput_rps)


def test_the_examples_published_shapes_are_the_shipped_configs() -> None:
    """The example Llama and MoE at a published shape read it from ``examples/configs/`` (no copied dims)."""
    from examples import llama, moe

    assert llama.LLAMA3_8B == llama.LlamaConfig(vocab_size=128256, max_seq_len=8192, hidden=4096, heads=32,
                                                kv_heads=8, ffn_hidden=14336, layers=32, rope_theta=500000.0)
    assert llama.LLAMA3_70B.hidden == 8192 and llama.LLAMA3_70B.layers == 80 and llama.LLAMA3_70B.ffn_hidden == 28672
    mixtral = moe.from_hf_config("mixtral-8x7b", layers=4)
    assert (mixtral.experts, mixtral.top_k, mixtral.ffn_hidden, mixtral.rope_theta) == (8, 2, 14336, 1e6)
