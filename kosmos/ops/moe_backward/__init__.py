"""The MoE layer's backward (``moe_backward``), by role:

* ``api`` -- the entry points (``moe_backward``, ``moe_backward_w1``): checks, the route (one launch or several,
  EP = 1 or over an EP group), the router backward's torch path;
* ``one_launch`` -- the one-launch kernel (every stage of the backward in one persistent launch) and its host
  launches at EP = 1 and over an EP group;
* ``multi_launch`` -- the separate expert GEMM kernels (weight gradients, GEMM2 dgrad with the SwiGLU backward,
  GEMM1 dgrad): the multi-launch path, and the pieces the tests check one by one;
* ``router`` / ``exchange`` -- the one launch's router backward stages and its EP exchange stages;
* ``tiles`` -- jit tile pieces shared by both paths, and their tile shapes;
* ``layout`` -- the padded row layout, the one launch's stage numbers and scratch layout, the EP buffer layout;
* ``rows`` -- row gathers, scalings, sums and the SwiGLU h pass;
* ``mx`` -- the MXFP8 backward's expert part (every backward GEMM on MX operands along its own K) and the experts'
  MX weight copies (``MoEMXWeights``, ``moe_mx_weights``).

The one launch's stages, task and flag protocol, deadlock argument and determinism: ``one_launch``'s docstring; why,
and the alternatives measured: docs/design/moe_backward.md; figures: docs/perf/moe_backward.md. Tests:
tests/test_moe_backward.py, tests/test_moe_bwd_probe.py, tests/test_ranks_one_gpu.py, tests/test_bench_moe.py."""
from .api import moe_backward, moe_backward_w1
from .layout import expert_counts, pad_expert_rows, padded_layout, padded_row_offsets, padded_rows_bound
from .mx import MoEMXWeights, expert_backward_gemms_mx, moe_mx_weights
from .multi_launch import (expert_backward_gemms, expert_dgrad1, expert_dgrad2_swiglu, expert_weight_grads,
                           expert_weight_grads_padded, expert_weight_grads_ref)
from .one_launch import expert_backward_ep_launch, expert_backward_one_launch
from .router import RouterBackward
from .rows import gather_rows, gather_rows_and_scaled, scaled_rows, sum_partials, swiglu_h, unpermute_sum
