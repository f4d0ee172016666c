"""autopar: automatic DP/TP/SP parallelization of PyTorch models.

``autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 4}), example_inputs=...)`` returns the
cheapest placement of one training step on that mesh. ``Cluster``, ``Workload`` and ``SLO``
describe a serving deployment's inputs; ``autopar.plan_serving`` plans one (``autopar.serving``).
"""

from autopar import random
from autopar.api import plan
from autopar.capture import CaptureError
from autopar.errors import InputError, InputTypeError
from autopar.mesh import Mesh
from autopar.runtime import CompileError, ParallelModule, ServingModule, compile, compile_serving
from autopar.serving.planner import plan_serving
from autopar.serving.serving_plan import ServingPlan
from autopar.serving.workload import SLO, Cluster, Workload
from autopar.solver.ilp import MemoryLimitError, SolverTimeLimitError
from autopar.solver.pipeline import Pipeline
from autopar.solver.plan import Plan

__all__ = ["plan", "compile", "compile_serving", "ServingModule", "Mesh", "Pipeline", "Plan", "ParallelModule",
           "InputError", "InputTypeError", "CaptureError", "CompileError", "MemoryLimitError", "SolverTimeLimitError",
           "Cluster", "Workload", "SLO", "plan_serving", "ServingPlan", "random"]
