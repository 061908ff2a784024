"""Moved to kosmos.ops.matmul_reduce_scatter (kosmos/_moved.py: this name goes in the next release)."""
from .._moved import alias

alias(__name__, "kosmos.ops.matmul_reduce_scatter")
