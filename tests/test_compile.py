"""``autopar.compile`` as a first-time user calls it: Hugging Face models with ``labels=``,
keyword inputs by name, and clear errors when a call does not match the compiled step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.runtime.forked import run_ranks
from examples import hf_models


def _hf_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    model, (ids,), _, _, _ = hf_models.build_llama()
    model.eval()  # dropout off: masks cannot match across layouts
    return model, ids


def _hf_labels_rank(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, ids = _hf_llama()
    pm = autopar.compile(model, mesh, (ids,), example_kwargs={"labels": ids})
    loss = pm(ids, labels=ids)
    loss.backward()
    grads = {k: DTensor.from_local(p.grad, mesh, pm.state_dict()[k].placements, run_check=False).full_tensor().tolist()
             for k, p in pm.named_parameters()}
    errors = {}
    for name, call in {"missing": lambda: pm(ids), "unexpected": lambda: pm(ids, labels=ids, mask=ids),
                       "positional": lambda: pm(ids, ids, labels=ids), "none": lambda: pm(labels=ids)}.items():
        with pytest.raises(TypeError) as info:
            call()
        errors[name] = str(info.value)
    return {"loss": loss.full_tensor().item(), "grads": grads, "names": [k for k, _ in pm.named_parameters()],
            "errors": errors}


def test_hf_model_called_with_labels_compiles_under_its_own_names() -> None:
    """``compile(..., example_kwargs={"labels": ids})`` with ``loss_fn=None``, called as
    ``pm(ids, labels=ids)``: HF's parameter names, HF's loss and every gradient."""
    model, ids = _hf_llama()
    ref = model(ids, labels=ids).loss
    ref.backward()
    for r in run_ranks(_hf_labels_rank, 4):
        assert r["names"] == [k for k, _ in model.named_parameters()]
        assert r["loss"] == pytest.approx(ref.item(), rel=1e-5)
        for k, p in model.named_parameters():
            torch.testing.assert_close(torch.tensor(r["grads"][k]), p.grad, rtol=1e-4, atol=1e-5, msg=k)
        errors = r["errors"]
        assert "missing keyword input 'labels'" in errors["missing"]
        assert "unexpected keyword input 'mask'" in errors["unexpected"] and "labels" in errors["unexpected"]
        assert "1 positional value" in errors["positional"] and "got 2" in errors["positional"]
        assert "got 0" in errors["none"]
