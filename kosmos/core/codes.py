"""The numbers that kernels write and the host reads, named once: op codes, wait tags, trace kinds, and the
layout of the error record. Kernels use the ``tl.constexpr`` names; ``runtime`` decodes with the dicts below,
which are built from the same values, so the two cannot drift apart. tests/test_runtime.py checks that every
wait tag decodes to words and that every tag a kernel uses is named here.
"""
import triton.language as tl

# ------------------------------------------------------------------------------------------- op codes
OP_ALL_GATHER_MATMUL: tl.constexpr = tl.constexpr(1)
OP_MATMUL_REDUCE_SCATTER: tl.constexpr = tl.constexpr(2)
OP_MOE_FORWARD: tl.constexpr = tl.constexpr(4)
OP_MOE_BACKWARD: tl.constexpr = tl.constexpr(8)  # the one-launch backward's expert part (moe_backward(one_launch=True))
OP_NAMES = {OP_ALL_GATHER_MATMUL.value: "all_gather_matmul", OP_MATMUL_REDUCE_SCATTER.value: "matmul_reduce_scatter",
            OP_MOE_FORWARD.value: "moe_forward", OP_MOE_BACKWARD.value: "moe_backward"}

# ------------------------------------------------------------------------------------------- wait tags
# What a bounded wait was waiting for; a timed-out wait records its tag and an index (the record's
# ``counter`` field), and ``runtime.decode_error`` says it in words with WAIT_TEXT. The tag travels in the op
# slot (``op | tag << 8``, one compile-time constant), so the record keeps its eight slots.
WAIT_PEERS_DONE: tl.constexpr = tl.constexpr(1)    # index: the peer's rank
WAIT_AG_ROWS: tl.constexpr = tl.constexpr(2)       # index: the signal slot of (source rank, chunk)
WAIT_RS_PARTIAL: tl.constexpr = tl.constexpr(3)    # index: the signal slot of (source rank, tile)
WAIT_MOE_DISPATCH: tl.constexpr = tl.constexpr(4)  # index: the source rank
WAIT_MOE_PLAN: tl.constexpr = tl.constexpr(5)      # index: unused (0)
WAIT_MOE_PERMUTE: tl.constexpr = tl.constexpr(6)   # index: the local expert
WAIT_MOE_GEMM1: tl.constexpr = tl.constexpr(7)     # index: the expert m-tile
WAIT_MOE_COMBINE: tl.constexpr = tl.constexpr(8)   # index: the fold block
WAIT_MX_ROWS: tl.constexpr = tl.constexpr(9)       # index: the signal slot of (source rank, chunk, part)
WAIT_BWD_DGRAD2: tl.constexpr = tl.constexpr(10)   # index: the expert m-tile
WAIT_BWD_SWIGLU: tl.constexpr = tl.constexpr(11)   # index: the expert m-tile (-1: all of them)
WAIT_BWD_DGRAD1: tl.constexpr = tl.constexpr(12)   # index: unused (-1: every tile)
WAIT_SPLIT_K: tl.constexpr = tl.constexpr(13)      # index: the split group (the static W=1 GEMM's K split)
WAIT_BWD_ROUTER_DL: tl.constexpr = tl.constexpr(14)  # index: unused (-1: every dlogits block)
WAIT_BWD_UNPERMUTE: tl.constexpr = tl.constexpr(15)  # index: the token block of the router's dx tiles
# the one-launch backward at W > 1 (ops/moe_backward/one_launch.py, "The one launch at W > 1")
WAIT_BWD_COMBINE: tl.constexpr = tl.constexpr(16)   # index: the source rank
WAIT_BWD_PLAN: tl.constexpr = tl.constexpr(17)      # index: unused (0)
WAIT_BWD_PERMUTE: tl.constexpr = tl.constexpr(18)   # index: the local expert
WAIT_BWD_GU: tl.constexpr = tl.constexpr(19)        # index: the expert m-tile
WAIT_BWD_DGRAD1_MTILE: tl.constexpr = tl.constexpr(20)  # index: the expert m-tile
WAIT_BWD_DISPATCH: tl.constexpr = tl.constexpr(21)  # index: the token block (UNPERMUTE's)
WAIT_MX_PASS: tl.constexpr = tl.constexpr(22)       # index: the 512-column chunk (gemm/w1_mx.py's row pass)
WAIT_TEXT = {
    WAIT_PEERS_DONE.value: "rank {index} to finish the previous call (done flag)",
    WAIT_AG_ROWS.value: "rows pushed by a peer (signal slot {index})",
    WAIT_RS_PARTIAL.value: "a peer's partial tile (signal slot {index})",
    WAIT_MOE_DISPATCH.value: "rank {index}'s dispatched rows and counts",
    WAIT_MOE_PLAN.value: "this call's expert plan (built by another program of the launch)",
    WAIT_MOE_PERMUTE.value: "the received rows of local expert {index} to be placed",
    WAIT_MOE_GEMM1.value: "the GEMM1 column tiles of expert m-tile {index}",
    WAIT_MOE_COMBINE.value: "the expert outputs of fold block {index} (combine from every rank)",
    WAIT_MX_ROWS.value: "MXFP8 rows to be dequantized by another program of the launch (signal slot {index})",
    WAIT_BWD_DGRAD2.value: "the dgrad2 column tiles of expert m-tile {index} (z = dy_rows W2^T)",
    WAIT_BWD_SWIGLU.value: "the SwiGLU backward of expert m-tile {index} (-1: of every m-tile)",
    WAIT_BWD_DGRAD1.value: "every dgrad1 tile (dx_rows) of the launch",
    WAIT_SPLIT_K.value: "the K-split partial sums of split group {index} (other programs of the launch)",
    WAIT_BWD_ROUTER_DL.value: "every router dlogits block (the gate gradients through the routing) of the launch",
    WAIT_BWD_UNPERMUTE.value: "the dispatch backward (dx_e) of token block {index}",
    WAIT_BWD_COMBINE.value: "rank {index}'s output-gradient rows, gate weights and counts (the combine backward)",
    WAIT_BWD_PLAN.value: "this call's backward expert plan (built by another program of the launch)",
    WAIT_BWD_PERMUTE.value: "the received rows of local expert {index} to be placed (backward)",
    WAIT_BWD_GU.value: "the recomputed g | u (GEMM1) column tiles of expert m-tile {index}",
    WAIT_BWD_DGRAD1_MTILE.value: "the dgrad1 tiles of expert m-tile {index}",
    WAIT_BWD_DISPATCH.value: "the expert rows' dx and gate gradients of token block {index} (dispatch backward from "
                             "every rank)",
    WAIT_MX_PASS.value: "A's MX values of column chunk {index} from the row pass (another partition of the launch)",
}

