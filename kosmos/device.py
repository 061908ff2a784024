"""Moved to kosmos.core.device (kosmos/_moved.py: this name goes in the next release)."""
from ._moved import alias

alias(__name__, "kosmos.core.device")
