"""KOSMOS: self-scheduling persistent kernels that fuse the collectives of tensor/sequence parallelism with
their GEMMs, and a Mixture-of-Experts layer in one launch per direction (NVIDIA Hopper, Triton).

    a_full, c = kosmos.all_gather_matmul(a_shard, b)      # column-parallel (QKV, FC1) with SP
    c_shard   = kosmos.matmul_reduce_scatter(a, b)        # row-parallel (attn-out, FC2) with SP
    y         = kosmos.moe_forward(x, router_w, w13, w2, top_k=8, routing="softmax")   # MoE layer, one launch
    kosmos.nn.MoE(...)                                      # the same as a trainable module
    config=kosmos.AllGatherMatmulConfig(push_chunks="auto")  # each op's knobs: an explicit, validated config

Importing needs no GPU; the ops need CUDA tensors and (for W > 1) an initialised NCCL process group. The layout
(core/, gemm/, ops/, reference/) is in the README; the import paths of earlier releases (``kosmos.kernels.*``,
``kosmos.runtime``, ...) still work for one release, with a DeprecationWarning (kosmos/_moved.py).
"""
__version__ = "0.1.0"

from .config import AllGatherMatmulConfig, MatmulReduceScatterConfig, MoEBackwardConfig, MoEForwardConfig
from .core.runtime import (KosmosError, KosmosTimeoutError, check_errors, reset_workspaces, set_timeout,
                           workspace_bytes)
from .ops.all_gather_matmul import all_gather_matmul
from .ops.matmul_reduce_scatter import matmul_reduce_scatter
from .ops.moe_forward import moe_forward
from . import nn  # noqa: E402
from .quant import dequantize_mx, quantize_mx  # noqa: E402,F401  (MXFP8: kosmos.quant's module docstring)

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "moe_forward", "AllGatherMatmulConfig",
           "MatmulReduceScatterConfig", "MoEForwardConfig", "MoEBackwardConfig", "nn", "KosmosError",
           "KosmosTimeoutError", "check_errors", "reset_workspaces", "set_timeout", "workspace_bytes", "__version__"]