# ------------------------------------------------------------------------------------------- trace kinds
EV_IDLE: tl.constexpr = tl.constexpr(0)
EV_COMM: tl.constexpr = tl.constexpr(1)
EV_COMPUTE: tl.constexpr = tl.constexpr(2)
EV_WAIT: tl.constexpr = tl.constexpr(3)
EV_ROUTE: tl.constexpr = tl.constexpr(4)
EV_PERMUTE: tl.constexpr = tl.constexpr(5)
EV_GEMM1: tl.constexpr = tl.constexpr(6)
EV_GEMM2: tl.constexpr = tl.constexpr(7)
EV_FOLD: tl.constexpr = tl.constexpr(8)
EV_BWD_DGRAD2: tl.constexpr = tl.constexpr(9)  # the one-launch MoE backward's stages (ops/moe_backward)
EV_BWD_SWIGLU: tl.constexpr = tl.constexpr(10)
EV_BWD_DGRAD1: tl.constexpr = tl.constexpr(11)
EV_BWD_WGRAD2: tl.constexpr = tl.constexpr(12)
EV_BWD_WGRAD1: tl.constexpr = tl.constexpr(13)
EV_BWD_UNPERMUTE: tl.constexpr = tl.constexpr(14)
EV_BWD_ROUTER_DL: tl.constexpr = tl.constexpr(15)  # the one launch's router backward
EV_BWD_ROUTER_DW: tl.constexpr = tl.constexpr(16)
EV_BWD_ROUTER_DX: tl.constexpr = tl.constexpr(17)
TRACE_KINDS = {EV_IDLE.value: "idle", EV_COMM.value: "comm", EV_COMPUTE.value: "compute", EV_WAIT.value: "wait",
               EV_ROUTE.value: "route", EV_PERMUTE.value: "permute", EV_GEMM1.value: "gemm1",
               EV_GEMM2.value: "gemm2", EV_FOLD.value: "fold", EV_BWD_DGRAD2.value: "dgrad2",
               EV_BWD_SWIGLU.value: "swiglu-bwd", EV_BWD_DGRAD1.value: "dgrad1", EV_BWD_WGRAD2.value: "wgrad2",
               EV_BWD_WGRAD1.value: "wgrad1", EV_BWD_UNPERMUTE.value: "unpermute",
               EV_BWD_ROUTER_DL.value: "router-dl", EV_BWD_ROUTER_DW.value: "router-dw",
               EV_BWD_ROUTER_DX.value: "router-dx"}
TRACE_EVENTS: tl.constexpr = tl.constexpr(1024)  # events per program in a trace buffer [grid, TRACE_EVENTS, 4]

# ------------------------------------------------------------------------------------------- error record
# int64[ERR_SLOTS]: slots 0..ERR_ELAPSED are the record (the flag first; ERR_OP holds op | wait tag << 8),
# ERR_MIRROR holds the address of a pinned host-mapped int64[ERR_RECORD] copy of it, or 0.
ERR_FLAG: tl.constexpr = tl.constexpr(0)
ERR_OP: tl.constexpr = tl.constexpr(1)
ERR_RANK: tl.constexpr = tl.constexpr(2)
ERR_TASK: tl.constexpr = tl.constexpr(3)
ERR_COUNTER: tl.constexpr = tl.constexpr(4)
ERR_EXPECTED: tl.constexpr = tl.constexpr(5)
ERR_OBSERVED: tl.constexpr = tl.constexpr(6)
ERR_ELAPSED: tl.constexpr = tl.constexpr(7)
ERR_MIRROR: tl.constexpr = tl.constexpr(8)
ERR_RECORD = 8   # slots mirrored to the host
ERR_SLOTS = 9
WAIT_SHIFT: tl.constexpr = tl.constexpr(8)  # ERR_OP = op | wait tag << WAIT_SHIFT


def op_code(record) -> int:
    """The op code of an error record (its ERR_OP slot without the wait tag)."""
    return int(record[ERR_OP.value]) & ((1 << WAIT_SHIFT.value) - 1)


def wait_tag(record) -> int:
    """The wait tag (WAIT_*) of an error record."""
    return int(record[ERR_OP.value]) >> WAIT_SHIFT.value
