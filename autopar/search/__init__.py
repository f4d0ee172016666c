"""Stage 5 of planning: the search around the ILP, one loop nest (``search.planner``): pipeline depth,
pipeline schedule and micro-batches, context layout, memory scenarios, the ILP call; and the problem
each level prepares (``search.problem``)."""
