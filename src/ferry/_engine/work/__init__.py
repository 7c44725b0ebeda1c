"""Making a batch: what runs where the dataset is read, in a worker or in the main process.

Owns the fetchers (a map-style dataset's keys or a stream's next samples, collated into one
batch: ``fetch``), the per-sample reads that run a batch's samples at once when they wait
(``reads``), and the event loop of an async dataset (``aio``). It knows nothing of workers,
the transport or the position: it may touch ``ferry._core``, the public description modules
(datasets, collate, errors) and nothing else of the engine.
"""
