"""Mirrors the path of ``torch.utils.data._utils``, which torch's documentation names for
``collate`` (``torch.utils.data._utils.collate.collate``) and ``default_collate_fn_map``: see
:mod:`ferry._utils.collate`."""
