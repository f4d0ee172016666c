"""Make ``autopar`` and ``examples`` importable from a checkout without installing it."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch

# Multi-rank tests fork this process; a forked child hangs if the parent already started
# an OpenMP pool, so the whole session computes on one intra-op thread.
torch.set_num_threads(1)
