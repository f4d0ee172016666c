"""Serving deployments: workloads and SLOs, a discrete-event simulator of serving runs, and the
goodput search that compares configurations (issue 12). Sits above the solver: it may import
``autopar.hardware``, ``autopar.cost`` and ``autopar.solver``; nothing below imports it."""
