"""Choosing how the loader runs, while it runs.

Owns ``num_workers="auto"``'s choices (``autotune``: how many workers and how deep a queue,
between epochs) and the move of auto's process workers to threads within an epoch
(``switch``). It may touch every sub-package below it (``work``, ``position``,
``transport``, ``crew``); the main loop calls it.
"""
