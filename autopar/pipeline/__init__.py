"""Pipelines: the options (``spec.Pipeline``), the cuts into stages (``cuts``, ``stages``), each schedule
played out in time (``schedule_sim``), each pp rank's memory (``stage_memory``) and tied weights (``tied``)."""
