"""One unit per op: its host entry, its kernels and its launch plan together. all_gather_matmul and
matmul_reduce_scatter share tp_common (input checks, the W = 1 route) and tp_dequant (MXFP8 DEQ tasks);
moe_forward; moe_backward/ (a package, by role)."""
