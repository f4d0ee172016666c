"""Stage 3: what a strategy costs — compute (roofline), collectives (alpha-beta), memory."""

from autopar.cost.collectives import CollectiveCall, collective_time, reshard
from autopar.cost.compute import BACKWARD_FACTOR, VIEW_OPS, op_bytes, op_flops, roofline_time
from autopar.cost.precision import PRECISIONS, Precision, get_precision

__all__ = ["CollectiveCall", "collective_time", "reshard", "BACKWARD_FACTOR", "VIEW_OPS", "op_bytes",
           "op_flops", "roofline_time", "PRECISIONS", "Precision", "get_precision"]
