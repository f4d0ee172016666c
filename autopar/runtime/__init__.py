"""Stage 6: run a finished plan on torch.distributed: per-rank programs, parameter shards, gradient
synchronization, pipelined stages, checkpoints (``autopar.compile`` builds them: ``api.compiling``)."""

from autopar.runtime.module import ParallelModule
from autopar.runtime.serving import ServingModule

__all__ = ["ParallelModule", "ServingModule"]
