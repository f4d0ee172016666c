"""autopar: automatic DP/TP/SP parallelization of PyTorch models."""

from autopar.mesh import Mesh

__all__ = ["Mesh"]
