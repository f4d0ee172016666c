"""Stage 6: run per-rank graphs on torch.distributed (gradient sync, schedules, checkpoints).

Arrives with issue #3 (execution).
"""
