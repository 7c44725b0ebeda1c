"""ferry inside the libraries users train with: Lightning, accelerate, transformers, HF datasets.

Every test runs the same program twice, once with ``torch.utils.data`` and once with ferry,
and compares what the training saw (batches, losses, weights) exactly.
"""
