"""Where the epoch stands, and how that is saved and restored.

Owns the epoch's keys drawn from the sampler (``keys``), the cursor that a state is made of
(``cursor``), the one object that moves the position as batches reach the user (``track``),
each worker's own position inside its stream or dataset (``keeper``), datasets resumed from a
count of samples (``counted``), and the checks and warnings of a loaded state (``resume``).
It may touch ``work`` (a keeper wraps a fetcher) and the engine's ``plan`` and ``failures``;
never the transport, the workers or the main loop, which call it.
"""
