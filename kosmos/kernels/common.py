"""Split (kosmos/_moved.py: this name goes in the next release): the tile pieces are kosmos.gemm.tiles, the W = 1
static GEMM kosmos.gemm.w1_static, the descriptors kosmos.core.descriptors, the policy's host checks
kosmos.core.schedule, the TP ops' checks and route kosmos.ops.tp_common, their DEQ tasks kosmos.ops.tp_dequant."""
from .._moved import merged

merged(__name__, ("kosmos.gemm.tiles", "kosmos.gemm.w1_static", "kosmos.core.descriptors", "kosmos.core.schedule",
                  "kosmos.ops.tp_common", "kosmos.ops.tp_dequant"))
