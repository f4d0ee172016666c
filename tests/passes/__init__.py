"""One test file per pass of ``autopar.passes`` (``test_<pass>.py``): a graph of a few nodes with
pinned strategies in (``pinned``), the pass run alone, its program checked in filecheck style
(``filecheck``). No planner, no cost model, no process group.

A package, so that ``passes.test_expert_parallel`` and ``tests/test_expert_parallel.py`` can
share a file name."""
