"""Serving deployments: workloads and SLOs, a discrete-event simulator of serving runs,
step times (analytic, or fitted through ILP-planned steps), the goodput search that compares
configurations, and ``plan_serving``, which plans a model's deployment with them.

Sits above the solver: it may import ``autopar.hardware``, ``autopar.cost``, ``autopar.mesh`` and
``autopar.solver``; nothing below imports it. ``notes/serving-design.md`` describes the design and
what comes next (pipeline and expert parallelism per phase, execution on ranks).
"""

from autopar.serving.candidates import candidate_deployments, tp_degrees
from autopar.serving.deployment import Deployment, Pool, StepTimes
from autopar.serving.planned import PlannedStepTimes, plan_step_times
from autopar.serving.planner import plan_serving
from autopar.serving.serving_plan import PoolPlan, ServingPlan
from autopar.serving.goodput import GoodputResult, best_deployment, find_goodput, requests_needed
from autopar.serving.measured import MeasuredStepTimes, fit_step_times
from autopar.serving.roofline import LLAMA3_8B, RooflineStepTimes, TransformerShape
from autopar.errors import KVCapacityError
from autopar.serving.simulator import ServingReport, SimResult, simulate
from autopar.serving.workload import (SLO, Cluster, Empirical, Fixed, LogNormal, Requests, TokenDistribution, Uniform,
                                      Workload, read_trace)

__all__ = ["plan_serving", "ServingPlan", "PoolPlan", "PlannedStepTimes", "plan_step_times",
           "candidate_deployments", "tp_degrees", "Deployment", "Pool", "StepTimes", "GoodputResult",
           "best_deployment", "find_goodput", "requests_needed", "MeasuredStepTimes", "fit_step_times", "LLAMA3_8B",
           "RooflineStepTimes", "TransformerShape",
           "KVCapacityError", "ServingReport", "SimResult", "simulate", "SLO", "Cluster", "Empirical", "Fixed",
           "LogNormal", "Requests", "TokenDistribution", "Uniform", "Workload", "read_trace"]
