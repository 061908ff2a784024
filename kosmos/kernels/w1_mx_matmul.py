"""Moved to kosmos.gemm.w1_mx (kosmos/_moved.py: this name goes in the next release)."""
from .._moved import alias

alias(__name__, "kosmos.gemm.w1_mx")
