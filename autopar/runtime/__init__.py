"""Stage 6: run per-rank programs on torch.distributed: parameter shards, gradient
synchronization, checkpoints. ``autopar.compile`` is the entry point."""

from autopar.runtime.compile import compile
from autopar.runtime.module import ParallelModule
from autopar.runtime.serving import ServingModule, compile_serving

__all__ = ["compile", "compile_serving", "ParallelModule", "ServingModule"]
