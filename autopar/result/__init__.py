"""The result: the chosen plan with its predictions (``plan``), and its renderers: a table
(``table``), a Chrome trace (``trace``, ``trace_pipeline``) and notes for its user (``notes``)."""
