"""Moved to kosmos.ops.moe_forward (kosmos/_moved.py: this name goes in the next release)."""
from .._moved import alias

alias(__name__, "kosmos.ops.moe_forward")
