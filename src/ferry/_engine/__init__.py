"""Private: how batches are made and moved (fetch, engines, transport)."""
