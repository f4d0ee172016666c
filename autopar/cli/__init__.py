"""Stage 7: the ``autopar`` command line."""
