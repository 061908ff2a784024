"""The import paths of KOSMOS 0.1.0 that moved when each op became a unit (README, "Layout"): the old module names
still import, for one release, with a DeprecationWarning that names the new place.

``alias(old, new)``: the old name IS the new module (attributes read or set through either name are the same
module's). ``merged(old, news)``: a module that was split -- the old name holds every top-level name of its parts
(a copy: setting a name on it does not reach the parts)."""
import importlib
import sys
import warnings


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old name goes in the next release", DeprecationWarning, stacklevel=4)


def alias(old: str, new: str):
    _warn(old, new)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module


def merged(old: str, news: tuple) -> None:
    _warn(old, " / ".join(news))
    module = sys.modules[old]
    for name in news:
        for key, value in vars(importlib.import_module(name)).items():
            if not key.startswith("__"):
                setattr(module, key, value)
