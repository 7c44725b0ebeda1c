"""``python -m ferry doctor MODULE:FUNCTION``: why a loader is slow, and what to change.

The function returns a loader (ferry's or torch's) over the user's dataset. The doctor runs it
for a bounded number of batches or seconds, prints where the time goes (``loader.stats()`` of
the steady state), which stage is the bottleneck and whether the loop or the loader waits, and
advice whose every line names an option, a value and the measured reason. ``--try`` measures
the advised settings side by side.

Modules: :mod:`.options` (a loader's options as a dict, for the torch-to-ferry conversion and
for the variants tried), :mod:`.measure` (one bounded run; the thread probe), :mod:`.advice`
(the rules), :mod:`.tries`, :mod:`.report` (text, JSON, plot), :mod:`.cli`, :mod:`.progress`.
"""
