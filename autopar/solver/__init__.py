"""Stage 4: choose one strategy per node (ILP with HiGHS), repeated blocks solved once."""
