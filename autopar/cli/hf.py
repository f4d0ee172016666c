"""``--hf-config config.json`` for ``autopar plan`` (with ``--batch``, ``--seq``) and ``autopar serve-plan``:
the model a Hugging Face config describes, built on the meta device, in place of a builder file."""

from __future__ import annotations

import argparse
from typing import Any

from autopar.errors import InputError


def add_options(p: argparse.ArgumentParser, training: bool, positive: Any) -> None:
    """The ``--hf-config`` options; the builder argument becomes optional (one of the two is given)."""
    hf = p.add_argument_group("a Hugging Face config instead of a builder file")
    hf.add_argument("--hf-config", metavar="CONFIG.json", default=None,
                    help="plan the model this config.json describes (its architectures[0], else the family's causal "
                         "LM), built on the meta device; e.g. examples/configs/llama-3-8b.json")
    if training:
        hf.add_argument("--batch", type=positive(int), default=None, help="with --hf-config: sequences per step")
        hf.add_argument("--seq", type=positive(int), default=None, help="with --hf-config: tokens per sequence")


def check(args: argparse.Namespace, training: bool) -> None:
    """Exactly one of a builder and ``--hf-config``; ``--batch`` and ``--seq`` with ``--hf-config`` only."""
    if (args.builder is None) == (args.hf_config is None):
        raise InputError("give a builder FILE.py:FUNCTION or --hf-config CONFIG.json (one of the two)")
    if not training:
        return
    if args.hf_config is None and (args.batch is not None or args.seq is not None):
        raise InputError("--batch and --seq size the example step of --hf-config; a builder makes its own")
    if args.hf_config is not None and (args.batch is None or args.seq is None):
        raise InputError("--hf-config needs --batch and --seq (the example step's sequences and tokens)")


def training_step(args: argparse.Namespace) -> tuple[Any, tuple, None, tuple, dict[str, Any]]:
    """(model, inputs, loss_fn, targets, kwargs) of ``--hf-config``: the loss the model computes from labels."""
    from autopar.hf import from_config

    return tuple(from_config(args.hf_config, batch=args.batch, seq=args.seq))  # type: ignore[return-value]


def serving_model(args: argparse.Namespace) -> Any:
    """The causal LM of ``--hf-config`` on the meta device, in the config's dtype, servable."""
    from autopar.hf import servable

    return servable(args.hf_config)
