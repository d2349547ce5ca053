"""Checks of the arguments users pass (Loader, transforms, pack, dataset indices): one clear line
for a wrong type or a value out of range, the same test everywhere."""

import numpy as np


def is_integer(value) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an ``int`` to Python, never a count here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def count(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int, checked: TypeError for a float, a string or a bool, ValueError below
    ``minimum``."""
    if not is_integer(value):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)
