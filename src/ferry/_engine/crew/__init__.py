"""The workers: how each kind starts, runs, talks, is replaced, reports a stall and stops.

Owns the worker's own loop (``worker``), the handles and the group of one iterator's workers
with their layered teardown (``group``), the two kinds, processes and threads (``kinds``), the
channel that moves tasks and messages to and from a group (``channels``), and the stacks of
a stalled worker (``stall``). It may touch ``work``, ``position`` and ``transport``; the main
loop and tuning call it, never the other way round.
"""
