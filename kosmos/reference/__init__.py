"""Pure-torch references of every op (CPU or GPU; fp32 by default): ``tp`` -- the TP ops, whose names are
re-exported here; ``moe`` -- the router, the MoE layer forward and backward, and the NCCL all-to-all layer the bench
times as ``nccl-a2a``."""
from .tp import (FrobeniusError, all_gather_matmul_ref, all_gather_matmul_ref_local, fp8_block_matmul_ref,
                 matmul_reduce_scatter_ref, matmul_reduce_scatter_ref_local, rel_err)

__all__ = ["FrobeniusError", "all_gather_matmul_ref", "all_gather_matmul_ref_local", "fp8_block_matmul_ref",
           "matmul_reduce_scatter_ref", "matmul_reduce_scatter_ref_local", "rel_err"]
