"""Split into the package kosmos.ops.moe_backward (kosmos/_moved.py: this name goes in the next release)."""
from .._moved import merged

merged(__name__, tuple(f"kosmos.ops.moe_backward.{m}" for m in ("tiles", "layout", "rows", "multi_launch", "router",
                                                               "exchange", "one_launch", "api")))
