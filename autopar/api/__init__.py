"""The entry points, above the runtime: ``plan`` (a plan, nothing run), ``compile`` (plan once, run on
every rank), ``plan_serving`` and ``compile_serving`` (serving deployments)."""

from autopar.api.compiling import compile
from autopar.api.planning import plan, plan_step
from autopar.api.serving import compile_serving, plan_serving

__all__ = ["plan", "plan_step", "compile", "plan_serving", "compile_serving"]
