"""Moved to kosmos.core.launch_plan (kosmos/_moved.py: this name goes in the next release)."""
from ._moved import alias

alias(__name__, "kosmos.core.launch_plan")
