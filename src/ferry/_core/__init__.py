"""ferry's bottom layer: what the public modules and the engine both build on, and which
imports nothing else of ferry.

* ``rng``: generator and RNG states (save, restore, compare), per-process RNG bookkeeping.
* ``alloc``: where collate's batch memory comes from (the allocator of the current thread).
* ``info``: ``get_worker_info`` and what a worker publishes about itself.
* ``ranks``: the process group's ``(rank, world_size)``, and the one a worker inherits.
* ``memory``: how much memory a worker process made its own (copy-on-write), measured.

The layers, lowest first (``tests/test_layers.py`` fails on an import that goes up):
``_core``; the public description modules (datasets, samplers, collate, distributed, stats,
errors and their private helpers); ``_engine``; the loader; the tools (doctor, bench, CLI).
See docs/design/modules.md.
"""
