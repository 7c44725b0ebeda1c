"""``python -m ferry bench``: ferry's loader against torch's, side by side, on built-in workloads.

- :mod:`ferry.bench.workloads`: the datasets (made on the fly, nothing downloaded).
- :mod:`ferry.bench.measure`: how CPU, memory and the memcpy bound are measured, and why so.
- :mod:`ferry.bench.runner`: alternation of the loaders, warm-up, repetitions, timed window.
- :mod:`ferry.bench.results`: the figures of a run, their medians, the rows of the report.
- :mod:`ferry.bench.latency`: the I/O-latency rows beside their C/L and CPU bounds.
- :mod:`ferry.bench.report`: the table, the ``--json`` document and the ``--plot`` chart.
- :mod:`ferry.bench.cli`: the options of the ``bench`` subcommand.
- :mod:`ferry.bench.scaling`: ``--scaling``, the loaders at 1, 2, 4, ... workers, in turn.
- :mod:`ferry.bench.roof`: the roof of a scaling row, the dataset's work in plain processes.
- :mod:`ferry.bench.scaling_report`: the scaling table, its markdown and JSON.
- :mod:`ferry.bench.scaling_cli`: ``--scaling``'s options checked, run, written as it goes.

This is the one part of ferry that imports ``torch.utils.data`` (as the baseline), and only
inside the function that runs torch's side.

Example::

    $ python -m ferry bench --quick --only tensor,image --workers 0 --json out/bench.json
    $ python -m ferry bench --scaling --workers-list 1,2 --markdown out/scaling.md
"""
