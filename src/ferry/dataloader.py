"""``torch.utils.data.dataloader``'s public names, so that ``from ferry.dataloader import X``
replaces ``from torch.utils.data.dataloader import X`` (a search-and-replace of
``torch.utils.data`` by ``ferry`` keeps working for the submodules too)."""

from ferry._core.info import get_worker_info
from ferry.collate import default_collate, default_convert
from ferry.loader import DataLoader

__all__ = ["DataLoader", "default_collate", "default_convert", "get_worker_info"]
