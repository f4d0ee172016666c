"""autopar: automatic DP/TP/SP parallelization of PyTorch models.

``autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 4}), example_inputs=...)`` returns the
cheapest placement of one training step on that mesh. ``Cluster``, ``Workload`` and ``SLO``
describe a serving deployment's inputs; ``autopar.plan_serving`` plans one (``autopar.serving``).
"""

from autopar import random
from autopar.api import compile, compile_serving, plan_serving
from autopar.api.planning import plan
from autopar.config import PlanConfig
from autopar.errors import (CaptureError, CheckpointError, CompileError, InputError, InputTypeError, KVCapacityError,
                            MemoryLimitError, SolverTimeLimitError)
from autopar.mesh import Mesh
from autopar.pipeline.spec import Pipeline
from autopar.result.plan import Plan
from autopar.runtime import ParallelModule, ServingModule
from autopar.serving.serving_plan import ServingPlan
from autopar.serving.workload import SLO, Cluster, Workload

__all__ = ["plan", "compile", "compile_serving", "ServingModule", "Mesh", "Pipeline", "Plan", "ParallelModule",
           "InputError", "InputTypeError", "CaptureError", "CompileError", "MemoryLimitError", "SolverTimeLimitError",
           "CheckpointError", "KVCapacityError",
           "Cluster", "Workload", "SLO", "plan_serving", "ServingPlan", "PlanConfig", "random"]
