"""How tasks and batches travel between the main process and its workers.

Owns the messages (``messages``), the shared-memory slabs a process worker writes its
batches into and the main process maps (``slabfile``, ``slabmaps``, ``shm``), and pinning
(``pin``). It may touch ``work`` and ``position`` for the types its messages carry; it knows
no worker handle, channel or loop.
"""
