"""Stage 1: capture a model's training step as an aten FX graph with fake-tensor shapes."""

from autopar.capture.export import capture, reuse_captures
from autopar.capture.graph import CapturedGraph, TensorMeta

__all__ = ["capture", "reuse_captures", "CapturedGraph", "TensorMeta"]
