"""Stage 6: run per-rank programs on torch.distributed: parameter shards, gradient
synchronization, checkpoints. ``autopar.compile`` is the entry point."""

from autopar.runtime.compile import CompileError, compile
from autopar.runtime.module import ParallelModule

__all__ = ["compile", "CompileError", "ParallelModule"]
