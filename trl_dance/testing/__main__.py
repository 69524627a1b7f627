"""``python -m trl_dance.testing KIND DIR``: save a tiny pipeline (see :func:`trl_dance.testing.folders.main`)."""

from .folders import main

main()
