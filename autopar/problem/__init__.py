"""The planning problem: the captured step's nodes with their strategies and costs (``graph``), the
pins options put on them (``constraints``, ``zigzag``, ``context_kind``, ``strided``) and the folding of
repeated blocks (``folding``)."""
