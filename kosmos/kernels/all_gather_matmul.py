"""Moved to kosmos.ops.all_gather_matmul (kosmos/_moved.py: this name goes in the next release)."""
from .._moved import alias

alias(__name__, "kosmos.ops.all_gather_matmul")
