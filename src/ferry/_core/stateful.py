"""torchdata's Stateful protocol, as the loader, the engine and the doctor test for it."""

from __future__ import annotations

__all__ = ["has_state_methods"]


def has_state_methods(obj: object) -> bool:
    """Whether ``obj`` has the Stateful protocol's two methods (``state_dict`` and
    ``load_state_dict``), whatever their parameters (see ``ferry._engine.position.counted``
    for a ``state_dict`` that takes arguments)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )
