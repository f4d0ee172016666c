"""Stage 5: graph passes that apply a plan (localize shapes, insert collectives, split stages).

Arrives with issue #3 (execution); the planner's output (``autopar.Plan``) is its input.
"""
