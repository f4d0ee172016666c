"""Serving deployments (issue 12): workloads and SLOs, a discrete-event simulator of serving runs,
analytic step times, and the goodput search that compares configurations.

Sits above the solver: it may import ``autopar.hardware``, ``autopar.cost``, ``autopar.mesh`` and
``autopar.solver``; nothing below imports it. ``notes/serving-design.md`` describes the design and
what the later slices add (decode-step capture, ILP-priced step times, ``plan_serving``, execution).
"""

from autopar.serving.candidates import candidate_deployments, tp_degrees
from autopar.serving.deployment import Deployment, Pool, StepTimes
from autopar.serving.goodput import GoodputResult, best_deployment, find_goodput, requests_needed
from autopar.serving.measured import MeasuredStepTimes, fit_step_times
from autopar.serving.roofline import LLAMA3_8B, RooflineStepTimes, TransformerShape
from autopar.serving.simulator import KVCapacityError, ServingReport, SimResult, simulate
from autopar.serving.workload import (SLO, Cluster, Empirical, Fixed, LogNormal, Requests, TokenDistribution, Uniform,
                                      Workload, read_trace)

__all__ = ["candidate_deployments", "tp_degrees", "Deployment", "Pool", "StepTimes", "GoodputResult",
           "best_deployment", "find_goodput", "requests_needed", "MeasuredStepTimes", "fit_step_times", "LLAMA3_8B", "RooflineStepTimes", "TransformerShape",
           "KVCapacityError", "ServingReport", "SimResult", "simulate", "SLO", "Cluster", "Empirical", "Fixed",
           "LogNormal", "Requests", "TokenDistribution", "Uniform", "Workload", "read_trace"]
