"""The MoE layer's backward: its pieces, on the way to one launch (issue: the MoE backward in one launch).

So far, as tile functions with standalone launchers (to become stages of the one launch):

1. The per-expert weight gradient, the one GEMM shape of the backward the forward kernel has no twin of.

    dW[e] = A[rows of e]^T @ B[rows of e]            A [R, KA], B [R, KB] bf16, rows of expert e consecutive
                                                      (counts[e] of them, zero allowed), dW [E, KA, KB] bf16
                                                      (fp32 accumulation, rounded once; out_dtype=fp32 too)
It is GEMM2's weight gradient (A = h [R, F], B = do [R, H]: dW2[e] = h^T do) and GEMM1's (A = the expert rows
x_rows [R, H], B = [dg | du] [R, 2F]: dW13[e] = x_rows^T [dg | du]) -- moe_reference.gemm2_backward_ref and
gemm1_backward_ref.

Determinism: one program owns each output tile (e, i, j) and sums the expert's rows in ascending order, BR
rows per step, with fp32 accumulation: no atomics, the result does not depend on the schedule (bitwise
reproducible). The grid is static -- E * ceil(KA/BI) * ceil(KB/BJ) tiles whatever the counts -- and the
expert row offsets are an exclusive cumsum of counts on the device, so nothing synchronises with the host.
An expert without rows gets zeros.

Math per tile: acc[BI, BJ] += A[r0:r0+BR, i*BI:+BI]^T @ B[r0:r0+BR, j*BJ:+BJ] (tl.dot of the transposed A
tile); rows past the expert's end load as zeros (TMA descriptors whose shape ends at the expert's last row:
the next expert's rows are never read, so they cannot be summed in), columns past KA / KB likewise.

2. GEMM2's data gradient with the SwiGLU backward and the gate-weight gradient in its epilogue, per expert row
   p (token t, slot j, weight w_p; rows expert-sorted, dy_rows[p] = dy[t]):
       z_p  = dy_rows[p] @ W2[e]^T                        [R, F]  (fp32 accumulation; W2[e] read as its rows)
       h_p  = silu(g_p) * u_p                             recomputed from the saved g | u
       dwp[p, n] = sum over the slice's columns of z_p * h_p   the gate gradient <dy, o_p> = <z_p, h_p>, one
                                                          partial per epilogue slice n (half an F-tile),
                                                          summed in order by the caller
       dh_p = w_p z_p;  dg = dh u silu'(g);  du = dh silu(g)  stored bf16 as [dg | du] [R, 2F]
   (moe_reference.gate_grad_from_h_ref, gemm2_backward_ref, swiglu_backward_ref.)
3. GEMM1's data gradient: dx_rows[p] = [dg | du]_p @ W13[e]^T   [R, H] (W13[e] [H, 2F] read as its rows).

4. ``moe_backward_w1``: the whole backward at one rank from these kernels and torch (see its docstring).

Plan for the one launch (built at W = 1 without the exchanges, session 14: "The one launch" below): the forward's
own layout (its expert rows, their (source, token, slot) and the device-side plan) kept for the backward instead of
a re-sort; stages in demand order, each a queue of tiles with readiness counters as in moe_forward.py: COMBINE-BWD
(dy rows to the experts' ranks, once per destination, with the gate weights: the mirror of combine) -> DGRAD2 (item
2; counts finished F-tiles per m-tile) -> WGRAD2 (item 1 on h and w*dy; waits for nothing new) -> DGRAD1 (item 3;
waits for its m-tile's DGRAD2 tiles) -> WGRAD1 (item 1 on the rows and [dg | du]; waits for the expert's DGRAD2
tiles) -> DISPATCH-BWD (each token's rows back to its rank, summed in slot order; waits for DGRAD1) -> ROUTER-BWD
(the gate gradients' F-tile partials summed in order, then dq, dl, dWr, dx_r). g | u either saved by the forward's
GEMM1 epilogue (R x 2F bf16: 256 MiB per rank at deepseek-v3 4k tokens) or recomputed (GEMM1 again, 1.92 TFLOP):
measure both.

In the one-launch backward these tiles become a stage whose tasks wait for the rows' dgrad flags, as the
forward's GEMM2 waits for GEMM1's tiles.

What session 13's measurements say about that plan (results/h200x1/s13; not built):
* at W = 1 the launches already leave the GPU no idle time: at deepseek-v3 8k zipf the kernels' sum is the whole
  call (33.4 ms over 161 launches, probe profile), so one launch can win there only what it fuses, not what it
  overlaps. What it must not lose: the flat wgrad's cross-tile pipeline (a task queue drains the pipeline at
  every tile, as the persistent kernel did: deepseek-v3 4k wgrad1 7.31 ms against the flat loop's 6.15). So a
  WGRAD task should be a run of one program's flat loop (all its tiles of one expert, or of a group of
  experts whose rows are ready), not one tile; its readiness is per expert (every m-tile of the expert through
  the SwiGLU pass).
* the padded layout serves the one launch as it is: one descriptor per operand for all experts, m-tiles and
  wgrad steps that never straddle two experts, gap rows that are zero by construction.
* the win is at W > 1, where the all-to-alls (dy rows to the experts' ranks, dx rows back) can hide under the
  GEMMs, as the forward's dispatch and combine do (1.61x over NCCL at EP=2). Registers: the largest stage sets
  the kernel's (dgrad1 199, flat wgrad 181 at 128x256, Triton 3.6), one 8-warp program per SM as today.

Issue 15 speed pass (session 10, after dev/moe_bwd_probe's first H200 run, results/h200x1/s10/c: whole backward
15.5 ms vs nccl-a2a 9.7 ms at qwen3-235b, 4096 tokens, EP=1):
* weight gradients in bf16 (the parameters' dtype; ``out_dtype=torch.float32`` / ``moe_backward(...,
  wgrad_dtype=torch.float32)`` for fp32): one fp32 accumulator rounded to nearest even once, so the bf16 result
  is bitwise the old fp32 one rounded -- what autograd's cast to the bf16 parameters made of it anyway (nn.MoE's
  .grad unchanged). Halves the 9.6 GB of weight-gradient writes at qwen3.
* the wgrad kernel on TMA: both operands through per-program tensor descriptors clipped at the expert's rows
  (TMA -> shared -> wgmma, A's transpose a shared-memory view, the row loop pipelined over 3 stages); the
  masked-pointer kernel kept as the fallback where KA or KB is not a multiple of 8 (rows not 16-byte aligned).
  Still one program per (e, i, j) tile, rows summed in ascending order: determinism unchanged. No persistent
  grid (96 KiB shared: two programs per SM, one's epilogue overlapping the other's loads); the tile stored
  through masked pointers (a TMA store would be a third in-kernel descriptor per program, on a loop of ~4 row
  steps: not tried).
* dgrad2 / dgrad1 on TMA as well (per-program descriptors: the expert's rows -- zeros past its end -- and its
  weight matrix W2[e] [F, H] / W13[e] [H, 2F], read transposed as a shared-memory view; the pointer loops kept
  for rows not 16-byte aligned); m-tiles past the last expert's rows (the static grid bound, ~E of
  ceil(R/BM) + E) exit before their K loop; dgu / dx / the gate partials allocated with torch.empty (no zero
  fill: every row < sum(counts) is written); the gate gradient's F-tile partials summed by one launch
  (``sum_partials``, left to right: bitwise the per-partial torch adds it replaces).
* do = w * dy_rows in one Triton pass straight from dy's token rows (``scaled_rows``: one fp32 product, bf16,
  bitwise the torch line); the dispatch backward (``unpermute_sum``) a gather-sum over each token's k rows in
  slot order in fp32 (bitwise dispatch_backward_ref of the rows put in pair order, without the [P, H] pair-order
  and fp32 copies).
* h = silu(g) u for wgrad2 in one pass (``swiglu_h``: no fp32 copies of g, u), torch's formula 1 / (1 + expf(-g))
  with libdevice's expf and an IEEE division, so that it is meant to be bitwise the torch line it replaces --
  unverified until tests/test_moe_backward.py::test_swiglu_h_bitwise_torch_gpu runs on the GPU (the
  interpreter's exp is numpy's: within one bf16 rounding there); ``SWIGLU_H_TORCH = True`` restores the torch
  line. Either way moe_backward and the probe's stages run the same code (bitwise composition kept).
* not done: a persistent wgrad grid, TMA stores in the epilogues, re-tuned tiles (nothing here was timed),
  h from dgrad2's epilogue (which has it in fp32 already).
PREDICTION (unmeasured; for the lead to time with dev/moe_bwd_probe.py on the H200): wgrad1 3.23 -> ~2.0 ms,
wgrad2 1.63 -> ~1.0 ms (bf16 writes and TMA loads: ~410 TF/s, ~0.95x torch._grouped_mm's bf16-out wgrad),
dgrad2_swiglu 2.37 -> ~1.3 ms, dgrad1 2.24 -> ~1.75 ms (TMA loads, the ~20% empty m-tiles gone, one launch for
the gate partials instead of F/BN), h_recompute 0.78 -> ~0.1 ms, do_rows 0.95 -> ~0.1 ms, unpermute_dx 1.44 ->
~0.15 ms, the rest unchanged: whole backward 15.5 -> ~9.3 ms (nccl-a2a 9.7 ms: the issue's 1.3x bar needs the
GEMM1 recompute and the router's fp32 torch work next).
MEASURED (session 10, one H200, Triton 3.6, dev/moe_bwd_probe.py, qwen3-235b 4096 tokens uniform, EP=1;
results/h200x1/s10/c and /d, before -> after, ms; TF/s and the ratio to torch._grouped_mm on the same rows):
wgrad1 3.23 -> 2.58 (320 TF/s, 0.72x), wgrad2 1.63 -> 1.30 (317, 0.76x), dgrad2_swiglu 2.37 -> 2.19 (189,
0.38x: the narrow 128x64 tile and its epilogue), dgrad1 2.24 -> 2.04 (404, 0.82x), h_recompute 0.78 -> 0.09,
do_rows 0.95 -> 0.10, unpermute_dx 1.44 -> 0.10; GEMM1 recompute (torch) 1.63 unchanged; whole backward
15.50 -> 11.36 ms (prediction 9.3), 109 launches (was 149); nccl-a2a's autograd 9.70: kosmos is 0.854x of it
(bar >= 1.3x faster). The GEMM kernels came in short of the prediction (wgrad 0.72-0.76x of torch, not
0.95x); with torch's GEMM times the stages would sum to 8.29 ms, 6.66 without the recompute.
test_swiglu_h_bitwise_torch_gpu passed on the GPU (swiglu_h is bitwise torch's line there).
sm_90a (local Triton 3.9, ptxas; ``python -m dev.kernel_resources --world 1 --kernels moe_backward``): wgrad
128x128 tiles, 64-row steps, 8 warps, 3 stages: 90 registers, no spills, 96 KiB shared (bf16 or fp32 out);
dgrad2 128x64x64 (8 warps, 3 stages): 244 registers, no spills, 72 KiB; dgrad1 128x128x64 (8 warps, 3 stages):
109 registers, no spills, 96 KiB; sum_partials 40, scaled_rows 24, swiglu_h 40, unpermute_sum 38 registers,
no spills. The three GEMM kernels run wgmma on TMA loads (wgmma.mma_async, cp.async.bulk.tensor in their PTX).

Second speed pass (session 11; nothing here timed yet -- the lead's A/B with dev/moe_bwd_probe.py decides):
* dgrad2_swiglu at 128 x 128 x 64 (8 warps, 3 stages; ``DGRAD2_TILES``): the epilogue runs on two 64-column
  halves one after the other (``DGRAD2_SPLIT``; the accumulator split in registers by reshape / permute /
  split, as common.store_tile does), each loading its g, u slice and storing its [dg | du] and its own gate
  partial (dwp [R, 2 * F / 128], summed left to right by sum_partials as before), with int32 offsets inside
  the tile (no per-element 64-bit index). sm_90a: 225 registers, no spills, 96 KiB shared (the whole-tile
  epilogue at 128 x 128: 255 registers, 956 B spilled). sigmoid(g) there is now torch's formula
  (``_torch_sigmoid``: libdevice expf, IEEE division -- swiglu_h's), so that h can come from this epilogue
  (next item); the dg / du values move by rounding only (tests: relative error vs the fp64 reference).
  PREDICTION (unmeasured): the same A-tile reuse as dgrad1's 128 x 128 (404 TF/s) with a heavier epilogue
  that one resident program per SM cannot hide: dgrad2_swiglu 2.19 -> ~1.2 ms (~340 TF/s, ~0.7x torch).
* h = silu(g) u (bf16) stored by dgrad2's epilogue (``emit_h``; ``DGRAD2_EMITS_H``, moe_backward and the
  probe's stages via ``dgrad2_emits_h()``), so the swiglu_h pass goes (its probe row stays, ~0 ms). The same
  arithmetic as swiglu_h -- _torch_sigmoid, (g * s) * u, one rounding -- hence bitwise swiglu_h's, hence torch's
  line on the GPU (swiglu_h's GPU test passed in session 10): checked under the interpreter, and on the GPU by
  test_dgrad2_emitted_h_bitwise_gpu and the probe's ``h_bitwise_swiglu_h``. In both kernels' PTX (local
  Triton 3.9) 1 + expf(-g) is contracted into fma(ex2 result, 2^i, 1): exact, the scale being a power of two,
  so the contraction cannot move a bit. sm_90a: 229 registers, no spills, 96 KiB. PREDICTION (unmeasured):
  h_recompute 0.09 -> 0 ms, dgrad2 +~0.03 ms (100 MB more stores at qwen3): ~0.06 ms saved, one launch fewer.
* wgrad on a persistent grid (``_expert_wgrad_persistent_kernel``, ``WGRAD_KERNEL = "persistent"``; "tiles",
  session 10's kernel, stays selectable: ``expert_weight_grads(..., kernel=)``, the probe's ``--wgrad-kernel``):
  2 programs per SM, global tile g = e * n_tiles + t owned by program g % GRID, every program walking the
  experts in order (the resident programs share one expert's rows in L2, as the one-program-per-tile grid's
  did) and building its two per-expert TMA descriptors once per expert, not once per tile; each tile the same
  sum as before (bitwise the "tiles" kernel's, tested). Why: at qwen3 an expert has ~256 rows, 4 row steps per
  128 x 128 tile (~1.1 us of tensor work at the SM's peak), and session 10 measured ~6.9 us per tile and
  program slot -- fixed per-tile costs dominate: program start, the device-side descriptors (~2 us per
  program at a call's start in common.host_descriptors' measurement), the pipeline fill, the epilogue.
  Tried for sm_90a (local Triton 3.9; no spills in any): 128x128x64 3 stages 105 registers 96 KiB (kept: two
  per SM); 128x256x64 2 stages 157 / 3 stages 177 registers (96 / 144 KiB, one per SM by registers);
  256x128x64 3 stages 162; 128x128x128 2 stages 92 (128 KiB, one per SM by shared memory). Not done: the
  pipeline carried across tiles (Triton pipelines the row loop only), TMA stores of the output.
  PREDICTION (unmeasured; the descriptor cost at this shape is the unknown): wgrad1 2.58 -> ~2.1 ms (768
  tiles per expert: ~2.9 per program and expert, descriptors 3x fewer), wgrad2 1.30 -> ~1.2 ms (384 tiles per
  expert: ~1.5 per program). If the persistent grid is not faster, WGRAD_KERNEL = "tiles".
* g | u saved by the forward (session 11; built after the branch): ``moe_forward(..., save_gu=True)`` stores
  GEMM1's g and u (bf16, the fp32 accumulators rounded once) beside h in its epilogue, into a fresh [W*T*min(k,
  E/W), 2F] tensor per call, with a copy of the rows' (source, token, slot); ``moe_backward(saved_gu=)`` gathers
  them into its own order (moe_forward.SavedGateUp.in_backward_order: by local expert, source rank, pair -- a
  unique key, so the forward's atomics-dependent placement cannot change a bit of the gradients; tested on the
  GPU with two forwards). nn.MoE keeps them by default at one rank (``save_gate_up``; exactly T*k rows there);
  at W > 1 the forward cannot know its row count and would keep the worst case, so the backward recomputes.
  Values: the forward kernel's dot products, not torch._grouped_mm's recompute (bitwise equal in the probe's
  err_vs_torch at qwen3, 0.0; not guaranteed in general).
MEASURED (session 11, one H200, Triton 3.6, qwen3-235b 4096 tokens uniform, EP=1; results/h200x1/s11):
* the branch (dgrad2 128x128 halves, h from dgrad2, persistent wgrad) against main, one after the other in one
  call (not interleaved): whole backward 11.30 -> 10.06 ms (predicted ~9.7); dgrad2 2.19 -> 1.39 ms (0.60x
  torch), wgrad2 1.23, wgrad1 2.15.
* g | u saved: 10.06 -> 8.92 ms (predicted ~8.5); the forward 2.91 -> 2.98 ms with save_gu (+2%); moe_forward's
  spills at W = 1/2/8 156/104/604 -> 184/116/604 B with SAVE_GU (Triton 3.6), unchanged without.
* tile sweep (dev/moe_bwd_tiles; every variant's output bitwise the default's): DGRAD1_TILES and DGRAD2_TILES
  (their comments hold the tables); the wgrad variants (4 stages, 128x256, 256x128, BR = 128, the per-tile
  kernel) all lost to 128x128x64 at 3 stages.
* final (136b0f2, ``kosmos bench moe --ep 1 --model qwen3-235b --tokens 4096 --direction fwd,bwd,fwd+bwd``,
  results/h200x1/history/s11-moe-bwd-ep1-136b0f2.*): backward 8.37 / 8.86 ms against nccl-a2a's autograd 9.72 /
  10.42 (uniform / zipf:1.2): 1.161x / 1.176x (bar 1.3x: missed); fwd+bwd 1.31x / 1.34x. Stages (probe): dgrad2
  1.244 ms (0.66x torch._grouped_mm's GEMM alone), wgrad2 1.238 (0.79x), wgrad1 2.149 (0.87x), dgrad1 1.589
  (1.03x); the glue (sort, permute, gather of g | u, do, unpermute, router, dx sum: ~1.8 ms) and ~0.3 ms of gaps
  between the ~110 launches.
  Host time inside one backward call: ~5 ms (nccl-a2a's autograd ~2 ms) -- hidden in the bench by its spin,
  not in a host-bound loop.
Third speed pass (session 12, one H200, Triton 3.6; results/h200x1/s12, calls a-f):
* dgrad2 unfused (``DGRAD2_FUSED = False``): z = dy_rows W2[e]^T by the dgrad1 GEMM kernel (128 x 256, bf16 out,
  as autograd's GEMM rounds it), then ``_swiglu_backward_kernel`` (the epilogue's arithmetic over 8-row blocks,
  the gate gradient summed left to right over F: deterministic; 64 registers). qwen3 4k: fused 1.244 ms, the
  GEMM alone 0.797 (1.04x torch), unfused 0.947 (predicted ~0.97); deepseek-v3 4k: 3.44 -> 2.54 ms (1.31x
  torch). The fused epilogue cost 0.45 ms over its GEMM: one resident program per SM cannot hide g | u loads
  and four stores. dw_rows' error moves to bf16 level (z rounded), as nccl-a2a's autograd has it.
* the router's GEMMs on bf16 tensor cores (``bf16_mm_fp32``, ``router_gemm_backward``: dl = hi + lo in bf16, two
  GEMMs, fp32 accumulation; errors vs fp64 2-3e-6, GPU-tested): deepseek-v3 router 1.27 -> 0.37 ms, qwen3
  0.51 -> 0.25 ms.
* wgrad2 where experts average <= 160 rows (``wgrad2_tiles``): 128x128x64, 4 warps, 2 stages, 2 programs per SM;
  deepseek-v3 4k 4.09 -> 3.75 ms. Lost or tied: TMA stores (2 and 3 stages), 128x64 / 64x128 at 3-4 programs
  per SM, 128x128x32 (wins qwen3 wgrad2 1.203 vs 1.237, loses wgrad1), 64-row m-tiles for dgrad1 (5.18 ->
  6.62-7.73 ms at deepseek) and dgrad2. tl.range(flatten=True) cannot fuse the persistent wgrad's tile and row
  loops (inside the expert loop; Triton fuses a top-level nest only): cross-tile pipelining needs a row layout
  padded per expert to BR (zero rows), so that one host descriptor can serve all experts -- not built.
* bench (results/h200x1/history/s12-moe-bwd-ep1*.md, d78133d): backward vs nccl-a2a's autograd qwen3 4k 1.365 /
  1.371x, 8k 1.488 / 1.435x (uniform / zipf:1.2); deepseek-v3 4k 1.273 / 1.229x, 8k 1.227 / 1.210x (the bar,
  1.3x, met at qwen3, not at deepseek-v3). Expert GEMMs vs torch (probe, qwen3 4k): wgrad2 0.78, wgrad1 0.88,
  dgrad2 0.87, dgrad1 1.02; deepseek-v3 (probe, call c): wgrad2 0.80 (0.875 on the few-rows tiles in call d's
  tiles probe), wgrad1 0.88, dgrad2 1.31, dgrad1 1.26.
Flat wgrad loop on a padded row layout (built in session 12; measured and made the default in session 13):
``expert_weight_grads_padded`` / ``_expert_wgrad_flat_kernel``. The layout (``padded_row_offsets``,
``padded_rows_bound``, ``padded_layout``; ``pad_expert_rows`` is the stand-alone copy the probe times):
expert e's rows from pad_offs[e] = the exclusive cumsum of ceil(counts / 64) * 64 (device-side, no sync), R_pad
<= R + E * 63 rows (host-known), the gap rows zero in at least one operand (the other finite). One TMA descriptor
per operand over the whole padded array (made once per program) then serves every expert, so the persistent
grid's tile and row loops become ONE loop over the program's row steps of all its tiles (tile advance and
epilogue in ``if``s at the step counter's wrap), which Triton software-pipelines across tiles: the next tile's
TMA loads fly during this tile's epilogue. tl.range(flatten=True) cannot build it: FuseNestedLoops fuses an inner
loop only if its bounds are invariant to the outer loop, and counts[e] is a load per tile (TTGIR, Triton 3.9:
with a kernel-argument bound the nest fuses, with counts[e] it stays two loops); the hand-flattened loop is one
scf.for, descriptor loads 1-2 steps ahead, wgmma async. Per tile the same ascending BR-row steps and fp32 chain
as the other wgrad kernels: bitwise their dW (interpreter-tested, incl. garbage in one operand's gaps; GPU test
written). sm_90a (local Triton 3.9, qwen3-like shapes): 128x128x64 8 warps 2 stages (WGRAD_FLAT_TILES) 107
registers, 96 KiB (two per SM); 3 stages 94 regs, 128 KiB (one per SM: the epilogue's 32 KiB layout-conversion
buffer is live beside the pipeline's now); 4 warps 2 stages 176 regs, 72 KiB; 128x256x64 3 stages 165 regs, 176
KiB; fp32 out 108 regs, 128 KiB; no spills in any. PREDICTION (unmeasured): deepseek-v3 4k, ~128 rows per expert
(2 row steps per tile, ~5200 tiles per SM over both wgrads, 2.15 us each measured): the loads leave the critical
path, the stores (22.5 GB, ~6.8 ms at ~3.3 TB/s) become it: both wgrads 11.2 -> ~8.5 ms (7.5-10); qwen3 (4 steps
per tile) ~5% at best. The padding copy is not in that figure: pad_expert_rows (torch gathers, ~3.5 GB of traffic
for wgrad1's operands) ~1.2 + ~1.0 ms, a fused copy ~0.5 + 0.45 ms, 0 if the producers (the dispatch's row
gather, dgrad2's epilogue, scaled_rows) write the padded layout directly -- the next step if the kernel wins
(dev/moe_bwd_tiles --model deepseek-v3 --only wgrad2,wgrad1: its "flat" rows and the "-pad" rows).
MEASURED (session 13, one H200, Triton 3.6; results/h200x1/s13, calls a-h):
* the flat loop against the persistent kernel (tiles probe, every variant bitwise): deepseek-v3 4k wgrad2 3.74 ->
  2.97 ms, wgrad1 7.31 -> 6.15 (both 11.05 -> 9.12, predicted ~8.5); qwen3 4k wgrad2 1.23 -> 0.92 (1.06x torch),
  wgrad1 2.16 -> 1.82 (1.02x); deepseek-v3 8k zipf:1.2 wgrad2 6.37 -> 5.55 (256x128), wgrad1 12.64 -> 10.10.
  pad_expert_rows as a separate copy costs 1.7 + 2.1 ms at deepseek-v3 4k: more than the loop saves.
* so moe_backward writes the layout where its rows are made (``PADDED_ROWS``, the default; ``padded=False``
  the packed twin): ``padded_layout`` gives the sorted rows' padded places (index tensors, no host sync);
  ``gather_rows`` / ``gather_rows_and_scaled`` gather x_rows, dy_rows and do = w * dy (one read of dy's rows)
  straight into it with zero gap rows (index -1), the saved g | u likewise; dgrad2's GEMM and dgrad1 take the
  padded offsets (the SwiGLU pass reads z's unwritten gap rows as zeros, through the rows' validity, so [dg |
  du], h and the gate gradients are zero there; session 13 first zero-filled z, R_pad x F bf16); the dispatch
  backward and the gate gradients read the rows back through ``row_of``. Every row's arithmetic is the packed
  path's, so the gradients are bitwise the packed path's (interpreter tests at W = 1 and 2, GPU test, and the
  layout A/B at both models). Whole backward, interleaved in one process (dev/moe_bwd_layout_ab): qwen3 4k 6.97
  -> 6.53 ms, deepseek-v3 4k 20.95 -> 20.04.
* tiles: 128x256x64 s3 (WGRAD_FLAT_TILES, one program per SM, 181 registers, 176 KiB), with the 256-wide side on
  dW's shorter dimension (wgrad2: WGRAD_FLAT_TILES_TALL, 170 registers); fp32 output 128x128 s2. Lost: a tile
  picked from the mean rows per expert (128x128 4 warps at <= 160: -0.17 ms at deepseek-v3 4k uniform, +3 ms
  at zipf:1.2 with the same mean); 128x256 with 2 stages; 128x256x32 with 4 stages (0.1-0.3 ms behind); a
  TMA-store epilogue through one [E, KA, KB] descriptor (asynchronous; bitwise the pointer stores; removed after
  call j): deepseek-v3 8k zipf wgrad2 256x128 5.52 -> 5.67 ms, wgrad1 128x256 9.85 -> 10.45 (154-156 registers
  and 208 KiB on local Triton 3.9 against 160-165 and 176 KiB).
* bench (results/h200x1/moe-bwd-ep1*.md, 188a3a4): backward vs nccl-a2a's autograd, uniform / zipf:1.2, qwen3
  4k 1.458 / 1.441x, 8k 1.548 / 1.529x; deepseek-v3 4k 1.339 / 1.297x, 8k 1.315 / 1.296x (bar 1.3x: two
  deepseek zipf points 0.3% short); 48-53 GiB per deepseek-v3 point.
* deepseek-v3 8k zipf:1.2 by stages (probe, call f): dgrad2 4.19, wgrad2 6.11, wgrad1 10.03, dgrad1 8.68, the
  row gathers ~1.8, the rest ~1.3 ms; 161 launches (nccl-a2a 44); the stages sum to 32.2 against 33.4 for the
  whole call. Host time ~3.5-5 ms per call (cProfile: many small torch ops, ~0.9 ms of Triton launches).
Session 14 (one H200, Triton 3.6; results/h200x1/s14, calls a and c):
* z's gap rows read as zeros through the rows' validity (``_swiglu_backward_kernel`` HAS_VALID; no R_pad x F
  memset of z) and the row gathers stop at the last expert's padded end (``padded_layout``'s end, ``limit=``):
  deepseek-v3 backward, kosmos rows, interleaved 3x, each tree from its own directory: 4k 19.91-20.26 ->
  19.82-20.07 ms (uniform), 20.26-20.37 -> 20.18-20.68 (zipf:1.2); 8k 30.16-30.33 -> 29.89-30.11, 31.57-31.89
  -> 31.42-31.54 (faster in every pair at 8k; 4k inside the spread); geomean 1.000 over the four points
  (predicted -0.1 to -0.25 ms). Same gradient errors to the last digit. Merged (not slower, one memset fewer).
* dgrad tiles at deepseek-v3 8k zipf:1.2 (dev/moe_bwd_tiles, call c): the defaults stay best -- dgrad2
  128x256x64 s4 3.95 ms (0.98x torch), dgrad1 8.42 ms (0.97x); 64-row m-tiles 0.73-0.80x, 128x128 0.77x.
NEXT: the one-launch backward (the plan above); the row-bookkeeping torch ops into one kernel (launch count).

The one launch (session 14; built by a helper and interpreter-tested, then run on the GPU: MEASURED at the end).
``moe_backward(..., one_launch=True)`` at W = 1 on the padded layout (the default, ``ONE_LAUNCH = True``, since
session 21: measured below; one_launch=True on the packed layout is a ValueError, no fallback; W > 1: "The one
launch at W > 1" below) runs the expert part as ONE persistent launch (``expert_backward_one_launch``,
``_moe_backward_experts_kernel``; GRID programs, one per SM, ``programs=`` for tests) after the same row gathers
and [g | u] (saved or recomputed) as the multi-launch path, and before the same torch router backward (since the
helper branch router-in-launch: the router backward is three more stages of the launch by default -- "The router
backward in the launch" below).
Stages, in schedule.py's drain order (each a queue with one atomic head in local scratch, except WGRAD):
  DGRAD2(gm, n)   z = dy_rows W2[e]^T, global m-tile gm (m-tiles numbered over experts as _mtile_plan's, on the
                  padded offsets), F-tile n: _dgrad1_tile, today's unfused dgrad2 GEMM (DGRAD1_TILES, bf16 z);
                  then +1 on dgrad2_done[gm] (acq_rel). Task t = gm * ceil(F/BN) + n: m-tile-major, so the first
                  m-tiles complete first.
  SWIGLU(gm)      once dgrad2_done[gm] = ceil(F/BN): _bwd_swiglu_mtile -- _swiglu_backward_rows over the
                  m-tile's rows in 8-row blocks (BF as today's pass) up to the expert's padded end (its gap rows
                  get zeros: the flat wgrad reads them; the next expert's rows are another m-tile's), z's gap rows
                  read as zeros through valid; [dg | du], h, dw_rows; then swiglu_done[gm] = 1 and +1 on
                  swiglu_count (release). ``BWD_SWIGLU_ON_COMPLETION = True``: run by the program whose dgrad2 tile
                  completes the m-tile (its atomic returns ceil(F/BN) - 1), right there, so the memory-bound pass
                  runs beside the other programs' GEMM tiles with z still in L2 and nothing waits; False: its own
                  queue after DGRAD2's, each task waiting (bounded) for its m-tile's tiles -- which starts only
                  once every dgrad2 tile is claimed, leaving the pass alone on the GPU (both tested bitwise).
  DGRAD1(gm, n)   waits swiglu_done[gm]; dx_rows = [dg | du] W13[e]^T (_dgrad1_tile); +1 on dgrad1_count.
  WGRAD           no queue: each program waits swiglu_count >= the m-tiles of all experts, then runs its own
                  share of both flat loops (_wgrad_flat_run: dW2 = h^T do, then dW13 = x_rows^T [dg | du]; tile g
                  is program g % GRID's, as in the standalone kernel), so Triton pipelines across its tiles as
                  there (session 13: a per-tile queue drained the pipeline at every tile, 7.31 vs 6.15 ms).
                  Nothing waits on WGRAD.
  UNPERMUTE(b)    waits (once per program) dgrad1_count >= every DGRAD1 tile; tokens [8b, 8b + 8) in [8, 256]
                  blocks, each token's k rows summed in slot order in fp32 (_unpermute_sum_cols, unpermute_sum's
                  arithmetic, the slot loop unrolled so a block's k loads are in flight together: one program per
                  SM has no other memory-level parallelism) into dx_e.
The m-tile count is computed on the device (sum of ceil(counts / BM)); the scratch (heads, exit counter, the two
counts, dgrad2_done and swiglu_done per m-tile up to the static bound) is zeroed by the last program out
(device.exit_program_zeroing; its own epoch slot), so no call needs a reset launch or a host sync.
Deadlock-freedom (schedule.py's rule): a task waits only on tasks of earlier stages, all claimed from shared
heads by programs already running them before any program gets past that stage (SWIGLU on completion: inside
a claimed DGRAD2 task, waiting for nothing); WGRAD is statically owned, but nothing waits on it and its inputs
come from shared-head stages. So the launch needs no co-residency and runs under TRITON_INTERPRET=1, where
programs run one after another: program 0 drains DGRAD2 (with SWIGLU) and DGRAD1 alone, finds every wait
satisfied, and the others find the queues empty -- there a wait that spins is a bug, bounded at 1000 spins
(BWD_INTERP_TIMEOUT_NS). Every wait is device.wait_geq (bounded: a stage left out of the ``stages`` mask times
out with the op, task and m-tile in the error record -- tested). UNPERMUTE is last, after WGRAD: by the time a
program has run its wgrad share, DGRAD1 is done, so it does not idle on the global count.
Bits: every task runs the standalone kernel's tile function (_dgrad1_tile, _swiglu_backward_rows,
_wgrad_flat_run, _unpermute_sum_cols) at the same tiles, and every sum is per output tile or per row in a fixed
order independent of which program runs it or how many there are: dx, d_router, dW13, dW2 are bitwise the
multi-launch path's (interpreter tests with every buffer of the launch poisoned, 2-4 programs, both SWIGLU
forms; GPU twin written). (Caveat for the GPU: the SwiGLU pass's row sum is a tl.sum over [8, BF] with 8 warps
as in its own kernel; the same shape and warps should give the same reduction layout, which the GPU test
checks.) Rows the multi-launch SwiGLU pass computes and no one reads -- the rows past the last expert's padded
end (up to E * 63), whose g | u the gathers leave unwritten (the interpreter's exp overflow warnings there) --
are not computed here.
Trace: ``expert_backward_one_launch(trace=)`` records every task and wait (codes.EV_BWD_*, EV_WAIT; device.trace,
compiled out without it) -- the first thing to look at on the GPU (do SWIGLU passes run beside DGRAD2 tiles, how
long WGRAD's start skew is, whether any wait is long).
What is saved / recomputed: nothing new -- z [R_pad, F] bf16 still goes through HBM between DGRAD2 and SWIGLU (the
unfused dgrad2 measured faster than the fused epilogue, session 12; on completion it is read back while in L2),
h is stored for WGRAD2, g | u saved or recomputed before the launch as before. Launches: the six of dgrad2 GEMM,
SwiGLU pass, both wgrads, dgrad1 and unpermute become one (plus the host tables' few torch ops).
sm_90a (local Triton 3.9, ``python -m dev.kernel_resources --world 1 --kernels moe_backward``, qwen3-like shapes):
250 registers (bf16 or fp32 wgrad, either SWIGLU form; 254 traced), no spills, 192 KiB shared -- one 8-warp
program per SM; at deepseek-v3-like shapes (E = 256) 255, no spills: no headroom left. The largest stage sets
it: compiled with one stage at a time (a constexpr mask, diagnostic only) DGRAD2 250 (228 with SWIGLU on
completion inside it), DGRAD1 252, WGRAD 179 registers / 176 KiB, UNPERMUTE 48 / 8 KiB, against 199 / 192 KiB for the
standalone dgrad1 kernel and 165 / 176 KiB for the flat wgrad; DGRAD2 with one task instead of the claim loop
190. These are what ptxas chose under its cap (255 at 256 threads), not a floor: the tile's store through
int32 offsets (common.store_rows) took DGRAD2 alone 250 -> 220 and the standalone dgrad kernel 199 -> 158, yet
left the whole launch at ~250 -- so not kept; spills are the measure, and there are none. No stage runs a
smaller tile than today. All four GEMM loops are software-pipelined TMA loops in the TTGIR (28 async TMA copies:
2 in each loop body, 2 x 6 in the 4-stage dgrads' prologues, 2 x 4 in the 3-stage wgrads'; per-loop depths by
tl.range(num_stages=)); the SwiGLU and unpermute loops are plain loads (no cp.async pipelining).
PREDICTION (unmeasured): at W = 1 the GPU already has no idle time between these launches (session 13), so the
one launch should take the sum of today's six kernels, minus five launch gaps (~10-20 us), minus most of the
SwiGLU pass (on completion it runs beside DGRAD2's tensor work on other SMs: its 0.15 ms at qwen3 4k, ~0.3-0.4 at
deepseek-v3 8k), plus WGRAD's start skew (a program starts its share when the DGRAD1 queue is drained, up to one
dgrad1 tile later than another: ~10-20 us), plus UNPERMUTE on one 8-warp program per SM against its own kernel's
many small programs (~0-0.1 ms). qwen3 4k: today's stages ~5.4 ms (dgrad2 0.95 with its pass, wgrad2 0.92,
wgrad1 1.82, dgrad1 1.59, unpermute 0.10) -> ~5.25 ms (5.1-5.5); deepseek-v3 8k zipf:1.2 29.1 (4.19 + 6.11 +
10.03 + 8.68 + ~0.1) -> ~28.8: 1-3%, as session 13 expected (a win there only from what runs beside a GEMM);
with BWD_SWIGLU_ON_COMPLETION = False the pass is exposed again and slower than its own kernel (one 8-warp
program per SM, 8-row blocks: ~1.5x), ~+0.1 ms over today. The point is W > 1.
MEASURED (session 14, one H200, Triton 3.6; results/h200x1/s14/e and /f): the GPU tests pass at the merged code
(bitwise the multi-launch gradients at T = 3001 on all SMs and on 7 programs; the stalled-stage timeout raised,
naming its wait, for both SWIGLU forms). Whole backward, padded multi-launch vs one launch, one process,
interleaved 2x (dev.moe_bwd_layout_ab --variants padded,one-launch, 10 timed calls each), gradients bitwise
equal first: qwen3-235b 4k uniform 6.734 / 6.471 -> 6.612 / 6.626 ms (pass 0 / 1: inside the pass-to-pass
spread); deepseek-v3 4k uniform 20.289 / 20.554 -> 20.682 / 21.237 (+2-3%, slower in both passes). So
ONE_LAUNCH stays False. Session 16 (results/h200x1/s16/b), deepseek-v3 4k zipf:1.2: padded 20.328, one launch
22.318 ms (1.098x). Tried and removed: the SwiGLU blocks' two column steps' loads issued before either's
stores (more bytes in flight for one program per SM; the same bits, GPU-tested; predicted -0.3 ms): 22.289
(1.096x), no gain. Traced: dgrad2 1.93 ms busy per program, SwiGLU 0.39, dgrad1 4.84, wgrad2 3.82, wgrad1 7.74
(its span 8.8 ms), unpermute 0.26, waits 0.14. Still open: which of SWIGLU beside the dgrads, WGRAD's start
skew or the 255-register kernel's dgrad tiles costs the ~2 ms, and 8k.
Session 20 (one H200, Triton 3.6; results/h200x1/s20, calls s20a-s20h; predictions in s20/predictions.md), the
router in the launch throughout, deepseek-v3 unless named, one launch / padded multi-launch, interleaved:
* the ~2 ms, answered. Part was the bench's timing, not the kernel: the call's 3.5-4.7 ms of host time exceeded
  kosmos_bench.timing's fixed 2 ms spin, and the torch ops before the launch left the GPU idle until the host
  reached it (s20a: the launch's own span 18.94 ms + 1.2 ms of torch ops before it, against 21.12 ms timed). With
  the spin covering the warm-up host time (timing.hide_cycles): 4k zipf:1.2 1.062 -> 1.040x, 4k uniform 1.002x,
  qwen3-235b 4k 1.008x (s20b). The profile of one call (dev/moe_bwd_gaps, s20f) then shows < 0.2 ms of idle
  between kernels in either path.
* the rest is WGRAD1, and only with skewed routing: every other stage runs at its standalone kernel's time
  (s20a 4k zipf: dgrad2 + SwiGLU 2.39 ms, dgrad1 4.93 vs 4.90, wgrad2 3.69 vs 3.87), but WGRAD1 took 7.33 ms busy
  per program against 6.88 for the standalone kernel, and at 8k zipf 11.95 against 9.79 (s20d; 1.084x whole).
  WGRAD2's ends spread over ~0.7 ms, so the programs entered WGRAD1 out of step: program p's tiles are p, p + GRID,
  ... of every expert in turn, and a heavy expert's panels (~8000 rows at 8k zipf: x_rows + dgu 180 MB) are
  shared in L2 only by programs on the same expert at about the same rows; the standalone kernel's programs start
  together. Uniform routing (experts of ~2 row steps, operands that fit L2) lost nothing. Hence BWD_WGRAD1_SYNC: a
  rendezvous between the two loops (device.soft_barrier on WGRAD's otherwise unused head slot: at most 5 ms, no
  error, skipped under the interpreter -- a performance device, not a dependency). s20e: WGRAD1 11.95 -> 9.66 ms
  busy at 8k zipf (predicted ~10.0); the one launch 8k zipf 1.090 -> 1.032x, 4k zipf 1.050 -> 1.021x, 4k uniform
  1.019 -> 1.014x (the same tree with and without it, one process).
* stragglers: with the rendezvous its median program waited 0.5 ms, for the same SM pairs (programs 109-115,
  76-79) 4-10% slower in both wgrads -- uncorrelated with their shares' row steps (-0.36 / +0.33), so the static
  share is not the cause and cannot be its cure. Hence BWD_WGRAD_DYNAMIC: the last 1/16 of each wgrad loop's tiles
  claimed in runs of 8 tiles from an atomic head (_wgrad_flat_run's DYNAMIC; one flat loop instance for the static
  share and every run: two instances took 288 KiB of shared memory). s20h: 8k zipf 1.032 -> 1.027x, 4k zipf
  1.021 -> 1.013x (predicted ~1.01-1.02 and ~1.01); dw13 / dw2 bitwise the multi-launch path's on the GPU (dx /
  d_router fp32-level, as with the router in the launch). Registers (local Triton 3.9): 250-255, no spills, 192
  KiB at W = 1 and in the EP build at W = 2 (the W = 1-layout traced router build at W = 2: 8 B, as before).
  ONE_LAUNCH stays False: 1.3-2.7% behind at zipf, ~1.4% at uniform. Left: the rendezvous's own idle (~0.1-0.3
  ms: the whole of WGRAD2 is static but its last 1/16), the ~0.2-0.4 ms dgrad2 + SwiGLU loses at 8k zipf, and the
  torch ops before the launch (1.2 ms at 4k, 2.0 ms at 8k: the row gathers, g | u's gather, the sort) -- as a
  first stage they could run beside DGRAD2's first tiles.
Session 21 (one H200, Triton 3.6; results/h200x1/s21, calls s21a-s21e; predictions in s21/predictions.md), the
router in the launch throughout, one launch / padded multi-launch, interleaved in one process:
* DGRAD1 without per-task synchronisation (BWD_DGRAD1_LEAN): each of a program's ~138 DGRAD1 tasks at deepseek-v3
  8k began with a uniform atomic read of its m-tile's SwiGLU flag, fence.acq_rel.sys and the proxy fence, and
  ended with a barrier and a release atomic (s20e's trace: 192 us per program in those waits). Now a program
  checks the global SwiGLU count (device.reached) until it has seen every pass done and then waits no more, its
  waits use a gpu-scope acquire (GPU_TMA: the data is this GPU's own), and it adds its finished tiles to
  UNPERMUTE's count once, after its last. s21a: one-launch-strict (session 20's form) 33.104 -> 32.854 ms at 8k
  zipf:1.2 (2 passes; the spread +-0.3 ms), 20.768 -> 20.436 at 4k zipf.
* the SWIGLU pass software-pipelined (BWD_SWIGLU_STAGES = 3): one 8-warp program per m-tile issued one [8, 256]
  step's 12 KB of loads at a time (~185 us per m-tile pass at 8k, ~17 GB/s); the (row block, column step) nest as
  one tl.range loop over 3 stages keeps the next steps' z, g, u loads in flight (the same steps in the same order,
  the gate gradient's column sum restarted at each block's first step: the same bits, interpreter- and
  GPU-tested). s21b (3 passes): 8k zipf padded 31.969, one launch 31.574 (0.988x), nested 32.085 (1.004x); 4k zipf
  padded 20.096, one launch 19.922 (0.991x), nested 20.375; SWIGLU busy per program 0.91 -> 0.69 ms, the launch's
  span 28.68 -> 28.26 ms (trace).
* the other points (s21c, 2 passes): deepseek-v3 4k uniform 0.999x, 8k uniform 0.988x; qwen3-235b 4k uniform
  1.001x, 4k zipf 1.000x, 8k uniform 1.004x, 8k zipf 1.004x. So ONE_LAUNCH = True at W = 1. The bench at that
  commit (7e25a0c; results/h200x1/moe-bwd-ep1*.md), backward over nccl-a2a's autograd, uniform / zipf:1.2:
  qwen3-235b 1.494 / 1.493x (4k), 1.546 / 1.585x (8k); deepseek-v3 1.374 / 1.333x (4k), 1.315 / 1.308x (8k).
* lost or tied (s21a, not kept): 4/16 of each wgrad loop claimed (dyn4) 32.864 at 8k zipf, 20.648 at 4k (against
  32.854 / 20.436); the same in 16-tile runs 32.702 at 8k.
Registers (local Triton 3.9, dev.kernel_resources --world 1): 250-255, no spills, 192 KiB, one scf.for fewer.
W > 1 (the plan of session 14; built since, differently in places: "The one launch at W > 1" below): COMBINE-BWD
becomes a first stage (dy rows and the gate weights
pushed once per destination rank into its receive rows, as the forward's ROUTE/dispatch does, with per-source
flags and counts; the destination's plan -- counts, padded offsets, first m-tiles -- built on the device by one
elected program as moe_forward._ensure_plan does, and a PERMUTE-like stage gathering the rows into the padded
layout; DGRAD2 tasks wait per expert as the forward's GEMM1 waits on PERMUTE). DISPATCH-BWD moves into DGRAD1's
epilogue (each row, with its gate gradient, stored straight into its token's rank's [t, slot] buffer and +1 on
that rank's per-token-block counter, as the forward's GEMM2 combine epilogue), and UNPERMUTE becomes the
forward's FOLD: per token block, wait for k * ceil(H/BN) pieces, sum in slot order -- the global dgrad1_count
wait becomes that per-block counter. Refinements left: WGRAD readiness per expert (a shared head over groups of
experts whose m-tiles are through SWIGLU, one flat-loop run per group: one pipeline drain per group instead of
per tile), the row gathers and [g | u]'s gather as a first stage (per m-tile, in 2-D blocks for memory-level
parallelism; with the recompute, x_rows must exist before the launch for torch's GEMM1), the router backward
(built: below).

The router backward in the launch (issue 15; built by a helper on branch router-in-launch after session 17,
interpreter-tested; its GPU tests passed on the H200 in session 18 -- results/h200x1/s18/README.md, calls s18g
and s18h. MEASURED (session 19, one H200, Triton 3.6, dev/moe_bwd_layout_ab, deepseek-v3 4096 tokens zipf:1.2,
three interleaved passes, results/h200x1/s19/s19a): the multi-launch padded path 20.283 ms, the one launch with
the router inside 21.262 (1.048x), the one launch with the torch router after it 21.989 (1.084x): the router
stages save ~0.73 ms over the torch ops they replace, and the one launch is still ~5% behind the launches it
replaces (its expert part: session 15's trace). The figures below that are not register counts are the
predictions made before that run.)
``moe_backward(..., one_launch=True)`` now runs the router backward as three more stages of the one launch
(``BWD_ROUTER_IN_LAUNCH = True``, ``moe_backward(router_in_launch=)``; False keeps the torch ops after the launch:
then dx and d_router are bitwise the multi-launch path's, as before; ``expert_backward_one_launch(router=
RouterBackward(...))`` at the kernel level). What goes in: x [T, H] and Wr [E, H] as bf16 (the values the
multi-launch path's tensor-core router GEMMs use), the decision experts [T, k] (an int32 copy), the routing's
differentiable part (routing, renormalize, routed_scaling), and the fp32 logits [T, E], RECOMPUTED before the
launch by bf16_mm_fp32(x, Wr^T) exactly as the multi-launch path does (one cuBLAS GEMM, 2TEH = 15 GFLOP at
deepseek-v3 4k tokens; not saved by the forward: moe_forward's router does not keep them -- saving them would
cost T*E*4 B, 4 MiB at deepseek-v3 4k, 8 MiB at 8k, and save that GEMM). The math, per token t (moe_reference's
stage 6, router_weights_backward_ref / router_logits_backward_ref / router_gemm_backward_ref):
    dw[t, j]  = dw_rows[inv[t*k + j]]             the gate gradients the launch's SWIGLU pass made (the
                                                  multi-launch path's dweights scatter, as a gather)
    softmax          p = softmax(l_t) (max subtracted, libdevice expf, one IEEE reciprocal of the sum), q_j = p[e_j]
    sigmoid-grouped  q_j = sigmoid(l_t[e_j])      (_torch_sigmoid; the bias and the group limit only chose e_j: no
                                                  gradient, nothing of them enters)
    renormalize      S = sum_j q_j + 1e-20, w_j = c q_j / S, dq_j = (c dw_j - <dw, w>) / S;  else dq_j = c dw_j
    softmax          dl_t = p (dp - <dq, q>), dp = dq at the selected experts (distinct), 0 elsewhere
    sigmoid-grouped  dl_t[e_j] = dq_j q_j (1 - q_j), 0 at the other experts
    hi = bf16(dl), lo = bf16(dl - hi)             router_gemm_backward's split (round to nearest even; |dl - hi - lo|
                                                  <= 2^-17 |dl|), stored as dl_hl [T, 2*EP] bf16 (hi in columns
                                                  [0, E), lo in [EP, EP + E), EP = E rounded up to 8: 16-byte
                                                  aligned halves for TMA; columns E..EP never written nor read --
                                                  each half is its own descriptor of shape [T, E])
    d_router  = hi^T x + lo^T x                   [E, H] fp32, one fp32 accumulator, tokens in ascending order
    dx        = bf16(dx_e + (hi Wr + lo Wr))      [T, H], the experts in ascending order: moe_backward's
                                                  (dx_e + dx_r).to(bf16) with dx_r never stored
The products of bf16 values are exact in fp32, so both GEMMs are fp32 GEMMs to ~2^-17 relative on the bf16 tensor
cores (tl.dot on TMA tiles; under the interpreter DOT_FP32's fp32 dots of the same bf16 values).
Stages (tile functions _router_dlogits_block, _router_dw_tile, _router_dx_tile), in the drain order DGRAD2
(+SWIGLU), [SWIGLU], DGRAD1, ROUTER_DL, WGRAD, ROUTER_DW, UNPERMUTE, ROUTER_DX -- what each waits for:
  ROUTER_DL(b)     tokens [8b, 8b + 8) (BWD_ROUTER_TOKENS; [8, next_pow2(E)] fp32 blocks): waits ONCE PER PROGRAM
                   for every m-tile's SwiGLU pass (SCB_SWIGLU_DONE >= the m-tile count, WAIT_BWD_SWIGLU index -1 --
                   the dw_rows it gathers), then the math above; +1 on SCB_ROUTER_DL_DONE (release).
                   Why a global count and not per-token readiness (a token's k m-tiles): a token's k rows lie in k
                   experts spread over the expert range and DGRAD2 runs m-tile-major (expert order), so its last
                   gate gradient comes near the end of DGRAD2 anyway (top-8 of 256: its last expert at ~89% of
                   the range on average) -- k counter reads per token would buy almost no earlier start. Placed
                   after DGRAD1, the wait is satisfied (every SWIGLU is done or running inside a claimed DGRAD2
                   task), and the programs that finish DGRAD1 early take these small tasks while the others finish
                   their last DGRAD1 tiles: ROUTER_DL fills DGRAD1's drain skew instead of lengthening WGRAD's
                   static shares.
  ROUTER_DW(i, j)  dWr tile [128, 128] (BWD_ROUTER_DW_TILES, 64 tokens a step, 3 stages; hi and lo share the
                   step's x tile): waits ONCE PER PROGRAM for every dlogits block (SCB_ROUTER_DL_DONE >=
                   ceil(T / 8), WAIT_BWD_ROUTER_DL) -- its sum runs over all tokens; stores the tile once. After
                   WGRAD, not before: work before the statically owned WGRAD lengthens those programs' shares, work
                   after it is balanced by the shared heads. Before UNPERMUTE: the long tiles (K = 2T) first --
                   the longest-first rule for the makespan -- and the compute-bound tiles run beside
                   UNPERMUTE's memory-bound blocks on the other programs (at deepseek-v3: E/128 x H/128 = 112 tiles,
                   so ~20 programs go straight to UNPERMUTE).
  UNPERMUTE(b)     as before, plus (router in the launch) +1 on its token block's counter unperm_ctr[8b // 128]
                   (release) after its stores.
  ROUTER_DX(m, n)  dx tile [128, 128] (BWD_ROUTER_DX_TILES, 64 experts a step; hi and lo share the Wr tile): waits
                   once per program for every dlogits block (as ROUTER_DW; in practice long satisfied), and per
                   task for its token block's UNPERMUTE tasks (unperm_ctr[m] >= ceil(min(T - 128m, 128) / 8),
                   WAIT_BWD_UNPERMUTE index m: the dx_e rows it adds); stores dx = bf16(dx_e + acc). Last: short
                   tiles (K = E) that even out the tail.
Deadlock-freedom as before: every new wait is on stages earlier in the drain order with shared heads (SWIGLU;
ROUTER_DL; UNPERMUTE); nothing waits on ROUTER_DW or ROUTER_DX. Under the interpreter program 0 runs every task
of every shared stage in order and finds every wait satisfied; a stage left out of the mask makes its consumers'
waits time out, named (tests: ROUTER_DL left out -> "every router dlogits block"; UNPERMUTE left out -> "the
dispatch backward (dx_e) of token block 0"). The scratch grows by the 3 heads, one count and ceil(T / 128) token
block counters, all zeroed by the last program out.
Bits: no float atomics; every dl row is computed by one task from its own row alone, every d_router and dx tile
by one task summing in a fixed order (tokens, resp. experts, ascending; hi then lo per step), whatever program
runs it or how many there are: bitwise the same run to run and on any grid (interpreter-tested on 2-4 programs;
GPU test written). Not the multi-launch path's bits (its router GEMMs are cuBLAS's, its softmax torch's): dx and
d_router agree with it to fp32 level (interpreter: d_router 1.4-2.9e-6 relative to the fp64 router backward on the
launch's own logits and gate gradients, and to the multi-launch path; dx within one bf16 ulp of bf16(dx_e + the
fp64 dx_r) everywhere, equal to it in 99.86-100% of the elements). dw13 and dw2 are untouched (bitwise).
Saved vs recomputed: the logits recomputed (before the launch, as before); p or s recomputed per token inside
ROUTER_DL from them; dl lives only as dl_hl (T x 2EP bf16: the bytes of fp32 dl; 4 MiB at deepseek-v3 4k); dx_e
still goes through HBM as fp32 [T, H] (UNPERMUTE -> ROUTER_DX, as it did to the torch add); dx_r, dq, dweights and
the torch path's fp32 dx_e + dx_r temporaries are never stored. Launches: the torch path's ~15 ops after the launch
(scatter, softmax / sigmoid, the gathers and sums of the routing backward, four bf16 GEMMs, two adds, a cast) go;
the logits GEMM before the launch stays.
sm_90a (local Triton 3.9, ptxas; ``python -m dev.kernel_resources --world 1 --kernels moe_backward``, qwen3-like
shapes, E = 128; deepseek-v3-like ones, H 7168, F 2048, E 256, through the same compile path by a scratch script):
  before the branch   the one launch 250 registers (fp32 wgrad 250, queued SWIGLU 250, traced 254), no spills, 192 KiB;
                      deepseek-v3-like 255 (traced 255), no spills
  with the router     softmax / sigmoid-grouped 250, fp32 wgrad 252, traced 242, no spills, 192 KiB; deepseek-v3-like
                      softmax / sigmoid-grouped 255, traced 254 / 255, no spills
  router off          (router_in_launch=False, the same build) 252, fp32 250, queued 250, traced 242; deepseek-v3-like
                      255 (traced 254), no spills
The two router GEMM loops are TMA-pipelined wgmma loops (46 async TMA copies in the TTGIR, 28 without them). On the
way there the first build spilled 4-12 B in some variants (fp32 wgrad; traced at E = 256; 16-token dlogits
blocks); nvdisasm -g put every STL / LDL on kernel-wide scalars held across WGRAD -- the call epoch, n_mt -- not
in the router code. So the epoch is now read just before the exit (still before the program's exit atomic,
which is all device.py's argument needs: the last program out stores the new one only after every exit atomic)
and n_mt is recomputed after DGRAD1 (a few loads of counts); with both, no variant above spills. 8 tokens per
dlogits block (4 spill-free too; 16 spilled 4 B before those two changes). ptxas's choices at its 255 cap are
chaotic (int32 in-tile offsets in the router tiles' stores, tried, moved the spills around): re-check this table
after any change to the kernel.
PREDICTION (unmeasured): at deepseek-v3 4k the torch router backward after the launch is ~0.4-0.5 ms (session 12:
its four bf16 GEMMs 0.37 ms, plus the fp32 elementwise ops over [T, E] and [T, H]); in the launch ROUTER_DL is a
few us per program, ROUTER_DW ~112 tiles of 2 x 64 steps (~60-70 us each on one SM at ~4.5 TF/s) overlapping
UNPERMUTE, ROUTER_DX 1792 tiles of ~5-8 us: ~0.15 ms of tail over the expert part -- so -0.25 to -0.35 ms per call
(1-2% of the ~20 ms backward). qwen3 4k: ~-0.15 ms. Left: the logits GEMM inside the launch (a first stage:
T/128 x E/128 tiles, K = H, nothing to wait for), dWr with the tokens split into fixed pieces (fp32 partials
summed in order by the piece-0 owner) if its ~65 us tiles show as a tail in the trace, dx_e kept out of HBM
(UNPERMUTE's slot sums folded into ROUTER_DX's epilogue: k gathered rows per [128, 128] tile, in column slices
for the registers), and W > 1.
Tests (tests/test_moe_backward.py). Interpreter, passing: test_moe_backward_one_launch_router_in_launch (softmax
with and without renormalisation, sigmoid-grouped with a bias, with and without; 2-4 programs),
test_moe_backward_one_launch_bounded_waits[ROUTER_DL-*, UNPERMUTE-*] (those stages left out), the trace test's router
cases, test_moe_backward_one_launch_without_tokens (T = 0: d_router zeros from the host, the router stages off).
GPU (passed in session 18, s18g / s18h): test_moe_backward_one_launch_router_in_launch_gpu (deepseek-v3: H 7168,
E 256, top-8 sigmoid-grouped with a bias, 512 tokens; qwen3: H 4096, E 128, top-8 softmax, 1000 tokens; softmax
without renormalisation at E = 60), test_moe_backward_one_launch_router_bounded_wait_gpu;
test_moe_backward_w1_never_syncs_gpu's one-launch case: passed on the H200 in session 19 (s19b), with the
multi-launch cases.
The one launch at W > 1 (issue 15; built by a helper on branch one-launch-ep in session 19, interpreter-tested at
W = 2 and 4; on the H200 (session 19, s19b / s19c): simulated ranks W = 2 (softmax; sigmoid-grouped, skewed) and
W = 4 against the fp32 reference, three epochs bitwise, the stalled peer's timeout, and the public op with two
ranks on one GPU over gloo + CUDA IPC all pass. NOTHING HERE WAS TIMED: one GPU cannot time a W > 1 exchange).
``moe_backward(..., group=, one_launch=True)`` at W > 1 (CUDA; the group's workspace) and, at the kernel level,
``expert_backward_ep_launch`` (explicit buffers: tests/simranks.MoEBwdRanks drives it) run the whole backward but
the logits GEMM in ONE launch of the same kernel (constexpr WORLD > 1: the W = 1 build compiles none of it), the
exchanges as stages over the forward's peer mechanism (symmetric data buffer regions in ``EPLayout``, the peer
pointer tables, epoch flags, consumer-reset counters, device.wait_geq / notify, the done-flag handshake).
Stages, in drain order (each a shared atomic head; new heads after the W = 1 scratch, at ``xs_base``):
  COMBINE-BWD(b)  tokens [b*XB, +XB) of this rank: to every rank d, a metadata row per token (per slot j: d's local
                  expert or -1, and the pair's place among this rank's pairs of that expert) and the gate weights;
                  each token's x and dy rows ONCE per d holding one of its experts, all at d's receive row
                  [rank * T + t] -- the token's own index, so no slot atomics (the forward's dispatch places rows by
                  an atomic counter, which is why it is not reused here). The rank's last task (a sys-scope acq_rel
                  count) writes this rank's pair counts of d's experts to d and raises d's flag FLAG_BASE + rank =
                  epoch (release). Before its first remote store each program waits for every peer's done flag
                  >= epoch - 1 (the forward's handshake: a peer may still read last call's rows).
  plan            every program entering any of the next stages: wait for every source's flag (>= epoch), then one
                  CAS-elected program builds counts[e] = sum over sources, pad_offs (the padded layout), first_mtile,
                  base[s, e] = rows of e from sources < s into local buffers (the W = 1 kernel's counts / pad_offs /
                  first_mtile arguments, now the launch's own output); the others wait for it (WAIT_BWD_PLAN).
  PERMUTE-BWD(p)  p < E/W: expert p's gap rows zeroed (x, dy, do, g | u, w, valid: the layout's contract); else
                  received rows of source s (own rows first): each pair's row at pad_offs[e] + base[s, e] + place --
                  x, dy, do = bf16(w * dy) (gather_rows_and_scaled's product), w, valid, and (source, p) for the
                  way back; +1 on placed[e] per row and per gap task (release).
  GU(gm, n)       [g | u] = x_rows W13[e] per (m-tile, 2F-tile), waiting for placed[e] = counts[e] + 1: g | u is
                  RECOMPUTED in the launch (the forward cannot know its row count at W > 1, so saving keeps the
                  worst case; ``saved_gu`` is refused there) by the backward's own dgrad tile (_dgrad1_tile with
                  B_KN: W13[e] read as it is, the same clipped TMA descriptors on the padded rows, fp32 accumulation
                  rounded to nearest even once) -- the forward's GEMM1 tile with SAVE_GU was the model, but it reads
                  the forward's packed layout; +1 on gu_done[gm].
  DGRAD2 .. WGRAD as at W = 1, unchanged arithmetic; DGRAD2 tasks also wait for placed[e] (their rows), the SwiGLU
                  pass for gu_done[gm] = ceil(2F / BN); DGRAD1 counts per m-tile (dg1_done[gm]) instead of globally.
  DISPATCH-BWD(gm) waits dg1_done[gm] = ceil(H / BN); each real row's dx (bf16) and gate gradient (fp32) straight
                  into its token's rank's combine rows [t*k + j] (remote stores), then +1 per row on that rank's
                  counter of the token's UNPERMUTE block (release, sys). A stage of its own rather than DGRAD1's
                  epilogue (simpler, the 255-register DGRAD1 untouched; costs one more read of dx_rows, from L2 when
                  the copy follows the tile) -- the epilogue form is the refinement.
  UNPERMUTE(b)    waits its counter >= k * tokens of the block (every rank's rows of its tokens), sums the combine
                  rows in slot order j = 0..k-1 in fp32 (_unpermute_sum_cols on the identity index: bitwise the
                  multi-launch path's unpermute of the same rows), resets the counter (consumer reset), +1 on the
                  router's token-block count.
  ROUTER_DL(b), ROUTER_DW, ROUTER_DX as at W = 1 but ROUTER_DL and ROUTER_DW after UNPERMUTE: the gate gradients
                  come back with the rows (comb_dw, pair order), so ROUTER_DL(b) waits for its token block's
                  UNPERMUTE tasks (which acquired them); d_router is this rank's tokens' part. Without the router in
                  the launch the kernel returns dx_e and the gate gradients and moe_backward's torch ops follow.
Row order, hence bits: an expert's rows are in (source rank, pair index) order -- the multi-launch path's (its
stable sorts) -- from a prefix count computed at the source (ep_pair_places: its stable expert sort's rank inside
the expert, device ops, no host sync) and the holder's base[s, e]; no place depends on an atomic, so dW13 / dW2 sum
the same rows in the same order on every run and grid (bitwise reproducible: tested over calls, re-poisoned). Not
the multi-launch path's bits: its g | u is torch's recompute (cuBLAS, or the CPU's matmul), the launch's a Triton
tile (interpreter: agreement to 5e-3 relative, the g | u roundings differ by an ulp here and there).
Deadlock-freedom (moe_forward's argument, with the stage order above): a task waits only for (a) tasks of earlier
stages of its own rank -- claimed from shared heads by programs already running them before any program moves
past that stage (SWIGLU on completion waits inside a claimed DGRAD2 task for GU, an earlier stage) -- or (b) peers'
earlier stages: the plan waits for the peers' COMBINE-BWD, UNPERMUTE for the peers' DISPATCH-BWD, and a peer's
COMBINE-BWD waits for nothing of this call (only the done flags of the previous call, set when each rank's
previous launch ended). DISPATCH-BWD waits only for this rank's DGRAD1, which waits only for this rank's earlier
stages and the plan; so every chain of waits ends at a COMBINE-BWD task, which every rank runs first. No wait
needs the programs of a launch, or the ranks' launches, to be co-resident beyond each rank's launch running: the
CPU interpreter runs each rank's launch program after program, in three phase launches per call (EP_PHASES:
COMBINE-BWD on every rank; PERMUTE .. WGRAD; UNPERMUTE and the router), every rank's launch of a phase before any
rank's next phase, with every wait satisfied at once (a spinning wait there is a bug, bounded); only the last
phase's launch (FINAL) zeroes the scratch, signals done and advances the epoch. Every wait is device.wait_geq
(bounded, named in the error record: a stalled peer -- rank 1's launches not run -- or a stage left out gives
KosmosTimeoutError's record, tested), no float atomic anywhere, no host synchronisation in the steady state.
Epochs: the workspace's slot (shared with the forward and the TP ops, as its done flags are); a rank's first write
into a peer's buffers (COMBINE-BWD) waits for the peer's done flag of the previous call; its combine writes need
none (they follow the owner's own COMBINE-BWD of this call, as the forward's combine does); the counters are reset
by their consumer, the plan state and every local counter by the last program out.
The fixed policy (the fixed-role ablation the forward has -- moe_forward's ``policy="fixed", comm_programs=S`` --,
for the bench's fixed-role rows at bwd / fwd+bwd; built after session 21 on branch fixed-role-bwd, interpreter-
tested; on the GPU in session 22 (s22b): simulated ranks W = 2, 8 bitwise the self policy, and the bench's rows at
EP = 2 with both ranks on one GPU; NOT TIMED: one GPU cannot time a W > 1 exchange): ``moe_backward(..., group=, one_launch=True, policy="fixed",
comm_programs=S)`` / ``expert_backward_ep_launch(policy=, comm_programs=)``, 1 <= S < GRID (a ValueError otherwise,
at W = 1 -- no communication -- and with the multi-launch path -- no programs to split). Programs pid < S take only
the communication stages, the other GRID - S only the rest: schedule.program_stages' role mask, asked stage by stage
(_takes, with the program id read afresh -- the mask kept in a register made ptxas spill 12 B there), the loop
unchanged (constexpr POLICY: the self and W = 1 builds compile none of it, ``fixed_comm`` an unused runtime argument
there; their PTX is the old one but for that parameter). Communication (BWD_COMM_STAGES) = COMBINE-BWD,
PERMUTE-BWD, DISPATCH-BWD, UNPERMUTE: the rows out to the experts' ranks, into the expert layout, back, and summed
per token -- the mirror of
the forward's ROUTE (its dispatch), PERMUTE and FOLD, all memory-bound moves of rows between ranks or between the
token and expert layouts. The rest = GU (GEMM1 again), DGRAD2 with its SwiGLU pass, DGRAD1, WGRAD and the router
stages (ROUTER_DL is per-token arithmetic on gate gradients already home, ROUTER_DW / ROUTER_DX GEMMs: compute, as
the forward's router is part of ROUTE only because ROUTE is the dispatch). WGRAD's static shares and its WGRAD1
rendezvous count the compute programs (program pid - S of GRID - S: with GRID the S communication programs' tiles
would never be computed, and the rendezvous would wait its full BWD_WGRAD1_SYNC_NS for programs that never come).
The same tasks with the same arithmetic at the same row places, so the gradients are bitwise the self policy's
(interpreter: S = 1 and 2 of 3 programs at W = 2 and 4, with and without the router; GPU, passed in s22b:
test_moe_backward_one_launch_ep_at_world_gpu[*-fixed], S = a quarter of each rank's programs).
Deadlock-freedom under the split: the stages in the code's order -- COMBINE-BWD < plan < PERMUTE-BWD < GU <
DGRAD2 (+ SWIGLU) < DGRAD1 < DISPATCH-BWD < WGRAD < UNPERMUTE < ROUTER_DL < ROUTER_DW < ROUTER_DX -- and every wait
is for tasks of a strictly earlier stage, this rank's or a peer's: COMBINE-BWD only for the previous call's done
flags; the plan for every rank's COMBINE-BWD (communication) and for the CAS-elected builder, who once elected
waits for nothing; GU and DGRAD2 for PERMUTE-BWD (communication); the SwiGLU pass on completion, inside a claimed
DGRAD2 task, for that m-tile's dgrad2 tiles (complete: its own atomic saw the last) and its GU tiles (compute, an
earlier stage); DGRAD1 for SWIGLU; DISPATCH-BWD (communication) for DGRAD1 (compute); WGRAD for the SWIGLU count;
UNPERMUTE (communication) for every rank's DISPATCH-BWD; ROUTER_DL (compute) for UNPERMUTE (communication);
ROUTER_DW / ROUTER_DX for ROUTER_DL and UNPERMUTE. Each role takes its own stages in that order and moves past one
only when its head is drained, i.e. every task of it is claimed by a running program of that role. By induction
over the order: if every stage before s completes on every rank, each claimed task of s completes (it waits only
on those), and s's role has a program (S >= 1 and GRID - S >= 1) that reaches s -- a program of the role is either
at an earlier stage of its own, which completes, or past s, which it is only once s is drained -- so s is drained
and completes. The roles do wait on each other both ways (DISPATCH-BWD on DGRAD1, ROUTER_DL on UNPERMUTE, which
waits through DISPATCH-BWD on DGRAD1 again), but never on a stage at or after the waiting one, so no chain of
waits closes. The last program out is unchanged: every program of either role arrives on the exit counter after
its last stage, and only the last one zeroes the scratch (heads, plan state, counters), signals done and
advances the epoch, after every program's arrival -- no program of either role reads the scratch after that, and
the call's epoch is read just before each arrival, as before. Interpreter: the communication programs are the
lowest pids, run first, so in EP_PHASES' second phase they would reach DISPATCH-BWD before any compute program had
run DGRAD1 (a wait that spins there is a bug, bounded): under the fixed policy the CPU tests' phases are
EP_PHASES_FIXED (COMBINE-BWD; PERMUTE-BWD .. WGRAD without DISPATCH-BWD; DISPATCH-BWD; UNPERMUTE and the
router). On a GPU one launch per rank, all programs resident, as for the self policy. Also fixed with it: the
queued SWIGLU form (BWD_SWIGLU_ON_COMPLETION = False) claimed a task before asking its mask, so a program without
SWIGLU in its mask dropped one; it now asks first (the default on-completion build is untouched).
Limits: the same T, H, F, E, k on every rank (the forward's contract; checked once per shape with the forward's
all-gather), T >= 1, H and F multiples of 8; buffers sized for the worst case (every token of every rank here:
W*T*min(k, E/W) expert rows, moe_forward.Layout's bound) -- the intermediates z, [dg | du], h, dx_rows at that
bound are the memory cost (at deepseek-v3-like W = 8, 4k tokens: ~2x the forward's expert buffers).
sm_90a (local Triton 3.9, ptxas; dev/kernel_resources' moe_backward_ep_kernels -- ``--world 2 --kernels
moe_backward`` runs it after the W = 2 compile of the other backward kernels --, qwen3-like H 4096, F 1536, E 128,
64 local experts, top-8, 1024 tokens per rank): the W = 2 build 254 registers (bf16 and fp32 weight gradients),
255 with the router in the launch, no spills, 192 KiB; the W = 1 build unchanged by the branch (252 / 250 fp32 /
250 with the router, softmax or sigmoid-grouped; no spills). At ptxas's cap: re-check after any change.
With the fixed policy (branch fixed-role-bwd; results/h200x1/s22/regs-moe-backward-fixed-role-local-triton39.txt and
regs-moe-backward-ep-fixed-role-triton36.txt): the self builds' PTX is the old PTX but for the one added .param
(W = 1, 2, 8; local Triton 3.9 and Triton 3.6.0), so their registers are unchanged (3.9: W = 2 254 / 250 fp32 / 255
+router, W = 8 246 / 254 / 250, no spills; 3.6.0: W = 2 255 / 255 / 255, W = 8 248 / 252 / 255 with 40 B spilled in
the +router build -- already so before the branch, unmeasured on a GPU); the fixed builds (S = 16): 3.9 W = 2 255 /
250 / 255, W = 8 254 / 246 / 254, no spills; 3.6.0 W = 2 255 / 254 / 255 no spills, W = 8 252 / 250 / 255 with 24 B
spilled in the +router build. (A first form keeping the role mask in a register spilled 12 B in the 3.9 W = 2
+router fixed build -- the program id, reloaded at each descriptor site: hence _takes.)
PREDICTION (unmeasured; no GPU here): the exchanges (dy and x out, dx back: ~3 x T k H bf16 per rank over NVLink)
overlap the other programs' GEMM tiles as the forward's dispatch and combine do; the GU stage costs GEMM1's FLOPs
(1.92 TFLOP at deepseek-v3 4k), as the multi-launch path's recompute does; the lead's A/B against the multi-launch
path (dev/moe_bwd_probe or kosmos bench moe --direction bwd at EP = 2) was to decide the default. Session 22 made
it the default untimed (ONE_LAUNCH_EP = True: neither path has a W > 1 timing; the launch is the design, and on
the GPU s22a passed W = 8 simulated ranks and two ranks on one GPU with the default); the two-GPU A/B is owed.
Tests: interpreter (tests/test_moe_backward.py, ``-k ep_``): vs moe_backward_ref at W = 2 and 4 (random, skewed --
every token to rank 0's experts --, an empty expert with sigmoid-grouped top-4, T = 11 / 13) and bitwise over two
calls; vs the multi-launch path at W = 2 (gloo processes); without the router (dx_e + the torch router); stalled
peer and stages left out (DISPATCH, PERMUTE, GU) time out, named. GPU, written, NOT RUN: the ``ranks`` tests
test_moe_backward_one_launch_ep_at_world_gpu (W = 2, 4 simulated ranks on one GPU, all launches resident,
three epochs bitwise) and _stalled_peer_gpu, and tests/test_ranks_one_gpu.py::
test_moe_backward_one_launch_two_ranks_on_one_gpu (the public op over gloo + CUDA IPC, after a forward on the same
workspace).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import device as dev
from .. import planning
from .. import schedule as sched
from ..codes import (EV_BWD_DGRAD1, EV_BWD_DGRAD2, EV_BWD_ROUTER_DL, EV_BWD_ROUTER_DW, EV_BWD_ROUTER_DX,
                     EV_BWD_SWIGLU, EV_BWD_UNPERMUTE, EV_BWD_WGRAD1, EV_BWD_WGRAD2, EV_COMM, EV_GEMM1, EV_PERMUTE,
                     EV_WAIT, OP_MOE_BACKWARD, TRACE_EVENTS, WAIT_BWD_COMBINE, WAIT_BWD_DGRAD1, WAIT_BWD_DGRAD1_MTILE,
                     WAIT_BWD_DGRAD2, WAIT_BWD_DISPATCH, WAIT_BWD_GU, WAIT_BWD_PERMUTE, WAIT_BWD_PLAN,
                     WAIT_BWD_ROUTER_DL, WAIT_BWD_SWIGLU, WAIT_BWD_UNPERMUTE)
from .common import POLICIES, policy_args

try:  # libdevice's expf for swiglu_h (Triton >= 3.0 spells it this way)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice


@triton.jit
def _to_out(acc, out_ty: tl.constexpr, RNE_BITS: tl.constexpr):
    """acc (fp32) in out_ty, rounded to nearest even. RNE_BITS (the CPU interpreter, whose fp32 -> bf16 cast
    truncates): the rounding done on the bits, so the interpreter's bf16 equals torch's .to(torch.bfloat16) as
    the GPU's cvt.rn.bf16.f32 does (finite values)."""
    if out_ty == tl.bfloat16 and RNE_BITS:
        bits = acc.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(out_ty)


@triton.jit
def _wgrad_tile_tma(a_desc, b_desc, rows, ti, tj, BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr,
                    DOT_FP32: tl.constexpr):
    """The fp32 sum A[rows, ti-tile]^T B[rows, tj-tile] over an expert's rows in ascending order, BR per step,
    through its TMA descriptors (one tile of both TMA wgrad kernels: the same sum, hence the same bits)."""
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    for r0 in range(0, rows, BR):
        acc = _wgrad_step(a_desc, b_desc, r0, ti, tj, acc, BI, BJ, DOT_FP32)
    return acc


@triton.jit
def _wgrad_step(a_desc, b_desc, r, ti, tj, acc, BI: tl.constexpr, BJ: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + A[r:r+BR, ti-tile]^T B[r:r+BR, tj-tile] (fp32): one row step of every TMA wgrad kernel."""
    a = a_desc.load([r, ti * BI])
    b = b_desc.load([r, tj * BJ])
    if DOT_FP32:  # the CPU interpreter's bf16 dot is wrong; fp32 is exact
        return tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc)
    return tl.dot(tl.trans(a), b, acc)


@triton.jit
def _expert_wgrad_kernel(a_ptr, b_ptr, offs_ptr, counts_ptr, out_ptr, KA, KB,
                         BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, DOT_FP32: tl.constexpr):
    """One output tile (e, i, j) of dW[e] = A[rows of e]^T B[rows of e], the operands through TMA: each program's
    descriptors cover its expert's rows alone (base = the expert's first row, shape [counts[e], K]), so a row
    step past the expert's end reads zeros -- never the next expert's rows -- and the loop (pipelined by
    num_stages) runs TMA -> shared memory -> wgmma with A's transpose a shared-memory view. Out in out_ptr's dtype
    (bf16 or fp32) from the fp32 accumulator, through a masked store."""
    pid = tl.program_id(0)
    n_i = tl.cdiv(KA, BI)
    n_j = tl.cdiv(KB, BJ)
    e = pid // (n_i * n_j)
    ti = (pid // n_j) % n_i
    tj = pid % n_j
    first = tl.load(offs_ptr + e).to(tl.int64)
    rows = tl.load(counts_ptr + e)
    a_desc = tl.make_tensor_descriptor(a_ptr + first * KA, shape=[rows, KA], strides=[KA, 1], block_shape=[BR, BI])
    b_desc = tl.make_tensor_descriptor(b_ptr + first * KB, shape=[rows, KB], strides=[KB, 1], block_shape=[BR, BJ])
    acc = _wgrad_tile_tma(a_desc, b_desc, rows, ti, tj, BI, BJ, BR, DOT_FP32)
    ci = ti * BI + tl.arange(0, BI)
    cj = tj * BJ + tl.arange(0, BJ)
    out = out_ptr + e.to(tl.int64) * KA * KB
    tl.store(out + ci[:, None] * KB + cj[None, :], _to_out(acc, out_ptr.dtype.element_ty, DOT_FP32),
             mask=(ci < KA)[:, None] & (cj < KB)[None, :])


@triton.jit
def _expert_wgrad_ptr_kernel(a_ptr, b_ptr, offs_ptr, counts_ptr, out_ptr, KA, KB,
                             BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, DOT_FP32: tl.constexpr):
    """The same with masked pointer loads and stores: the fallback where a TMA descriptor cannot describe the
    operands (KA or KB not a multiple of 8 bf16 elements: row strides not 16-byte aligned)."""
    pid = tl.program_id(0)
    n_i = tl.cdiv(KA, BI)
    n_j = tl.cdiv(KB, BJ)
    e = pid // (n_i * n_j)
    ti = (pid // n_j) % n_i
    tj = pid % n_j
    first = tl.load(offs_ptr + e)
    rows = tl.load(counts_ptr + e)
    ci = ti * BI + tl.arange(0, BI)
    cj = tj * BJ + tl.arange(0, BJ)
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    r = tl.arange(0, BR)
    for r0 in range(0, rows, BR):
        rr = (first + r0 + r).to(tl.int64)
        rm = (r0 + r) < rows
        a = tl.load(a_ptr + rr[:, None] * KA + ci[None, :], mask=rm[:, None] & (ci < KA)[None, :], other=0.0)
        b = tl.load(b_ptr + rr[:, None] * KB + cj[None, :], mask=rm[:, None] & (cj < KB)[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc)
        else:
            acc = tl.dot(tl.trans(a), b, acc)
    out = out_ptr + e.to(tl.int64) * KA * KB
    tl.store(out + ci[:, None] * KB + cj[None, :], _to_out(acc, out_ptr.dtype.element_ty, DOT_FP32),
             mask=(ci < KA)[:, None] & (cj < KB)[None, :])


@triton.jit
def _expert_wgrad_persistent_kernel(a_ptr, b_ptr, offs_ptr, counts_ptr, out_ptr, KA, KB, E,
                                    BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, GRID: tl.constexpr,
                                    DOT_FP32: tl.constexpr):
    """_expert_wgrad_kernel's tiles on a persistent grid of GRID programs: global tile g = e * n_tiles + t
    (t = ti * n_j + tj, the tiles of one expert consecutive) is program g % GRID's, and every program walks
    the experts in order, so the programs resident at a time work on one expert's tiles (its rows stay in L2)
    and each program builds its two TMA descriptors (its expert's rows, as _expert_wgrad_kernel's) once per
    expert instead of once per tile (~n_tiles / GRID tiles per expert and program), with no program launch
    per tile. Each tile as in _expert_wgrad_kernel: one program, the rows in ascending order, BR per step,
    fp32 accumulation rounded once -- bitwise its result. (Tried and removed, session 12 call b: the tile stored
    through a per-expert TMA descriptor instead of masked pointer stores, at qwen3 4k wgrad2 1.24 -> 1.33 / 1.50
    ms at 2 / 3 stages, wgrad1 2.14 -> 2.49 / 2.87.) tl.range(flatten=True) cannot fuse the tile and row loops
    here: Triton fused neither this nest inside the expert loop nor one whose row bound is loaded per tile
    (TTGIR, Triton 3.9, session 12); _expert_wgrad_flat_kernel flattens it by hand."""
    pid = tl.program_id(0)
    n_i = tl.cdiv(KA, BI)
    n_j = tl.cdiv(KB, BJ)
    n_t = n_i * n_j
    ci0 = tl.arange(0, BI)
    cj0 = tl.arange(0, BJ)
    for e in range(0, E):
        first = tl.load(offs_ptr + e).to(tl.int64)
        rows = tl.load(counts_ptr + e)
        t0 = (pid + GRID - (e * n_t) % GRID) % GRID  # this program's first tile of expert e
        a_desc = tl.make_tensor_descriptor(a_ptr + first * KA, shape=[rows, KA], strides=[KA, 1],
                                           block_shape=[BR, BI])
        b_desc = tl.make_tensor_descriptor(b_ptr + first * KB, shape=[rows, KB], strides=[KB, 1],
                                           block_shape=[BR, BJ])
        out = out_ptr + tl.cast(e, tl.int64) * KA * KB
        for t in range(t0, n_t, GRID):
            ti = t // n_j
            tj = t % n_j
            acc = _wgrad_tile_tma(a_desc, b_desc, rows, ti, tj, BI, BJ, BR, DOT_FP32)
            ci = ti * BI + ci0
            cj = tj * BJ + cj0
            tl.store(out + ci[:, None] * KB + cj[None, :], _to_out(acc, out_ptr.dtype.element_ty, DOT_FP32),
                     mask=(ci < KA)[:, None] & (cj < KB)[None, :])


WGRAD_TILES = (128, 128, 64, 8, 3)  # GPU (BI, BJ, BR, warps, stages): see the module docstring's figures
WGRAD_PERSISTENT_TILES = (128, 128, 64, 8, 3)  # the same for the persistent kernel (2 programs per SM)
WGRAD_PROGRAMS_PER_SM = 2  # 128 x 128, <= 96 KiB shared, ~105 registers x 256 threads: two fit an SM (else one)
WGRAD_KERNEL = "persistent"  # expert_weight_grads' default: "persistent" or "tiles" (session 10's measured one)
WGRAD_KERNELS = ("persistent", "tiles")
# moe_backward's GEMM2 weight gradient where the experts average <= 160 rows (the row mean known on the host:
# rows / experts, no sync): 4 warps, 2 stages, 2 programs per SM. Session 12 calls c, d (one H200): deepseek-v3 4k
# (~128 rows per expert) 4.09 -> 3.75 ms; at qwen3 4k (~256 rows) it ties on wgrad2 (1.237) and loses on
# wgrad1 (2.44 vs 2.10), so it is not the default there; wgrad1 at ~128 rows not measured with it (the probe
# ran out of memory), so wgrad1 keeps the default tiles everywhere.
WGRAD2_FEW_ROWS_PER_EXPERT = 160
WGRAD2_FEW_ROWS_TILES = (128, 128, 64, 4, 2, 2)


def wgrad2_tiles(h: torch.Tensor, counts: torch.Tensor):
    """The tiles of GEMM2's weight gradient for h's rows over counts' experts: WGRAD2_FEW_ROWS_TILES where the
    experts average <= WGRAD2_FEW_ROWS_PER_EXPERT rows (on the GPU), else None (expert_weight_grads' default)."""
    few = h.is_cuda and h.shape[0] <= WGRAD2_FEW_ROWS_PER_EXPERT * max(1, counts.shape[0])
    return WGRAD2_FEW_ROWS_TILES if few else None


def _check_wgrad_operands(a, b, counts, out_dtype, names=("a", "b"), extra=()) -> None:
    """expert_weight_grads' (and its padded twin's) argument checks: 2-D contiguous bf16 operands with one row
    each per (token, expert) pair, counts 1-D int32/int64, everything (and ``extra``) on one device, bf16 or
    fp32 out."""
    for name, t in zip(names, (a, b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be a 2-D torch.bfloat16 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{names[0]} has {a.shape[0]} rows but {names[1]} has {b.shape[0]}: one row per (token, "
                         f"expert) pair each")
    devices = [t.device for t in (a, b, counts, *extra)]
    if len(set(devices)) != 1:
        raise ValueError(f"{', '.join(names)} and counts must be on one device (got {', '.join(map(str, devices))})")
    if counts.dim() != 1 or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"counts must be a 1-D int32/int64 tensor, got {counts.dtype} {tuple(counts.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


def _persistent_programs(per_sm: int, t: torch.Tensor, n_tiles: int) -> int:
    """A persistent wgrad grid: per_sm programs per SM of t's GPU (the CPU interpreter: 3, a few programs with
    several tiles and experts each; compile-only: an H200's 132 SMs), at most one per tile."""
    if t.is_cuda:
        from .. import runtime
        programs = per_sm * runtime.num_sms(t.device)
    else:
        programs = 3 if planning.interpreting() else per_sm * 132
    return max(1, min(programs, n_tiles))


def expert_weight_grads(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16, kernel: str | None = None,
                        tiles=None) -> torch.Tensor:
    """dW [E, KA, KB] in ``out_dtype`` (bf16, the parameters' dtype, by default; or fp32) with dW[e] =
    a[rows of e]^T @ b[rows of e], accumulated in fp32 and rounded once (the bf16 result is the fp32 one rounded
    to nearest even, bitwise); a [R, KA], b [R, KB] bf16 on one device, the rows of expert e the next counts[e]
    after those of experts < e (sum(counts) <= R). Deterministic (the module docstring). CUDA, or the CPU under
    TRITON_INTERPRET=1. ``kernel``: "persistent" (_expert_wgrad_persistent_kernel) or "tiles" (one program per
    output tile, _expert_wgrad_kernel); None: WGRAD_KERNEL. Both give the same bits (the same per-tile sums);
    rows not 16-byte aligned take the masked-pointer kernel either way. ``tiles``: (BI, BJ, BR, warps, stages[,
    programs per SM of the persistent grid]) on the GPU instead of WGRAD_PERSISTENT_TILES / WGRAD_TILES (the
    probe's --wgrad-tiles)."""
    kernel = WGRAD_KERNEL if kernel is None else kernel
    if kernel not in WGRAD_KERNELS:
        raise ValueError(f"kernel must be one of {WGRAD_KERNELS}, got {kernel!r}")
    _check_wgrad_operands(a, b, counts, out_dtype)
    n_exp, ka, kb = counts.shape[0], a.shape[1], b.shape[1]
    out = torch.empty((n_exp, ka, kb), dtype=out_dtype, device=a.device)
    if n_exp == 0 or out.numel() == 0:
        return out
    counts32 = counts.to(torch.int32)
    offs = torch.cumsum(counts32, 0, dtype=torch.int32) - counts32  # exclusive: no host synchronisation
    persistent = kernel == "persistent"
    per_sm_given = []
    if planning.interpreting():
        bi, bj, br, warps, stages = 16, 16, 16, 4, 1
    else:
        bi, bj, br, warps, stages, *per_sm_given = tiles or (WGRAD_PERSISTENT_TILES if persistent else WGRAD_TILES)
    n_tiles = n_exp * triton.cdiv(ka, bi) * triton.cdiv(kb, bj)
    grid = (n_tiles,)
    aligned = ka % 8 == 0 and kb % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in (a, b, out))
    if aligned:
        from .. import runtime
        runtime.ensure_triton_allocator()
    if aligned and persistent:
        smem = stages * br * (bi + bj) * 2
        per_sm = WGRAD_PROGRAMS_PER_SM if (bi, bj) == (128, 128) and smem <= 96 * 1024 else 1
        if per_sm_given:  # a sixth entry of ``tiles``: the persistent grid's programs per SM
            per_sm = per_sm_given[0]
        programs = _persistent_programs(per_sm, a, n_tiles)
        _expert_wgrad_persistent_kernel[(programs,)](a, b, offs, counts32, out, ka, kb, n_exp, BI=bi, BJ=bj, BR=br,
                                                     GRID=programs, DOT_FP32=planning.interpreting(),
                                                     num_warps=warps, num_stages=stages)
        return out
    fn = _expert_wgrad_kernel if aligned else _expert_wgrad_ptr_kernel
    fn[grid](a, b, offs, counts32, out, ka, kb, BI=bi, BJ=bj, BR=br, DOT_FP32=planning.interpreting(),
             num_warps=warps, num_stages=stages)
    return out


# ---- the flat wgrad loop on a padded row layout (session 12; not timed; not wired into moe_backward) ----------
WGRAD_PAD_ROWS = 64  # the padded layout's granularity: each expert's rows start at a multiple of it (the GPU's BR)
# (BI, BJ, BR, warps, stages[, programs per SM]). Session 13 (one H200, dev/moe_bwd_tiles, results/h200x1/s13/a;
# every variant bitwise the persistent kernel's dW): qwen3 4k wgrad2 / wgrad1 128x256x64 s3 0.916 / 1.824 ms (1.07x
# / 1.02x torch._grouped_mm; kept), 128x128x64 w8 s2 1.003 / 2.072, w4 s2 0.994 / 2.080, w8 s3 1.153 / 2.336;
# deepseek-v3 4k wgrad2 128x256 s3 2.973, 128x128 w4 s2 2.964, w8 s2 3.007, w8 s3 3.826 (persistent: 3.743)
WGRAD_FLAT_TILES = (128, 256, 64, 8, 3)  # 208 KiB of shared with a bf16 output: one per SM
WGRAD_FLAT_TILES_FP32 = (128, 128, 64, 8, 2)  # fp32 output: 128x256 would need 272 KiB
WGRAD_FLAT_SMEM_LIMIT = 232448  # an H200 SM's shared memory per block (227 KiB)
WGRAD_FLAT_SMEM_PER_SM = 2 * 112 * 1024  # programs per SM by the shared estimate (an H200 SM: 228 KiB, 1 KiB each)


# No few-rows tile: at deepseek-v3 4k uniform (~128 rows per expert) 128x128x64 4 warps 2 stages won by a hair
# (s13 call b: wgrad1 5.98 vs 6.15 ms, wgrad2 2.964 vs 2.973) and lost by 3 ms at zipf:1.2 (the same mean, 0..4026
# rows per expert; call e: wgrad1 9.08 vs 6.79, wgrad2 4.65 vs 3.94): a rule from the mean rows (all the host knows
# without a sync) cannot tell the two apart. 128x256 s3 at 4k zipf: wgrad1 1.006x, wgrad2 0.909x of torch.


# The 256-wide side of the tile on the shorter of dW's two dimensions: session 13 call g, deepseek-v3 8k zipf:1.2,
# wgrad2 (KA = F = 2048 < KB = H = 7168) 256x128 s3 5.55 ms vs 128x256 6.00 (torch 5.00); wgrad1 (KA = H = 7168 >
# KB = 2F = 4096) 128x256 10.10 vs 256x128 10.51 (torch 9.87)
WGRAD_FLAT_TILES_TALL = (256, 128, 64, 8, 3)


def wgrad_flat_tiles(out_dtype: torch.dtype, ka: int, kb: int):
    """The flat wgrad's tiles for dW [E, ka, kb]: WGRAD_FLAT_TILES_FP32 for an fp32 output; else the 256-wide
    side on the shorter dimension, WGRAD_FLAT_TILES_TALL where ka < kb, WGRAD_FLAT_TILES otherwise."""
    if out_dtype == torch.float32:
        return WGRAD_FLAT_TILES_FP32
    return WGRAD_FLAT_TILES_TALL if ka < kb else WGRAD_FLAT_TILES


def padded_rows_bound(rows: int, n_experts: int, pad: int = WGRAD_PAD_ROWS) -> int:
    """A host-known bound on the padded layout's rows: sum over e of ceil(counts[e] / pad) * pad <= rows +
    n_experts * (pad - 1) for any counts summing to <= rows (no host synchronisation)."""
    return rows + n_experts * (pad - 1)


def padded_row_offsets(counts: torch.Tensor, pad: int = WGRAD_PAD_ROWS) -> torch.Tensor:
    """First padded row of each expert (int32, on counts' device, no host synchronisation): the exclusive cumsum
    of ceil(counts[e] / pad) * pad -- every expert's rows start at a multiple of ``pad``."""
    c = counts.to(torch.int32)
    padded = (c + pad - 1) // pad * pad
    return torch.cumsum(padded, 0, dtype=torch.int32) - padded


def pad_expert_rows(x: torch.Tensor, counts: torch.Tensor, pad_offs: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """x [R, K] with expert e's counts[e] rows consecutive (experts in order) -> [padded_rows, K] in the padded
    layout: expert e's rows at pad_offs[e] onwards, every other row zero (the gaps and the tail past the last
    expert). A gather per padded row (device-side, no host synchronisation, deterministic): reads the rows once,
    writes the padded array twice (index_select, then zeros over the gap rows). A stand-in for producers that
    write the padded layout directly (the dispatch, dgrad2's epilogue: the next step)."""
    e = counts.shape[0]
    if e == 0 or x.shape[0] == 0:
        return x.new_zeros(padded_rows, x.shape[1])
    c = counts.to(torch.int32)
    offs = torch.cumsum(c, 0, dtype=torch.int32) - c
    po = pad_offs.to(torch.int32).contiguous()
    q = torch.arange(padded_rows, device=x.device, dtype=torch.int32)
    eq = (torch.searchsorted(po, q, right=True) - 1).clamp(0, e - 1)  # the last expert starting at or before q
    within = q - po[eq]  # an expert without rows shares its successor's start and loses the tie
    valid = (within >= 0) & (within < c[eq])
    src = (within + offs[eq]).clamp(0, x.shape[0] - 1)
    out = x.index_select(0, src.long())
    return out.masked_fill_(~valid[:, None], 0)


def padded_layout(counts: torch.Tensor, rows: int, pad: int = WGRAD_PAD_ROWS):
    """The padded row layout of ``rows`` expert-sorted rows (counts [E] per expert, in order), on the device
    with no host synchronisation: (pad_offs [E] int32 = padded_row_offsets, row_of [rows] int64 -- sorted row
    i's padded row --, real_of [padded_rows_bound(rows, E)] int64 -- each padded row's sorted row, -1 for the
    gap rows and the tail), end [1] int32 -- the last expert's padded end: rows from it on are read by no one).
    moe_backward gathers its expert rows through real_of (gather_rows: -1 gives zeros; none past ``end``) and
    reads them back through row_of."""
    e = counts.shape[0]
    dev_ = counts.device
    c = counts.to(torch.int64)
    pad_offs = padded_row_offsets(counts, pad)
    expert_of = torch.repeat_interleave(torch.arange(e, device=dev_), c, output_size=rows)
    row_of = torch.arange(rows, device=dev_) + (pad_offs.to(torch.int64) - (torch.cumsum(c, 0) - c))[expert_of]
    real_of = torch.full((padded_rows_bound(rows, e, pad),), -1, dtype=torch.int64, device=dev_)
    real_of[row_of] = torch.arange(rows, device=dev_)
    end = (pad_offs[-1:] + (c[-1:].to(torch.int32) + pad - 1) // pad * pad) if e else pad_offs.new_zeros(1)
    return pad_offs, row_of, real_of, end


@triton.jit
def _expert_wgrad_flat_kernel(a_ptr, b_ptr, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, E, R_PAD,
                              BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, GRID: tl.constexpr,
                              ELP2: tl.constexpr, DOT_FP32: tl.constexpr):
    """_expert_wgrad_persistent_kernel's tiles (global tile g = e * n_tiles + t, program g % GRID's) as ONE
    software-pipelined loop over this program's row steps, all its tiles' in a row, so the TMA loads of the next
    tile are in flight during this tile's epilogue (the persistent kernel's pipeline drains at every tile).

    The operands are in the padded layout (padded_row_offsets): expert e's rows from pad_offs[e], the rows
    after its last up to the next multiple of BR zero in at least ONE operand (the other finite there: 0 * x
    = 0), so one descriptor per operand over the whole [R_PAD, K] array (built once) serves every expert and
    the last, partial step of a tile sums exactly what the clipped per-expert descriptors' zeros gave. A tile
    of an expert with counts[e] rows takes max(1, cdiv(counts[e], BR)) steps; an expert without rows takes
    one step at row R_PAD (past the array: TMA reads zeros) and stores zeros. Per tile: the same rows in the
    same ascending BR-row steps, fp32 accumulation rounded once -- bitwise the other kernels' result.

    Why not tl.range(flatten=True) over a tile loop with the row loop nested: Triton's FuseNestedLoops fuses
    an inner loop only if its bounds are invariant to the outer loop (its isOuterLoopInvariant; the bound here
    is counts[e], a load per tile), so it leaves such a nest alone (TTGIR, Triton 3.9); this is the nest
    flattened by hand (the pre-flatten persistent-matmul tutorial's form: the tile advance and its scalar loads
    in an ``if`` at the step counter's wrap, the epilogue in an ``if`` at the tile's last step), which the
    pipeliner pipelines (one scf.for, the descriptor loads num_stages - 1 steps ahead). The loop's trip count, this
    program's total steps, comes from counts in one vector reduction first."""
    _wgrad_flat_run(tl.program_id(0), a_ptr, b_ptr, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, E, R_PAD, BI, BJ, BR,
                    GRID, ELP2, DOT_FP32)


@triton.jit
def _wgrad_flat_run(pid, a_ptr, b_ptr, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, E, R_PAD,
                    BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, GRID, ELP2: tl.constexpr,
                    DOT_FP32: tl.constexpr, LOOP_STAGES: tl.constexpr = None, head_ptr=None,
                    DYNAMIC: tl.constexpr = 0, DYNAMIC_16THS: tl.constexpr = 1):
    """Program ``pid``'s whole share of _expert_wgrad_flat_kernel (its docstring): the standalone kernel's body and
    the one-launch backward's WGRAD stage. LOOP_STAGES: the flat loop's pipeline depth where it differs from the
    launch's num_stages (the one launch: its GEMM stages' depth). ``GRID``: the programs sharing the loops, ``pid``
    in [0, GRID) -- a constexpr from every caller but the one launch's fixed-role build (its compute programs:
    pid - S of GRID - S, runtime values); a constexpr argument specialises the function as before (the
    annotation only forbade a runtime one).

    DYNAMIC > 0 (the one launch, BWD_WGRAD_DYNAMIC): the tiles g < n_static (all but DYNAMIC_16THS / 16 of them,
    rounded down to whole GRID rounds) are statically owned as above; the rest are claimed in runs of DYNAMIC
    consecutive tiles from the atomic counter ``head_ptr`` (zero at the launch's start), each run one flat loop
    of its own, so a program the hardware runs slower (s20e: the same SM pairs 4-10% behind in both wgrads, not
    their tile shares) ends with fewer runs instead of holding every other program up. Per tile the same sum in
    the same order: the same bits whoever runs it."""
    n_j = tl.cdiv(KB, BJ)
    n_t = tl.cdiv(KA, BI) * n_j
    n_static = E * n_t
    if DYNAMIC > 0:
        n_static = (E * n_t * (16 - DYNAMIC_16THS) // 16) // GRID * GRID
    # this program's steps: over experts x, (its tiles of x below n_static) * max(1, cdiv(counts[x], BR))
    x = tl.arange(0, ELP2)
    cnt = tl.load(counts_ptr + x, mask=x < E, other=0)
    lo = x * n_t
    hi = tl.minimum(lo + n_t, n_static)
    first_g = lo + (pid - lo % GRID + GRID) % GRID  # this program's first global tile >= lo
    mine = tl.where((x < E) & (first_g < hi), (hi - first_g + GRID - 1) // GRID, 0)
    total = tl.sum(mine * tl.maximum(tl.cdiv(cnt, BR), 1), 0)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R_PAD, KA], strides=[KA, 1], block_shape=[BR, BI])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[R_PAD, KB], strides=[KB, 1], block_shape=[BR, BJ])
    if DYNAMIC > 0:  # one flat loop instance for the static share and every claimed run (one set of its buffers)
        n_tiles = E * n_t
        g_first = pid - GRID
        stride = pid * 0 + GRID
        seg = total
        more = total >= 0
        while more:
            _wgrad_flat_loop(g_first, stride, seg, a_desc, b_desc, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, R_PAD,
                             n_t, n_j, BI, BJ, BR, DOT_FP32, LOOP_STAGES)
            g0 = n_static + tl.atomic_add(head_ptr, 1, sem="relaxed", scope="gpu") * DYNAMIC
            seg = 0
            for g in range(g0, tl.minimum(g0 + DYNAMIC, n_tiles)):
                seg += tl.maximum(tl.cdiv(tl.load(counts_ptr + g // n_t), BR), 1)
            g_first = g0 - 1
            stride = 1
            more = g0 < n_tiles
    else:
        _wgrad_flat_loop(pid - GRID, GRID, total, a_desc, b_desc, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, R_PAD,
                         n_t, n_j, BI, BJ, BR, DOT_FP32, LOOP_STAGES)


@triton.jit
def _wgrad_flat_loop(g, stride, total, a_desc, b_desc, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, R_PAD, n_t, n_j,
                     BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, DOT_FP32: tl.constexpr,
                     LOOP_STAGES: tl.constexpr):
    """The flat loop over ``total`` row steps of the tiles g + stride, g + 2 * stride, ... (global tile g = e * n_t
    + ti * n_j + tj), in order: the tile advance at the step counter's wrap, the store at a tile's last step."""
    ki = -1
    steps = 0
    e = 0
    ti = 0
    tj = 0
    row0 = 0
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    for _ in tl.range(0, total, num_stages=LOOP_STAGES):
        ki = tl.where(ki == steps - 1, 0, ki + 1)
        if ki == 0:  # the next tile of this program
            g += stride
            e = g // n_t
            t = g % n_t
            ti = t // n_j
            tj = t % n_j
            rows = tl.load(counts_ptr + e)
            steps = tl.maximum(tl.cdiv(rows, BR), 1)
            row0 = tl.where(rows > 0, tl.load(pad_offs_ptr + e), R_PAD)
        acc = _wgrad_step(a_desc, b_desc, row0 + ki * BR, ti, tj, acc, BI, BJ, DOT_FP32)
        if ki == steps - 1:  # the tile's last step: store it, start the next from zero
            ci = ti * BI + tl.arange(0, BI)
            cj = tj * BJ + tl.arange(0, BJ)
            out = out_ptr + e.to(tl.int64) * KA * KB
            tl.store(out + ci[:, None] * KB + cj[None, :], _to_out(acc, out_ptr.dtype.element_ty, DOT_FP32),
                     mask=(ci < KA)[:, None] & (cj < KB)[None, :])
            acc = tl.zeros((BI, BJ), dtype=tl.float32)


def expert_weight_grads_padded(a_pad: torch.Tensor, b_pad: torch.Tensor, counts: torch.Tensor,
                               pad_offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *,
                               pad: int = WGRAD_PAD_ROWS, tiles=None) -> torch.Tensor:
    """expert_weight_grads on operands ALREADY in the padded row layout, through _expert_wgrad_flat_kernel:
    dW [E, KA, KB] with dW[e] = a_pad[pad_offs[e] : +counts[e]]^T @ b_pad[the same rows], bitwise
    expert_weight_grads' result on the unpadded rows (fp32 accumulation rounded once; bf16 or fp32 out).

    a_pad [R_pad, KA], b_pad [R_pad, KB] bf16, contiguous, KA and KB multiples of 8 (TMA only: no pointer
    fallback); pad_offs = padded_row_offsets(counts, pad) (each expert's first row a multiple of ``pad``) and
    R_pad >= the last expert's padded end (padded_rows_bound(R, E, pad) always is); pad_expert_rows builds the
    layout. Contract on the gap rows (after an expert's last row, up to the next multiple of ``pad``): zero in
    at least one of a_pad, b_pad, and finite in the other (the kernel sums 0 * x there) -- both zero is what
    pad_expert_rows gives. Rows of no expert are never read. ``tiles``: (BI, BJ, BR, warps, stages[, programs per
    SM]) on the GPU (WGRAD_FLAT_TILES); BR must divide ``pad``. CUDA, or the CPU under TRITON_INTERPRET=1."""
    _check_wgrad_operands(a_pad, b_pad, counts, out_dtype, names=("a_pad", "b_pad"), extra=(pad_offs,))
    if pad_offs.shape != counts.shape or pad_offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pad_offs must be an int32/int64 tensor shaped like counts, got {pad_offs.dtype} "
                         f"{tuple(pad_offs.shape)}")
    n_exp, ka, kb = counts.shape[0], a_pad.shape[1], b_pad.shape[1]
    if ka % 8 or kb % 8:
        raise ValueError(f"KA = {ka} and KB = {kb} must be multiples of 8 (TMA rows 16-byte aligned)")
    per_sm_given = []
    if planning.interpreting():
        bi, bj, br, warps, stages = 16, 16, 16, 4, 1
    else:
        bi, bj, br, warps, stages, *per_sm_given = tiles or (
            WGRAD_FLAT_TILES_FP32 if out_dtype == torch.float32 else WGRAD_FLAT_TILES)
    if pad % br:
        raise ValueError(f"the row step BR = {br} must divide the layout's pad = {pad}")
    out = torch.empty((n_exp, ka, kb), dtype=out_dtype, device=a_pad.device)
    if n_exp == 0 or out.numel() == 0:
        return out
    if any(t.data_ptr() % 16 for t in (a_pad, b_pad)):
        raise ValueError("a_pad and b_pad must be 16-byte aligned (TMA)")
    from .. import runtime
    runtime.ensure_triton_allocator()
    n_tiles = n_exp * triton.cdiv(ka, bi) * triton.cdiv(kb, bj)
    # shared: the pipeline's stages plus the epilogue's layout conversion (live together in the flat loop)
    smem = stages * br * (bi + bj) * 2 + bi * bj * out.element_size()
    if smem > WGRAD_FLAT_SMEM_LIMIT and not planning.interpreting():
        raise ValueError(f"wgrad tiles {bi}x{bj}x{br} with {stages} stages and a {out.dtype} output need "
                         f"{smem} B of shared memory, over the SM's {WGRAD_FLAT_SMEM_LIMIT} B")
    per_sm = per_sm_given[0] if per_sm_given else max(1, WGRAD_FLAT_SMEM_PER_SM // smem) if smem else 1
    per_sm = min(per_sm, 2)
    programs = _persistent_programs(per_sm, a_pad, n_tiles)
    _expert_wgrad_flat_kernel[(programs,)](a_pad, b_pad, pad_offs.to(torch.int32), counts.to(torch.int32), out,
                                           ka, kb, n_exp, a_pad.shape[0], BI=bi, BJ=bj, BR=br, GRID=programs,
                                           ELP2=triton.next_power_of_2(n_exp), DOT_FP32=planning.interpreting(),
                                           num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _mtile_rows(first_mtile_ptr, offs_ptr, counts_ptr, gm, ELP2: tl.constexpr, BM: tl.constexpr):
    """(expert e, its rows' int64 indices [BM], their mask) of global m-tile gm. e is the last expert whose
    first m-tile is <= gm (an exclusive cumsum padded with 2**30 to ELP2 entries; an expert without rows shares
    its successor's first tile and loses the tie); tiles past an expert's rows are masked off entirely."""
    mt = tl.load(first_mtile_ptr + tl.arange(0, ELP2))
    e = tl.sum((mt <= gm).to(tl.int32), 0) - 1
    r = (gm - tl.load(first_mtile_ptr + e)) * BM + tl.arange(0, BM)
    return e, (tl.load(offs_ptr + e) + r).to(tl.int64), r < tl.load(counts_ptr + e)


def _mtile_plan(counts: torch.Tensor, rows: int, bm: int, offs=None):
    """(counts int32, first row per expert, first m-tile per expert padded to a power of two, static m-tile
    bound) -- all on the device, no host synchronisation. ``offs``: each expert's first row (the padded layout's
    padded_row_offsets) instead of the rows packed in expert order."""
    e = counts.shape[0]
    counts32 = counts.to(torch.int32)
    if offs is None:
        offs = torch.cumsum(counts32, 0, dtype=torch.int32) - counts32
    elif offs.shape != counts.shape:
        raise ValueError(f"offs {tuple(offs.shape)} must be shaped like counts {tuple(counts.shape)}")
    else:
        offs = offs.to(torch.int32).contiguous()
    mtiles = (counts32 + bm - 1) // bm
    elp2 = triton.next_power_of_2(max(e, 1))
    first_mtile = torch.full((elp2,), 2**30, dtype=torch.int32, device=counts.device)
    first_mtile[:e] = torch.cumsum(mtiles, 0, dtype=torch.int32) - mtiles
    return counts32, offs, first_mtile, elp2, -(-rows // bm) + e


@triton.jit
def _torch_sigmoid(g, INTERP: tl.constexpr):
    """sigmoid(g) = 1 / (1 + exp(-g)) in fp32 as torch's CUDA kernel computes it: libdevice expf (CUDA's expf)
    and an IEEE division (the interpreter: numpy's exp). swiglu_h's and dgrad2's epilogue's."""
    if INTERP:
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)
    return tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + e)


@triton.jit
def _swiglu_backward_values(z, wp, g, u, INTERP: tl.constexpr):
    """(h, dg, du) in fp32 from z = dy_rows W2[e]^T, the rows' gate weights wp [BM] and g, u (fp32): h = silu(g) u
    (swiglu_h's arithmetic: _torch_sigmoid, (g * s) * u), dh = w z, dg = dh u silu'(g), du = dh silu(g). The
    fused epilogue's and the unfused pass's one formula."""
    s = _torch_sigmoid(g, INTERP)
    silu = g * s
    h = silu * u
    dh = z * wp[:, None]
    return h, dh * u * (s + silu * (1.0 - s)), dh * silu


@triton.jit
def _dgrad2_epilogue(z, wp, gu_t, dgu_t, h_t, dwp_t, col, rows_valid, F, n_parts, part,
                     BM: tl.constexpr, BH: tl.constexpr, EMIT_H: tl.constexpr, INTERP: tl.constexpr):
    """One BH-column slice of a dgrad2 tile: z [BM, BH] fp32 (= dy_rows W2[e]^T at F-columns col..col+BH),
    wp [BM] the rows' gate weights; gu_t / dgu_t / h_t / dwp_t the tile's first row of gu [., 2F], dgu [., 2F],
    h [., F], dwp [., n_parts] (int64 scalar offsets; int32 inside the tile: no per-element 64-bit index).
    Loads g | u, stores the gate partial ``part`` = sum over the slice of z * h, [dg | du] bf16 and (EMIT_H)
    h = silu(g) u bf16 -- bitwise swiglu_h's (the same arithmetic: _torch_sigmoid, (g * s) * u)."""
    i = tl.arange(0, BM)
    c = tl.arange(0, BH)
    rm = i < rows_valid
    mask = rm[:, None] & ((col + c) < F)[None, :]
    o2 = i[:, None] * (2 * F) + (col + c)[None, :]
    g = tl.load(gu_t + o2, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_t + F + o2, mask=mask, other=0.0).to(tl.float32)
    h, dg, du = _swiglu_backward_values(z, wp, g, u, INTERP)
    if EMIT_H:
        tl.store(h_t + (i[:, None] * F + (col + c)[None, :]), _to_out(h, tl.bfloat16, INTERP), mask=mask)
    tl.store(dwp_t + i * n_parts + part, tl.sum(z * h, 1), mask=rm)
    tl.store(dgu_t + o2, _to_out(dg, tl.bfloat16, INTERP), mask=mask)
    tl.store(dgu_t + F + o2, _to_out(du, tl.bfloat16, INTERP), mask=mask)


@triton.jit
def _dgrad2_swiglu_kernel(dyr_ptr, gu_ptr, w2_ptr, wp_ptr, offs_ptr, counts_ptr, dgu_ptr, dwp_ptr, h_ptr, H, F,
                          n_mtiles, ELP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          DOT_FP32: tl.constexpr, TMA: tl.constexpr = False, SPLIT: tl.constexpr = True,
                          EMIT_H: tl.constexpr = False):
    """One (expert, m-tile, F-tile) of item 2 of the module docstring. The m-tiles of all experts are numbered
    consecutively (an expert's first m-tile from the exclusive cumsum of ceil(counts / BM)). SPLIT: the
    epilogue in two BN/2-column halves, one after the other (the accumulator split in registers), so that
    g, u and the fp32 temporaries of half a tile are alive at a time (BN = 128 without spills); a gate
    partial per half (dwp [R, 2 * ceil(F / BN)]). EMIT_H: h = silu(g) u (bf16) stored too (for wgrad2)."""
    pid = tl.program_id(0)
    n_f = tl.cdiv(F, BN)
    gm = pid // n_f
    nf = pid % n_f
    e, rr, rm = _mtile_rows(n_mtiles, offs_ptr, counts_ptr, gm, ELP2, BM)
    if tl.sum(rm.to(tl.int32), 0) == 0:  # past the last expert's rows (the static grid bound): nothing to do
        return
    cf = nf * BN + tl.arange(0, BN)
    fm = cf < F
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    ck = tl.arange(0, BK)
    w2e = w2_ptr + e.to(tl.int64) * F * H
    first = tl.load(offs_ptr + e).to(tl.int64)
    lm0 = (gm - tl.load(n_mtiles + e)) * BM
    if TMA:  # per-expert descriptors: W2[e] [F, H] and A's rows clipped at the expert's end (zeros past them)
        a_desc = tl.make_tensor_descriptor(dyr_ptr + first * H, shape=[tl.load(counts_ptr + e), H],
                                           strides=[H, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(w2e, shape=[F, H], strides=[H, 1], block_shape=[BN, BK])
        for k0 in range(0, H, BK):
            a = a_desc.load([lm0, k0])
            b = b_desc.load([nf * BN, k0])
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
            else:
                acc = tl.dot(a, tl.trans(b), acc)
    else:
        for k0 in range(0, H, BK):
            km = (k0 + ck) < H
            a = tl.load(dyr_ptr + rr[:, None] * H + (k0 + ck)[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            # B[k, n] = W2[e][n, k]: rows of W2[e] (F of them, H long), read transposed
            b = tl.load(w2e + cf[None, :].to(tl.int64) * H + (k0 + ck)[:, None], mask=km[:, None] & fm[None, :],
                        other=0.0)
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
            else:
                acc = tl.dot(a, b, acc)
    row0 = first + lm0  # the tile's first row (int64)
    rows_valid = tl.load(counts_ptr + e) - lm0
    wp = tl.load(wp_ptr + rr, mask=rm, other=0.0)
    gu_t = gu_ptr + row0 * (2 * F)
    dgu_t = dgu_ptr + row0 * (2 * F)
    h_t = h_ptr + row0 * F
    if SPLIT:
        n_parts = 2 * n_f
        dwp_t = dwp_ptr + row0 * n_parts
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        _dgrad2_epilogue(lo, wp, gu_t, dgu_t, h_t, dwp_t, nf * BN, rows_valid, F, n_parts, 2 * nf, BM, BN // 2,
                         EMIT_H, DOT_FP32)
        _dgrad2_epilogue(hi, wp, gu_t, dgu_t, h_t, dwp_t, nf * BN + BN // 2, rows_valid, F, n_parts, 2 * nf + 1,
                         BM, BN // 2, EMIT_H, DOT_FP32)
    else:
        dwp_t = dwp_ptr + row0 * n_f
        _dgrad2_epilogue(acc, wp, gu_t, dgu_t, h_t, dwp_t, nf * BN, rows_valid, F, n_f, nf, BM, BN, EMIT_H,
                         DOT_FP32)


@triton.jit
def _swiglu_backward_kernel(z_ptr, gu_ptr, wp_ptr, dgu_ptr, h_ptr, dw_ptr, valid_ptr, R, F, BR: tl.constexpr,
                            BF: tl.constexpr, EMIT_H: tl.constexpr, INTERP: tl.constexpr, HAS_VALID: tl.constexpr):
    """The dgrad2 epilogue's arithmetic as a pass of its own over BR rows (the unfused dgrad2): z [R, F] bf16
    (= dy_rows W2[e]^T from the GEMM), g | u, w -> [dg | du] bf16, h bf16 (EMIT_H) and the gate gradient dw[r]
    = sum over F of z * h, summed in BF-column steps left to right in fp32 (deterministic). HAS_VALID: z's rows
    with valid[r] == 0 (the padded layout's gap rows, which the GEMM does not write) read as zeros."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    _swiglu_backward_rows(i, i < R, z_ptr, gu_ptr, wp_ptr, dgu_ptr, h_ptr, dw_ptr, valid_ptr, F, BF, EMIT_H, INTERP,
                          HAS_VALID)


@triton.jit
def _swiglu_backward_rows(i, rm, z_ptr, gu_ptr, wp_ptr, dgu_ptr, h_ptr, dw_ptr, valid_ptr, F, BF: tl.constexpr,
                          EMIT_H: tl.constexpr, INTERP: tl.constexpr, HAS_VALID: tl.constexpr):
    """_swiglu_backward_kernel's rows i (int32 [BR], those with rm): the standalone pass's program and a block of
    the one-launch backward's SWIGLU task. Every row's arithmetic depends on that row alone (and BF)."""
    zm = rm
    if HAS_VALID:
        zm = rm & (tl.load(valid_ptr + i, mask=rm, other=0) != 0)
    i64 = i.to(tl.int64)
    wp = tl.load(wp_ptr + i, mask=rm, other=0.0)
    dw = tl.zeros(i.shape, dtype=tl.float32)
    c0 = tl.arange(0, BF)
    for col in range(0, F, BF):
        dw += _swiglu_backward_cols(i64, rm, zm, wp, col + c0, z_ptr, gu_ptr, dgu_ptr, h_ptr, F, EMIT_H, INTERP)
    tl.store(dw_ptr + i, dw, mask=rm)


@triton.jit
def _swiglu_backward_cols(i64, rm, zm, wp, c, z_ptr, gu_ptr, dgu_ptr, h_ptr, F, EMIT_H: tl.constexpr,
                          INTERP: tl.constexpr):
    """One column step of the SwiGLU backward pass: rows i64 (those with rm; z read as zeros where not zm),
    columns c -> h (EMIT_H), [dg | du] stored; returns the step's gate-gradient partial sum(z * h) per row."""
    mask = rm[:, None] & (c < F)[None, :]
    o2 = i64[:, None] * (2 * F) + c[None, :]
    z = tl.load(z_ptr + i64[:, None] * F + c[None, :], mask=zm[:, None] & (c < F)[None, :], other=0.0).to(tl.float32)
    g = tl.load(gu_ptr + o2, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + F + o2, mask=mask, other=0.0).to(tl.float32)
    h, dg, du = _swiglu_backward_values(z, wp, g, u, INTERP)
    if EMIT_H:
        tl.store(h_ptr + i64[:, None] * F + c[None, :], _to_out(h, tl.bfloat16, INTERP), mask=mask)
    part = tl.sum(z * h, 1)
    tl.store(dgu_ptr + o2, _to_out(dg, tl.bfloat16, INTERP), mask=mask)
    tl.store(dgu_ptr + F + o2, _to_out(du, tl.bfloat16, INTERP), mask=mask)
    return part


# GPU (BM, BN, BK, warps, stages); the epilogue in two BN/2-column halves. Session 11 (one H200, qwen3-235b 4k
# rows, dev/moe_bwd_tiles, call c; all variants bitwise the default's): 128x128x64 w8 s3 1.391 ms (296 TF/s,
# 0.59x torch._grouped_mm's GEMM alone), s4 1.241 (332 TF/s, 0.66x; kept), 128x256x64 s3 1.278, 64x128x64 w4
# s4 1.361, 128x64x64 s3 1.697, 64x256x64 s3 1.316
DGRAD2_TILES = (128, 128, 64, 8, 4)
DGRAD2_SPLIT = True  # False: the epilogue on the whole BN-wide tile at once (at 128 x 128: spills, see docstring)
# False: z = dy_rows W2[e]^T by the dgrad1 GEMM kernel (bf16), then _swiglu_backward_kernel. Session 12 (qwen3 4k,
# dev/moe_bwd_tiles, results/h200x1/s12/b): fused 1.244 ms (0.67x torch's GEMM alone), the GEMM alone 0.797
# (1.04x), unfused 0.947 (0.88x; the pass 0.15 ms); the whole backward 7.57 -> 7.38 ms
DGRAD2_FUSED = False


def expert_dgrad2_swiglu(dy_rows: torch.Tensor, gu: torch.Tensor, w2: torch.Tensor, w_pair: torch.Tensor,
                         counts: torch.Tensor, *, emit_h: bool = False, tiles=None, fused: bool | None = None,
                         offs=None, valid=None):
    """Item 2 of the module docstring for expert-sorted rows: dy_rows [R, H] bf16 (each row's token gradient),
    gu [R, 2F] bf16 (the forward's g | u), w2 [E, F, H] bf16, w_pair [R] fp32 (each row's gate weight), counts
    [E] (rows per expert, consecutive). Returns (dgu [R, 2F] bf16 = [dg | du], dw_rows [R] fp32 = <dy_t, o_p>,
    the gate partials summed in order) and, with ``emit_h``, h = silu(g) u [R, F] bf16 from the same epilogue
    (bitwise swiglu_h(gu, F): the same arithmetic) as a third. Rows past sum(counts) are left unspecified
    (moe_backward has none). ``tiles``: (BM, BN, BK, warps, stages) instead of DGRAD2_TILES (GPU). ``fused``
    (None: DGRAD2_FUSED): False computes z = dy_rows W2[e]^T with the dgrad1 GEMM kernel (``tiles`` its tile,
    default DGRAD1_TILES), rounded to bf16 as autograd's GEMM output is, then the epilogue's arithmetic in a pass
    of its own (_swiglu_backward_kernel): the same outputs up to that rounding of z. ``offs`` (unfused only):
    each expert's first row in the padded layout (padded_row_offsets; the gap rows of gu zero, of w_pair finite)
    with ``valid`` [R] (bool: the rows of some expert, padded_layout's real_of >= 0), whose other rows then come
    out zero in dgu, h and dw_rows: the SwiGLU pass reads z there as zeros (the GEMM leaves them unwritten)."""
    r_all, h = dy_rows.shape
    e, f, h2 = w2.shape
    if h2 != h or gu.shape != (r_all, 2 * f) or w_pair.shape != (r_all,) or counts.shape != (e,):
        raise ValueError(f"shapes disagree: dy_rows {tuple(dy_rows.shape)}, gu {tuple(gu.shape)}, w2 "
                         f"{tuple(w2.shape)}, w_pair {tuple(w_pair.shape)}, counts {tuple(counts.shape)}")
    if (offs is None) != (valid is None) or (valid is not None and valid.shape != (r_all,)):
        raise ValueError(f"offs and valid come together (the padded layout), valid shaped [{r_all}]")
    if not (DGRAD2_FUSED if fused is None else fused):
        z = expert_dgrad1(dy_rows, w2, counts, tiles=tiles, offs=offs)
        dgu = torch.empty((r_all, 2 * f), dtype=torch.bfloat16, device=dy_rows.device)
        dw_rows = torch.empty((r_all,), dtype=torch.float32, device=dy_rows.device)
        hb = torch.empty((r_all, f) if emit_h else (1,), dtype=torch.bfloat16, device=dy_rows.device)
        if r_all and f:
            br, bf = (4, 16) if planning.interpreting() else (8, min(256, triton.next_power_of_2(f)))
            has_valid = valid is not None
            _swiglu_backward_kernel[(triton.cdiv(r_all, br),)](z, gu.contiguous(), w_pair.float().contiguous(), dgu,
                                                               hb, dw_rows,
                                                               valid.contiguous().view(torch.uint8) if has_valid
                                                               else dw_rows, r_all, f, BR=br, BF=bf, EMIT_H=emit_h,
                                                               INTERP=planning.interpreting(), HAS_VALID=has_valid,
                                                               num_warps=8)
        return (dgu, dw_rows, hb) if emit_h else (dgu, dw_rows)
    if offs is not None:
        raise ValueError("expert_dgrad2_swiglu: the padded layout (offs=) runs unfused only")
    if planning.interpreting():
        bm, bn, bk, warps, stages = 16, 16, 16, 4, 1
    else:  # 128 x 64 (session 10, 244 regs) measured 2.19 ms, 0.38x torch's GEMM alone; 128 x 128 split: unmeasured
        bm, bn, bk, warps, stages = tiles or DGRAD2_TILES
    split = DGRAD2_SPLIT and bn >= 16
    counts32, offs, first_pad, elp2, n_m = _mtile_plan(counts, r_all, bm)  # n_m: a static m-tile bound
    n_f = -(-f // bn)
    dgu = torch.empty((r_all, 2 * f), dtype=torch.bfloat16, device=dy_rows.device)
    dwp = torch.empty((r_all, 2 * n_f if split else n_f), dtype=torch.float32, device=dy_rows.device)
    hb = torch.empty((r_all, f) if emit_h else (1,), dtype=torch.bfloat16, device=dy_rows.device)
    tma = h % 8 == 0 and dy_rows.is_contiguous() and w2.is_contiguous() and \
        all(t.data_ptr() % 16 == 0 for t in (dy_rows, w2))
    if tma:
        from .. import runtime
        runtime.ensure_triton_allocator()
    _dgrad2_swiglu_kernel[(n_m * n_f,)](dy_rows, gu.contiguous(), w2, w_pair.float().contiguous(), offs, counts32,
                                          dgu, dwp, hb, h, f, first_pad, ELP2=elp2, BM=bm, BN=bn, BK=bk,
                                          DOT_FP32=planning.interpreting(), TMA=tma, SPLIT=split, EMIT_H=emit_h,
                                          num_warps=warps, num_stages=stages)
    if emit_h:
        return dgu, sum_partials(dwp), hb
    return dgu, sum_partials(dwp)


@triton.jit
def _dgrad1_kernel(dgu_ptr, w13_ptr, offs_ptr, counts_ptr, first_mtile_ptr, dx_ptr, H, K,
                   ELP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
                   TMA: tl.constexpr = False):
    """One (expert, m-tile, H-tile) of item 3: dx_rows = [dg | du] @ W13[e]^T, K = 2F (W13 [E, H, K]); any
    rows [R, K] @ W[e]^T with W [E, H, K] likewise (GEMM2's data gradient unfused: dy_rows W2[e]^T, K = H)."""
    pid = tl.program_id(0)
    n_h = tl.cdiv(H, BN)
    _dgrad1_tile(pid // n_h, pid % n_h, dgu_ptr, w13_ptr, offs_ptr, counts_ptr, first_mtile_ptr, dx_ptr, H, K, ELP2,
                 BM, BN, BK, DOT_FP32, TMA)


@triton.jit
def _dgrad1_tile(gm, nh, dgu_ptr, w13_ptr, offs_ptr, counts_ptr, first_mtile_ptr, dx_ptr, H, K,
                 ELP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
                 TMA: tl.constexpr, LOOP_STAGES: tl.constexpr = None, B_KN: tl.constexpr = False):
    """Global m-tile gm, H-tile nh of _dgrad1_kernel (the standalone kernel's program and the one-launch
    backward's DGRAD2 / DGRAD1 task): rows [R, K] @ W[e]^T into dx (bf16), rows of no expert not stored; an
    m-tile past the last expert's rows stores nothing. LOOP_STAGES: as _wgrad_flat_run's. B_KN: W [E, K, H] read
    as it is, rows @ W[e] (the one launch's GU task at W > 1: [g | u] = x_rows W13[e], H = 2F, K = the hidden
    size), stored rounded to nearest even on the interpreter too (_to_out: torch's recompute's rounding)."""
    e, rr, rm = _mtile_rows(first_mtile_ptr, offs_ptr, counts_ptr, gm, ELP2, BM)
    if tl.sum(rm.to(tl.int32), 0) > 0:  # else past the last expert's rows: nothing to do
        ch = nh * BN + tl.arange(0, BN)
        hm = ch < H
        ck = tl.arange(0, BK)
        w13e = w13_ptr + e.to(tl.int64) * H * K
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if TMA:  # the W13 tile within W13[e] (shape [H, 2F]); A's rows clipped at the expert's end
            first = tl.load(offs_ptr + e).to(tl.int64)
            lm0 = (gm - tl.load(first_mtile_ptr + e)) * BM
            a_desc = tl.make_tensor_descriptor(dgu_ptr + first * K, shape=[tl.load(counts_ptr + e), K],
                                               strides=[K, 1], block_shape=[BM, BK])
            if B_KN:
                bk_desc = tl.make_tensor_descriptor(w13e, shape=[K, H], strides=[H, 1], block_shape=[BK, BN])
                for k0 in tl.range(0, K, BK, num_stages=LOOP_STAGES):
                    a = a_desc.load([lm0, k0])
                    b = bk_desc.load([k0, nh * BN])
                    if DOT_FP32:
                        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
                    else:
                        acc = tl.dot(a, b, acc)
            else:
                b_desc = tl.make_tensor_descriptor(w13e, shape=[H, K], strides=[K, 1], block_shape=[BN, BK])
                for k0 in tl.range(0, K, BK, num_stages=LOOP_STAGES):
                    a = a_desc.load([lm0, k0])
                    b = b_desc.load([nh * BN, k0])
                    if DOT_FP32:
                        acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
                    else:
                        acc = tl.dot(a, tl.trans(b), acc)
        else:
            for k0 in tl.range(0, K, BK, num_stages=LOOP_STAGES):
                km = (k0 + ck) < K
                a = tl.load(dgu_ptr + rr[:, None] * K + (k0 + ck)[None, :], mask=rm[:, None] & km[None, :],
                            other=0.0)
                if B_KN:
                    b = tl.load(w13e + (k0 + ck)[:, None].to(tl.int64) * H + ch[None, :],
                                mask=km[:, None] & hm[None, :], other=0.0)
                else:
                    b = tl.load(w13e + ch[None, :].to(tl.int64) * K + (k0 + ck)[:, None],
                                mask=km[:, None] & hm[None, :], other=0.0)
                if DOT_FP32:
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
                else:
                    acc = tl.dot(a, b, acc)
        if B_KN:
            tl.store(dx_ptr + rr[:, None] * H + ch[None, :], _to_out(acc, tl.bfloat16, DOT_FP32),
                     mask=rm[:, None] & hm[None, :])
        else:
            tl.store(dx_ptr + rr[:, None] * H + ch[None, :], acc.to(tl.bfloat16), mask=rm[:, None] & hm[None, :])


# GPU (BM, BN, BK, warps, stages). Session 11, one H200, qwen3-235b 4k rows (dev/moe_bwd_tiles, results/h200x1/s11):
# call b: 128x128x64 w8 s3 2.017 ms (409 TF/s, 0.80x torch._grouped_mm), s4 2.167, 128x256x64 w8 s3 1.641 (502
# TF/s, 0.99x), 256x128x64 2.430, 128x128x128 s2 2.964, 64x256x64 2.266; call c: 128x256x64 w8 s3 1.650, s4
# 1.573 (524 TF/s, 1.03x; kept), w4 s3 9.449 (spills), 256x256x64 s2 10.356 -- the wider H tile halves the
# re-reads of each [dg | du] row block (K = 2F = 3072)
DGRAD1_TILES = (128, 256, 64, 8, 4)


def expert_dgrad1(dgu: torch.Tensor, w13: torch.Tensor, counts: torch.Tensor, *, tiles=None,
                  offs=None) -> torch.Tensor:
    """Item 3 of the module docstring: dgu [R, 2F] bf16, w13 [E, H, 2F] bf16, counts [E] -> dx_rows [R, H] bf16
    (rows of no expert: unspecified). ``tiles``: (BM, BN, BK, warps, stages)
    instead of DGRAD1_TILES (GPU). ``offs``: each expert's first row (the padded layout's padded_row_offsets)
    instead of the rows packed in expert order."""
    r_all = dgu.shape[0]
    e, h, f2 = w13.shape
    if dgu.shape[1] != f2 or counts.shape != (e,):
        raise ValueError(f"shapes disagree: dgu {tuple(dgu.shape)}, w13 {tuple(w13.shape)}, "
                         f"counts {tuple(counts.shape)}")
    if planning.interpreting():
        bm, bn, bk, warps, stages = 16, 16, 16, 4, 1
    else:  # session 10: 2.04 ms at qwen3-235b 4k (404 TF/s, 0.82x torch._grouped_mm)
        bm, bn, bk, warps, stages = tiles or DGRAD1_TILES
    counts32, offs, first_mtile, elp2, n_m = _mtile_plan(counts, r_all, bm, offs)
    dx = torch.empty((r_all, h), dtype=torch.bfloat16, device=dgu.device)
    tma = f2 % 8 == 0 and dgu.is_contiguous() and w13.is_contiguous() and \
        all(t.data_ptr() % 16 == 0 for t in (dgu, w13))
    if tma:
        from .. import runtime
        runtime.ensure_triton_allocator()
    _dgrad1_kernel[(n_m * -(-h // bn),)](dgu, w13, offs, counts32, first_mtile, dx, h, f2, ELP2=elp2, BM=bm,
                                         BN=bn, BK=bk, DOT_FP32=planning.interpreting(), TMA=tma, num_warps=warps,
                                         num_stages=stages)
    return dx


COMPILE_ONLY = False  # dev/kernel_resources.py: CPU tensors stand in for CUDA ones (sm_90a compiles, nothing runs)


def _triton_runs(t: torch.Tensor) -> bool:
    """Whether the small gather kernels run for tensors like t (else their torch twins): CUDA or the interpreter."""
    return t.is_cuda or planning.interpreting() or COMPILE_ONLY


@triton.jit
def _sum_partials_kernel(p_ptr, out_ptr, R, NP, BLOCK: tl.constexpr):
    """out[r] = ((p[r, 0] + p[r, 1]) + p[r, 2]) + ... in fp32, left to right: the order of the per-partial
    torch adds it replaces (bitwise the same)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < R
    rp = p_ptr + r.to(tl.int64) * NP
    acc = tl.load(rp, mask=m, other=0.0)
    for i in range(1, NP):
        acc += tl.load(rp + i, mask=m, other=0.0)
    tl.store(out_ptr + r, acc, mask=m)


def sum_partials(p: torch.Tensor) -> torch.Tensor:
    """[R, N] fp32 -> [R]: each row's N partials summed left to right in fp32 (one launch)."""
    out = torch.empty(p.shape[0], dtype=torch.float32, device=p.device)
    if p.shape[0]:
        block = 1024
        _sum_partials_kernel[(triton.cdiv(p.shape[0], block),)](p, out, p.shape[0], p.shape[1], BLOCK=block,
                                                                 num_warps=4)
    return out


@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, w_ptr, out_ptr, scaled_ptr, limit_ptr, H, BH: tl.constexpr,
                        PLAIN: tl.constexpr, SCALED: tl.constexpr, RNE_BITS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """From one read of src[idx[i]]: out[i] = src[idx[i]] (PLAIN) and scaled[i] = bf16(w[i] * fp32(src[idx[i]]))
    (SCALED: one fp32 product rounded to nearest even); a row with idx[i] < 0 is zeros (the padded row layout's
    gap rows). HAS_LIMIT: rows i >= limit[0] (past the padded layout's last expert: read by no one) are not
    written at all."""
    i = tl.program_id(0)
    if HAS_LIMIT:
        if i >= tl.load(limit_ptr):
            return
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    row = tl.load(idx_ptr + i).to(tl.int64)
    m = c < H
    v = tl.load(src_ptr + tl.maximum(row, 0) * H + c, mask=c < tl.where(row >= 0, H, 0), other=0.0)
    if PLAIN:
        tl.store(out_ptr + i.to(tl.int64) * H + c, v, mask=m)
    if SCALED:
        tl.store(scaled_ptr + i.to(tl.int64) * H + c,
                 _to_out(v.to(tl.float32) * tl.load(w_ptr + i), tl.bfloat16, RNE_BITS), mask=m)


def _launch_gather_rows(src: torch.Tensor, idx: torch.Tensor, w, plain: bool, limit=None):
    """(src[idx] or None, bf16(w * src[idx]) or None) by _gather_rows_kernel (``w`` None: no scaled rows;
    ``limit``: a 1-element int tensor, rows from it on left unwritten)."""
    r, h = idx.shape[0], src.shape[1]
    if src.shape[0] == 0:  # no rows to read: every index is -1, every row zero (and no launch on an empty src)
        return (src.new_zeros((r, h)) if plain else None,
                torch.zeros((r, h), dtype=torch.bfloat16, device=src.device) if w is not None else None)
    out = torch.empty((r, h), dtype=src.dtype, device=src.device) if plain else None
    scaled = torch.empty((r, h), dtype=torch.bfloat16, device=src.device) if w is not None else None
    if r and h:
        bh = min(1024, triton.next_power_of_2(h))
        _gather_rows_kernel[(r, triton.cdiv(h, bh))](src.contiguous(), idx.contiguous(),
                                                     src if w is None else w.float().contiguous(),
                                                     src if out is None else out, src if scaled is None else scaled,
                                                     idx if limit is None else limit, h, BH=bh, PLAIN=plain,
                                                     SCALED=w is not None, RNE_BITS=planning.interpreting(),
                                                     HAS_LIMIT=limit is not None, num_warps=4)
    return out, scaled


def scaled_rows(src: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(w[:, None] * src[idx].float()).to(bf16) -- bitwise -- in one pass: src [T, H] bf16, idx [R] int, w [R]
    fp32 -> [R, H] bf16 (no gathered copy, no fp32 temporary); rows with idx < 0 are zeros."""
    return _launch_gather_rows(src, idx, w, plain=False)[1]


def gather_rows_and_scaled(src: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, limit=None):
    """(gather_rows(src, idx), scaled_rows(src, idx, w)) from one read of the rows (bitwise the two calls'):
    moe_backward's dy_rows for GEMM2's data gradient and do = w * dy_rows for its weight gradient. ``limit``:
    as gather_rows'."""
    return _launch_gather_rows(src, idx, w, plain=True, limit=limit)


def gather_rows(src: torch.Tensor, idx: torch.Tensor, limit=None) -> torch.Tensor:
    """src[idx] with zero rows where idx < 0 (the padded layout's gap rows), in one pass: src [T, H], idx [R]
    int -> [R, H] in src's dtype; torch where Triton cannot run. ``limit`` (a 1-element int tensor on the
    device, e.g. padded_layout's end): rows from limit[0] on are left unwritten (unspecified)."""
    if not _triton_runs(src):
        out = src[idx.clamp(min=0).long()]
        return out.masked_fill_((idx < 0)[:, None], 0)
    return _launch_gather_rows(src, idx, None, plain=True, limit=limit)[0]


@triton.jit
def _swiglu_h_kernel(gu_ptr, h_ptr, F, BF: tl.constexpr, INTERP: tl.constexpr):
    """h[r] = bf16((g * sigmoid(g)) * u), g | u = gu[r] in fp32, sigmoid(g) = 1 / (1 + exp(-g)) as torch's CUDA
    kernel computes it: libdevice expf (CUDA's expf) and an IEEE division (the interpreter: numpy's exp)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BF + tl.arange(0, BF)
    m = c < F
    g = tl.load(gu_ptr + r * (2 * F) + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * (2 * F) + F + c, mask=m, other=0.0).to(tl.float32)
    s = _torch_sigmoid(g, INTERP)
    tl.store(h_ptr + r * F + c, _to_out((g * s) * u, tl.bfloat16, INTERP), mask=m)


def swiglu_h(gu: torch.Tensor, f: int) -> torch.Tensor:
    """h = silu(g) * u -> bf16 from gu = [g | u] [R, 2F] bf16 in one pass (no fp32 copies of g, u): meant to be
    bitwise ``(g * torch.sigmoid(g) * u).to(bf16)`` of the fp32 g, u (torch's CUDA sigmoid is 1 / (1 + expf(-x))
    with an IEEE division; checked by tests/test_moe_backward.py's GPU test); torch where Triton cannot run, or
    with ``SWIGLU_H_TORCH = True``."""
    if SWIGLU_H_TORCH or not _triton_runs(gu):
        g, u = gu[:, :f].float(), gu[:, f:].float()
        return (g * torch.sigmoid(g) * u).to(torch.bfloat16).contiguous()
    r = gu.shape[0]
    h = torch.empty((r, f), dtype=torch.bfloat16, device=gu.device)
    if r and f:
        bf = min(1024, triton.next_power_of_2(f))
        _swiglu_h_kernel[(r, triton.cdiv(f, bf))](gu.contiguous(), h, f, BF=bf, INTERP=planning.interpreting(),
                                                  num_warps=4)
    return h


SWIGLU_H_TORCH = False  # True: h through the torch line (the fallback if the GPU test finds a bit differing)
DGRAD2_EMITS_H = True  # h from dgrad2's epilogue (no swiglu_h pass); False: swiglu_h's pass (the fallback if
#                        tests/test_moe_backward.py::test_dgrad2_emitted_h_bitwise_gpu finds a bit differing)


def dgrad2_emits_h() -> bool:
    """Whether moe_backward (and the probe's stages) take h from dgrad2's epilogue: DGRAD2_EMITS_H, unless h
    goes through the torch line (SWIGLU_H_TORCH)."""
    return DGRAD2_EMITS_H and not SWIGLU_H_TORCH


@triton.jit
def _unpermute_sum_kernel(rows_ptr, inv_ptr, out_ptr, H, K: tl.constexpr, BH: tl.constexpr):
    """out[t] = ((rows[inv[t*K]] + rows[inv[t*K+1]]) + ...) in fp32, slot order."""
    t = tl.program_id(0)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    _unpermute_sum_cols(t, c, c < H, rows_ptr, inv_ptr, out_ptr, H, K)


@triton.jit
def _unpermute_sum_cols(t, c, m, rows_ptr, inv_ptr, out_ptr, H, K: tl.constexpr, UNROLL: tl.constexpr = False):
    """Token t's columns c (those with m) of _unpermute_sum_kernel: its program (t a scalar), and a block of the
    one-launch backward's UNPERMUTE task (t [UT, 1] valid token indices, c [1, BH], m [UT, BH]). Element-wise
    fp32 adds in slot order: the bits depend on neither the blocking nor UNROLL (the slot loop unrolled, so the
    K loads of a block are in flight together -- one persistent program per SM has no other memory-level
    parallelism; the adds stay in slot order)."""
    acc = tl.load(rows_ptr + tl.load(inv_ptr + t * K).to(tl.int64) * H + c, mask=m, other=0.0).to(tl.float32)
    if UNROLL:
        for j in tl.static_range(1, K):
            row = tl.load(inv_ptr + t * K + j).to(tl.int64)
            acc += tl.load(rows_ptr + row * H + c, mask=m, other=0.0).to(tl.float32)
    else:
        for j in range(1, K):
            row = tl.load(inv_ptr + t * K + j).to(tl.int64)
            acc += tl.load(rows_ptr + row * H + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.cast(t, tl.int64) * H + c, acc, mask=m)


def unpermute_sum(rows: torch.Tensor, order: torch.Tensor, top_k: int, row_of=None) -> torch.Tensor:
    """The dispatch backward from expert-sorted rows: rows [P, H] (row i is pair order[i], p = t*k + j) ->
    dx_e [T, H] fp32, dx_e[t] = sum_j rows of (t, j) in slot order j = 0..k-1 -- bitwise
    moe_reference.dispatch_backward_ref of the rows put back in pair order, without the [P, H] pair-order and
    fp32 copies (one gather-sum launch; the torch path where Triton cannot run). ``row_of`` [P]: rows in a
    padded layout, sorted pair i at rows[row_of[i]] (rows then has more rows than pairs)."""
    from .. import moe_reference as mr
    p, h = order.shape[0], rows.shape[1]
    if not _triton_runs(rows):
        pair = torch.empty((p, h), dtype=rows.dtype, device=rows.device)
        pair[order] = rows if row_of is None else rows[row_of]
        return mr.dispatch_backward_ref(pair.float(), top_k)
    inv = _pair_rows(order, row_of)
    out = torch.empty((p // top_k, h), dtype=torch.float32, device=rows.device)
    if p and h:
        bh = min(1024, triton.next_power_of_2(h))
        _unpermute_sum_kernel[(p // top_k, triton.cdiv(h, bh))](rows.contiguous(), inv, out, h, K=top_k, BH=bh,
                                                                num_warps=4)
    return out


def expert_weight_grads_ref(a: torch.Tensor, b: torch.Tensor, counts) -> torch.Tensor:
    """The same in fp64 (then fp32), one expert at a time (any device)."""
    out, start = [], 0
    for n in [int(c) for c in counts.tolist()]:
        out.append(a[start:start + n].double().t() @ b[start:start + n].double())
        start += n
    return torch.stack(out).float() if out else torch.empty((0, a.shape[1], b.shape[1]))


# ----------------------------------------------------------------------------------- the whole backward at W=1
def _expert_gemm1(x_rows: torch.Tensor, w13: torch.Tensor, counts: torch.Tensor, pad_offs=None) -> torch.Tensor:
    """[g | u] = x_rows @ W13[e] per expert (the forward's GEMM1, recomputed): torch._grouped_mm on CUDA (bf16
    out, fp32 accumulation), one expert at a time elsewhere. ``pad_offs``: x_rows in the padded layout
    (padded_row_offsets): each expert's group runs to its padded end, so its zero gap rows give zero rows."""
    c32 = counts.to(torch.int32)
    if pad_offs is None:
        starts, lens = torch.cumsum(c32, 0, dtype=torch.int32) - c32, c32
    else:
        starts, lens = pad_offs.to(torch.int32), (c32 + WGRAD_PAD_ROWS - 1) // WGRAD_PAD_ROWS * WGRAD_PAD_ROWS
    if x_rows.is_cuda and hasattr(torch, "_grouped_mm") and x_rows.shape[0] > 0:
        return torch._grouped_mm(x_rows, w13, offs=starts + lens)
    out = torch.zeros((x_rows.shape[0], w13.shape[2]), dtype=torch.bfloat16, device=x_rows.device)
    for e, (start, n) in enumerate(zip(starts.tolist(), counts.tolist())):
        if n:
            out[start:start + n] = (x_rows[start:start + n].float() @ w13[e].float()).to(torch.bfloat16)
    return out


def expert_counts(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Pairs per expert, int64 [n_experts], with no host synchronisation: torch.bincount on CUDA reads its
    input's max back to the host to size the output (minlength or not), which stalled every backward call on
    the GPU (session 11: 2.2 ms of host time in the probe's sort stage, all of it waiting). An integer
    scatter-add is exact in any order, so the counts stay deterministic."""
    flat = flat.reshape(-1).long()
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


ROUTER_GEMMS = "tensor-cores"  # or "fp32": moe_backward's router GEMMs (see bf16_mm_fp32, router_gemm_backward)


def bf16_mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 for a, b whose values are bf16: the products are exact in fp32 (8-bit significands), so a
    bf16 tensor-core GEMM with fp32 accumulation (torch.mm(..., out_dtype=torch.float32) on CUDA) is the fp32
    GEMM up to the summation order -- ~10x the fp32 SIMT GEMM's rate. The router's logits, as moe_forward's
    router computes them (tensor cores, fp32 accumulation). ROUTER_GEMMS = "fp32" or a CPU tensor: a.float() @
    b.float()."""
    if a.is_cuda and ROUTER_GEMMS == "tensor-cores":
        return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16), out_dtype=torch.float32)
    return a.float() @ b.float()


def router_gemm_backward(dlogits: torch.Tensor, x: torch.Tensor, router_weight: torch.Tensor):
    """moe_reference.router_gemm_backward_ref (d(router weight) = dl^T x [E, H], the router's part of dx = dl Wr)
    for bf16 x, Wr and fp32 dl on bf16 tensor cores: dl = hi + lo + r with hi = bf16(dl), lo = bf16(dl - hi)
    (|r| <= 2^-18 |dl|), split once for both GEMMs, so hi @ b + lo @ b (fp32 accumulation, products exact) is
    the fp32 GEMM to ~2^-17 relative -- two bf16 GEMMs instead of one fp32 SIMT GEMM each (at deepseek-v3 4k
    tokens 2 x 15 GFLOP). ROUTER_GEMMS = "fp32" or CPU tensors: the reference's fp32 formulas."""
    if not (dlogits.is_cuda and ROUTER_GEMMS == "tensor-cores"):
        return dlogits.t() @ x.float(), dlogits @ router_weight.float()
    hi = dlogits.to(torch.bfloat16)
    lo = (dlogits - hi.float()).to(torch.bfloat16)
    pair = lambda a, b: bf16_mm_fp32(a[0], b) + bf16_mm_fp32(a[1], b)  # noqa: E731
    return pair((hi.t(), lo.t()), x), pair((hi, lo), router_weight)


def _exchange(t: torch.Tensor, send_splits, recv_splits, group) -> torch.Tensor:
    """The rows of ``t`` to their ranks (moe_reference.all_to_all_rows; split sizes on the host)."""
    from ..moe_reference import all_to_all_rows
    return all_to_all_rows(t, recv_splits, send_splits, group)


def _wgrad_dtype(w13: torch.Tensor, wgrad_dtype) -> torch.dtype:
    """The weight gradients' dtype: ``wgrad_dtype`` if given, else the parameters' (bf16; fp32 parameters: fp32)."""
    if wgrad_dtype is not None:
        return wgrad_dtype
    return torch.float32 if w13.dtype == torch.float32 else torch.bfloat16


def do_rows_of(dy, tok, dy_rows, w_pair, world: int) -> torch.Tensor:
    """GEMM2's weight-gradient operand do = w_pair * dy_rows (bf16, one fp32 product per element; bitwise
    ``(w_pair[:, None] * dy_rows.float()).to(bf16)``): at W=1 straight from dy's token rows (dy_rows[i] =
    dy[tok[i]]), at W > 1 from the received dy_rows; torch where Triton cannot run."""
    if not _triton_runs(dy_rows):
        return (w_pair[:, None] * dy_rows.float()).to(torch.bfloat16).contiguous()
    if world == 1:
        return scaled_rows(dy.to(torch.bfloat16), tok, w_pair)
    return scaled_rows(dy_rows, torch.arange(dy_rows.shape[0], device=dy_rows.device), w_pair)


# ------------------------------------------------------------- the backward's expert part in one launch (W = 1)
# the stages (stage s's queue head is scratch[s]; WGRAD has none: statically owned). The drain order is the
# kernel's code order: DGRAD2 (SWIGLU inside it or its own queue next), DGRAD1, ROUTER_DL, WGRAD, ROUTER_DW,
# UNPERMUTE, ROUTER_DX (the three ROUTER_* stages only with the router backward in the launch)
BWD_DGRAD2, BWD_SWIGLU, BWD_DGRAD1, BWD_WGRAD, BWD_UNPERMUTE = 0, 1, 2, 3, 4
BWD_ROUTER_DL, BWD_ROUTER_DW, BWD_ROUTER_DX = 5, 6, 7
# W > 1 only (module docstring, "The one launch at W > 1"): the exchange's stages; their heads sit after the W = 1
# scratch (xs_base), so the W = 1 layout is unchanged
BWD_COMBINE, BWD_PERMUTE, BWD_GU, BWD_DISPATCH = 8, 9, 10, 11
BWD_ALL_STAGES = (1 << 12) - 1
# the stages that read the W > 1 plan (each program entering them makes sure it exists)
EP_PLAN_STAGE_BITS = sum(1 << s for s in (BWD_PERMUTE, BWD_GU, BWD_DGRAD2, BWD_SWIGLU, BWD_DGRAD1, BWD_DISPATCH,
                                          BWD_WGRAD))
# the CPU interpreter's phases of one call at W > 1 (every rank's launch of a phase before any rank's next one):
# the rows out, the expert part and the rows back, the dispatch backward's sums and the router
EP_PHASES = (1 << BWD_COMBINE, EP_PLAN_STAGE_BITS, BWD_ALL_STAGES & ~EP_PLAN_STAGE_BITS & ~(1 << BWD_COMBINE))
# the fixed-role ablation's communication stages (module docstring, "The one launch at W > 1": the fixed policy):
# the rows out (COMBINE-BWD), into the expert layout (PERMUTE-BWD), back (DISPATCH-BWD) and summed per token
# (UNPERMUTE) -- the forward's ROUTE (dispatch), PERMUTE and FOLD; programs pid < S take only these
BWD_COMM_STAGE_BITS = sum(1 << s for s in (BWD_COMBINE, BWD_PERMUTE, BWD_DISPATCH, BWD_UNPERMUTE))
BWD_COMM_STAGES: tl.constexpr = tl.constexpr(BWD_COMM_STAGE_BITS)
# the interpreter's phases under the fixed policy: DISPATCH-BWD gets a phase of its own -- the communication
# programs are the lowest pids, which the interpreter runs first, so in EP_PHASES' second phase they would reach
# DISPATCH-BWD before any compute program had run the DGRAD1 tiles it waits for
EP_PHASES_FIXED = (EP_PHASES[0], EP_PHASES[1] & ~(1 << BWD_DISPATCH), 1 << BWD_DISPATCH, EP_PHASES[2])
EP_PLAN_STAGES: tl.constexpr = tl.constexpr(EP_PLAN_STAGE_BITS)
STAGE_BWD_COMBINE: tl.constexpr = tl.constexpr(BWD_COMBINE)
STAGE_BWD_PERMUTE: tl.constexpr = tl.constexpr(BWD_PERMUTE)
STAGE_BWD_GU: tl.constexpr = tl.constexpr(BWD_GU)
STAGE_BWD_DISPATCH: tl.constexpr = tl.constexpr(BWD_DISPATCH)
BWD_EP_TOKENS = 16  # tokens (rows) per COMBINE / PERMUTE block and rows per DISPATCH step (GPU)
BWD_EP_COLS = 256   # their column step (GPU): [16, 256] bf16 blocks
STAGE_BWD_DGRAD2: tl.constexpr = tl.constexpr(BWD_DGRAD2)
STAGE_BWD_SWIGLU: tl.constexpr = tl.constexpr(BWD_SWIGLU)
STAGE_BWD_DGRAD1: tl.constexpr = tl.constexpr(BWD_DGRAD1)
STAGE_BWD_WGRAD: tl.constexpr = tl.constexpr(BWD_WGRAD)
STAGE_BWD_UNPERMUTE: tl.constexpr = tl.constexpr(BWD_UNPERMUTE)
STAGE_BWD_ROUTER_DL: tl.constexpr = tl.constexpr(BWD_ROUTER_DL)
STAGE_BWD_ROUTER_DW: tl.constexpr = tl.constexpr(BWD_ROUTER_DW)
STAGE_BWD_ROUTER_DX: tl.constexpr = tl.constexpr(BWD_ROUTER_DX)
# local scratch (int32, zeroed by the last program out): [0, 8) queue heads (WGRAD's: its rendezvous count), the
# exit counter, SwiGLU m-tiles done, dgrad1 tiles done, router dlogits blocks done, the two wgrad loops' run heads,
# then finished dgrad2 column tiles per m-tile [max
# m-tiles], SwiGLU-done flags per m-tile [max m-tiles] and (router in the launch) finished UNPERMUTE tasks per
# token block of the router's dx tiles [ceil(T / BM)]
SCB_EXIT: tl.constexpr = tl.constexpr(8)
SCB_SWIGLU_DONE: tl.constexpr = tl.constexpr(9)
SCB_DGRAD1_DONE: tl.constexpr = tl.constexpr(10)
SCB_ROUTER_DL_DONE: tl.constexpr = tl.constexpr(11)
SCB_WGRAD2_HEAD: tl.constexpr = tl.constexpr(12)  # BWD_WGRAD_DYNAMIC: the claimed runs of each flat loop
SCB_WGRAD1_HEAD: tl.constexpr = tl.constexpr(13)
SCB_MTILES: tl.constexpr = tl.constexpr(14)
BWD_ZERO_BLOCK: tl.constexpr = tl.constexpr(1024)  # scratch entries the last program out zeroes per step
BWD_UNPERMUTE_TOKENS = 8  # tokens per UNPERMUTE task (GPU): [8, 256] blocks, the k slots' loads in flight together
BWD_INTERP_PROGRAMS = 3  # the CPU interpreter's default grid (programs run one after another there)
BWD_INTERP_TIMEOUT_NS = 1_000_000  # its waits' bound: 1000 spins (each wait is satisfied at once there, or a bug)
# SWIGLU(gm) run by the program whose dgrad2 tile completes m-tile gm (its counter's atomic returns n_f - 1), so
# the memory-bound pass runs beside the other programs' dgrad2 GEMMs with z still in L2; False: SWIGLU as its own
# queue after DGRAD2's (each task waiting for its m-tile's tiles), which only starts once every dgrad2 tile is
# claimed. Unmeasured: the lead's A/B (both tested bitwise).
BWD_SWIGLU_ON_COMPLETION = True
# The one launch's programs rendezvous (device.soft_barrier: at most BWD_WGRAD1_SYNC_NS, no error) between their
# WGRAD2 and WGRAD1 shares, so that they run WGRAD1's tiles in step: program p's tiles are p, p + GRID, ... of every
# expert in turn, and a heavy expert's panels (deepseek-v3 8k zipf:1.2: ~8000 rows, x_rows + dgu 180 MB) are
# shared in L2 only by programs on the same expert at about the same rows. Session 20 (s20d, one H200): WGRAD2
# ends spread over 0.7 ms and WGRAD1 then ran at 11.95 ms busy per program in the launch against 9.79 ms for the
# standalone kernel (whose programs start together); uniform routing (experts of ~2 row steps) lost nothing.
BWD_WGRAD1_SYNC = True
BWD_WGRAD1_SYNC_NS: tl.constexpr = tl.constexpr(5_000_000)
# The one launch's wgrad loops: the last 1/16 of each loop's tiles claimed in runs of this many tiles (0: all
# statically owned, as the standalone kernel). s20e's trace at deepseek-v3 8k zipf:1.2: the same SM pairs ran
# 4-10% behind in both wgrads whatever their share (no correlation with the share's row steps), so the rendezvous
# waited ~0.5 ms for them and WGRAD1 ended ~0.44 ms after its median program.
BWD_WGRAD_DYNAMIC = 8
BWD_WGRAD_DYNAMIC_16THS = 1  # the claimed share, in 16ths of each loop's tiles (s20h: 1; larger shares untimed)
# The one launch's DGRAD1 at W = 1 without per-task synchronisation where none is needed: a program stops waiting
# for its m-tile's SwiGLU pass once it has seen all of them done (device.reached on the global count), its waits
# use a gpu-scope acquire (the data is this GPU's own), and it releases its finished tiles to UNPERMUTE's count
# once, after its last. Why: s20e's trace at deepseek-v3 8k zipf:1.2 put 192 us per program in DGRAD1's ~138
# per-task waits (a uniform atomic read, fence.acq_rel.sys and the proxy fence before each ~58 us tile), and each
# tile also ended in a barrier + release atomic. False: the per-task wait and release (session 20's form).
BWD_DGRAD1_LEAN = True
# The one launch's SWIGLU pass (one 8-warp program per m-tile, beside the other programs' GEMMs) as one loop over its
# (8-row block, 256-column step)s software-pipelined over this many stages (1: the nested loops, loads issued one
# step at a time). Why: s20e's trace at deepseek-v3 8k zipf:1.2 put 0.91 ms per program in SWIGLU, ~185 us per
# m-tile pass of ~3.1 MB (~17 GB/s per program: one step's 12 KB of loads in flight at a time), against 0.49 ms for
# the standalone pass over all SMs.
BWD_SWIGLU_STAGES = 3
# moe_backward(one_launch=True)'s router backward: True -- the stages ROUTER_DL, ROUTER_DW, ROUTER_DX of the one
# launch (the module docstring's "The router backward in the launch"; s19a: 0.73 ms faster than the torch ops at
# deepseek-v3 4k zipf:1.2); False -- the
# torch ops after the launch, as before (bitwise the multi-launch path's dx and d_router)
BWD_ROUTER_IN_LAUNCH = True
BWD_ROUTER_TOKENS = 8  # tokens per ROUTER_DL task (GPU): [8, next_pow2(E)] fp32 blocks (4: spill-free too; docstring)
# the router GEMMs' tiles (GPU): dx_r = dl Wr (BM x BN over [T, H], BK of E per step) and dWr = dl^T x (BI x BJ
# over [E, H], BR tokens per step); hi and lo dl tiles share one TMA load of the Wr / x tile per step
BWD_ROUTER_DX_TILES = (128, 128, 64, 3)  # (BM, BN, BK, stages)
BWD_ROUTER_DW_TILES = (128, 128, 64, 3)  # (BI, BJ, BR, stages)


@triton.jit
def _trace_clock(TRACE: tl.constexpr):
    """The global timer where the launch is traced, else 0 (no timer read at all)."""
    if TRACE:
        return dev.now_ns()
    else:
        return tl.full([], 0, tl.int64)


@triton.jit
def _bwd_swiglu_mtile(gm, x, first_mtile_ptr, pad_offs_ptr, counts_ptr, z_ptr, gu_ptr, wp_ptr, dgu_ptr, h_ptr, dw_ptr,
                      valid_ptr, swiglu_ctr, swiglu_done_ptr, F, BM: tl.constexpr, PAD: tl.constexpr,
                      SW_BR: tl.constexpr, SW_BF: tl.constexpr, INTERP: tl.constexpr, SW_STAGES: tl.constexpr = 1):
    """The one launch's SWIGLU task of m-tile gm (its dgrad2 tiles stored and acquired): _swiglu_backward_rows over
    the m-tile's rows in SW_BR-row blocks up to the expert's padded end -- its gap rows get zeros (the flat wgrad
    reads them), the next expert's rows are another m-tile's --, then swiglu_done[gm] and the count (release).
    SW_STAGES > 1 (BWD_SWIGLU_STAGES): the (row block, column step) nest as ONE loop software-pipelined over
    SW_STAGES stages (tl.range: the next steps' z, g, u loads in flight while this step computes and stores), the
    same steps in the same order -- the gate gradient's column sum restarts at each block's first step and is
    stored at its last: the same bits."""
    e = tl.sum((tl.load(first_mtile_ptr + x) <= gm).to(tl.int32), 0) - 1
    lm0 = (gm - tl.load(first_mtile_ptr + e)) * BM
    row0 = tl.load(pad_offs_ptr + e) + lm0
    n_rows = tl.minimum(tl.cdiv(tl.load(counts_ptr + e), PAD) * PAD - lm0, BM)
    if SW_STAGES > 1:
        n_col = tl.cdiv(F, SW_BF)
        dw = tl.zeros([SW_BR], dtype=tl.float32)
        for it in tl.range(0, tl.cdiv(n_rows, SW_BR) * n_col, num_stages=SW_STAGES):
            cs = it % n_col
            r = (it // n_col) * SW_BR + tl.arange(0, SW_BR)
            rm = r < n_rows
            i = row0 + r
            i64 = i.to(tl.int64)
            zm = rm & (tl.load(valid_ptr + i, mask=rm, other=0) != 0)
            wp = tl.load(wp_ptr + i, mask=rm, other=0.0)
            part = _swiglu_backward_cols(i64, rm, zm, wp, cs * SW_BF + tl.arange(0, SW_BF), z_ptr, gu_ptr, dgu_ptr,
                                         h_ptr, F, True, INTERP)
            dw = tl.where(cs == 0, 0.0, dw) + part  # 0 + s == s: the nested loop's first add
            if cs == n_col - 1:
                tl.store(dw_ptr + i, dw, mask=rm)
    else:
        for r0 in range(0, n_rows, SW_BR):
            r = r0 + tl.arange(0, SW_BR)
            _swiglu_backward_rows(row0 + r, r < n_rows, z_ptr, gu_ptr, wp_ptr, dgu_ptr, h_ptr, dw_ptr, valid_ptr, F,
                                  SW_BF, True, INTERP, True)
    tl.debug_barrier()
    tl.atomic_add(swiglu_ctr + gm, 1, sem="release", scope="gpu")
    tl.atomic_add(swiglu_done_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _expf(v, INTERP: tl.constexpr):
    """exp in fp32 as torch's CUDA kernels compute it (libdevice expf; the interpreter: numpy's exp)."""
    if INTERP:
        return tl.exp(v)
    else:
        return libdevice.exp(v)


@triton.jit
def _router_slot(j, tok64, tm, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, ER, mx, rs, TOPK: tl.constexpr,
                 SOFTMAX: tl.constexpr, INTERP: tl.constexpr):
    """Slot j of the tokens tok64 [UT] (those with tm): (e_j, q_j, dw_j) [UT] -- the selected expert, its routing
    probability p[e_j] (softmax: exp(l - mx) * rs, the full row's operations) or score sigmoid(l[e_j]), and the
    pair's gate gradient dw_rows[inv[t*k + j]]."""
    pair = tok64 * TOPK + j
    e_j = tl.load(experts_ptr + pair, mask=tm, other=0).to(tl.int64)
    l_j = tl.load(logits_ptr + tok64 * ER + e_j, mask=tm, other=0.0)
    if SOFTMAX:
        q_j = _expf(l_j - mx, INTERP) * rs
    else:
        q_j = _torch_sigmoid(l_j, INTERP)
    dw_j = tl.load(dw_rows_ptr + tl.load(inv_ptr + pair, mask=tm, other=0).to(tl.int64), mask=tm, other=0.0)
    return e_j, tl.where(tm, q_j, 0.0), dw_j


@triton.jit
def _router_dlogits_block(b, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, dlhl_ptr, T, ER, EP, c,
                          TOPK: tl.constexpr, ERP2: tl.constexpr, UT: tl.constexpr,
                          SOFTMAX: tl.constexpr, RENORM: tl.constexpr, INTERP: tl.constexpr):
    """The one launch's ROUTER_DL task b: tokens [b*UT, b*UT + UT), each row on its own (module docstring, "The
    router backward in the launch"): the gate gradients dw[t, j] = dw_rows[inv[t*k + j]] (the pairs' rows, the
    multi-launch path's dweights scatter), the routing recomputed from the fp32 logits (q_j = p[e_j] or s[e_j],
    S = sum_j q_j + 1e-20, w_j = c q_j / S or c q_j), dq (router_weights_backward_ref) and dl [UT, ER]
    (router_logits_backward_ref: softmax p (dp - <dq, q>), sigmoid dq s (1 - s) at the selected experts), stored
    split for the bf16 tensor cores as hi = bf16(dl) into dlhl[t, 0:ER] and lo = bf16(dl - hi) into dlhl[t, EP:EP+ER]
    (round to nearest even; columns ER..EP of each half are never written and never read). The k slots in
    static loops over [UT] vectors (each slot's values reloaded per pass, from L1: fewer registers than [UT, k]
    tiles -- the one launch has none to spare); the sums over the slots in slot order."""
    tok = b * UT + tl.arange(0, UT)
    tm = tok < T
    tok64 = tl.minimum(tok, T - 1).to(tl.int64)  # past T: a valid row, nothing stored
    cols = tl.arange(0, ERP2)
    i = tl.minimum(tok, T - 1) - b * UT  # the block's rows from its first token: int32 offsets inside the block
    mx = tl.zeros((UT,), dtype=tl.float32)
    rs = tl.zeros((UT,), dtype=tl.float32)
    if SOFTMAX:
        lg = tl.load(logits_ptr + (b * UT).to(tl.int64) * ER + (i[:, None] * ER + cols[None, :]),
                     mask=(cols < ER)[None, :], other=float("-inf"))
        mx = tl.max(lg, 1)
        rs = tl.math.div_rn(tl.full(mx.shape, 1.0, tl.float32), tl.sum(_expf(lg - mx[:, None], INTERP), 1))
    denom = tl.zeros((UT,), dtype=tl.float32)
    dww = tl.zeros((UT,), dtype=tl.float32)
    if RENORM:  # S, then <dw, w> (w_j = (q_j / S) c: route's and routing_weights_ref's order)
        for j in tl.static_range(TOPK):
            e_j, q_j, dw_j = _router_slot(j, tok64, tm, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, ER, mx, rs,
                                          TOPK, SOFTMAX, INTERP)
            denom += q_j
        denom = denom + 1e-20
        for j in tl.static_range(TOPK):
            e_j, q_j, dw_j = _router_slot(j, tok64, tm, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, ER, mx, rs,
                                          TOPK, SOFTMAX, INTERP)
            dww += dw_j * (tl.math.div_rn(q_j, denom) * c)
    dp = tl.zeros((UT, ERP2), dtype=tl.float32)  # softmax: dq at the selected experts; sigmoid: dl itself
    r = tl.zeros((UT,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e_j, q_j, dw_j = _router_slot(j, tok64, tm, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, ER, mx, rs, TOPK,
                                      SOFTMAX, INTERP)
        if RENORM:
            dq_j = tl.math.div_rn(c * dw_j - dww, denom)
        else:
            dq_j = c * dw_j
        if SOFTMAX:
            r += dq_j * q_j
            dp = tl.where(cols[None, :] == e_j[:, None], dq_j[:, None], dp)
        else:
            dp = tl.where(cols[None, :] == e_j[:, None], (dq_j * q_j * (1.0 - q_j))[:, None], dp)
    if SOFTMAX:
        p = _expf(lg - mx[:, None], INTERP) * rs[:, None]
        dl = p * (dp - r[:, None])
    else:
        dl = dp
    hi = _to_out(dl, tl.bfloat16, INTERP)
    lo = _to_out(dl - hi.to(tl.float32), tl.bfloat16, INTERP)
    o = i[:, None] * (2 * EP) + cols[None, :]
    cm = tm[:, None] & (cols < ER)[None, :]
    row0 = dlhl_ptr + (b * UT).to(tl.int64) * (2 * EP)
    tl.store(row0 + o, hi, mask=cm)
    tl.store(row0 + EP + o, lo, mask=cm)


@triton.jit
def _router_dw_tile(ti, tj, hi_desc, lo_desc, x_desc, dwr_ptr, T, H, ER, BI: tl.constexpr, BJ: tl.constexpr,
                    BR: tl.constexpr, DOT_FP32: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """The one launch's ROUTER_DW task (ti, tj): dWr[ti-tile, tj-tile] = sum over the tokens in ascending order, BR
    per step, of hi^T x + lo^T x (one fp32 accumulator; the hi and lo tiles share the step's x tile) -- the
    d(router weight) tile [BI, BJ] fp32, stored once. Tokens past T and experts past ER read as zeros (TMA)."""
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    for r in tl.range(0, T, BR, num_stages=LOOP_STAGES):
        b = x_desc.load([r, tj * BJ])
        a = hi_desc.load([r, ti * BI])
        if DOT_FP32:
            acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc)
        else:
            acc = tl.dot(tl.trans(a), b, acc)
        a = lo_desc.load([r, ti * BI])
        if DOT_FP32:
            acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc)
        else:
            acc = tl.dot(tl.trans(a), b, acc)
    ci = ti * BI + tl.arange(0, BI)
    cj = tj * BJ + tl.arange(0, BJ)
    tl.store(dwr_ptr + ci[:, None].to(tl.int64) * H + cj[None, :], acc, mask=(ci < ER)[:, None] & (cj < H)[None, :])


@triton.jit
def _router_dx_tile(m, n, hi_desc, lo_desc, wr_desc, dx_e_ptr, dx_ptr, T, H, ER, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """The one launch's ROUTER_DX task (m, n): dx_r = hi Wr + lo Wr over the experts in ascending order, BK per
    step (one fp32 accumulator; hi and lo share the step's Wr tile), then dx = bf16(dx_e + dx_r) for tokens
    [m*BM, +BM), columns [n*BN, +BN) -- moe_backward's (dx_e + dx_r).to(bf16), the dispatch backward's fp32 rows
    read back from dx_e (UNPERMUTE's). Experts past ER read as zeros (TMA), tokens past T are not stored."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, ER, BK, num_stages=LOOP_STAGES):
        b = wr_desc.load([k0, n * BN])
        a = hi_desc.load([m * BM, k0])
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
        a = lo_desc.load([m * BM, k0])
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    rows = m * BM + tl.arange(0, BM)
    cols = n * BN + tl.arange(0, BN)
    mask = (rows < T)[:, None] & (cols < H)[None, :]
    o = rows[:, None].to(tl.int64) * H + cols[None, :]
    dx_e = tl.load(dx_e_ptr + o, mask=mask, other=0.0)
    tl.store(dx_ptr + o, _to_out(dx_e + acc, tl.bfloat16, DOT_FP32), mask=mask)


@triton.jit
def _n_mtiles(counts_ptr, E, ELP2: tl.constexpr, BM: tl.constexpr):
    """The m-tiles of all experts, sum of ceil(counts / BM) (the one launch's task counts)."""
    x = tl.arange(0, ELP2)
    return tl.sum(tl.cdiv(tl.load(counts_ptr + x, mask=x < E, other=0), BM), 0)


# ------------------------------------------------------- the one launch at W > 1: the exchanges as stages
@triton.jit
def _ep_combine_block(b, x_ptr, dy_ptr, exp_ptr, w_ptr, pidx_ptr, peer_data, off_rx, off_rdy, off_meta, off_w, T, H,
                      El, rank, WORLD: tl.constexpr, TOPK: tl.constexpr, KP2: tl.constexpr, XB: tl.constexpr,
                      XBH: tl.constexpr):
    """COMBINE-BWD task b: tokens [b*XB, +XB) of this rank. To every rank d: the tokens' metadata rows (per slot j:
    d's local expert or -1, and the pair's place among this rank's pairs of that expert -- computed at the source
    from its stable expert sort) and gate weights; each token's x and dy rows once to every d holding one of its
    experts. Everything lands at d's receive row [rank * T + t]: the token's own index, so no slot atomics and
    nothing whose place depends on the schedule."""
    rows = b * XB + tl.arange(0, XB)
    tm = rows < T
    kc = tl.arange(0, KP2)[None, :]
    pm = tm[:, None] & (kc < TOPK)
    po = rows[:, None] * TOPK + kc
    e = tl.load(exp_ptr + po, mask=pm, other=0)
    dest = tl.where(pm, e // El, -1)
    le = e - dest * El
    idx = tl.load(pidx_ptr + po, mask=pm, other=0)
    wv = tl.load(w_ptr + po, mask=pm, other=0.0)
    at = (rank * T + rows).to(tl.int64)
    for d in tl.static_range(WORLD):
        meta = dev.peer_region(peer_data, d, off_meta, tl.int32) + at[:, None] * (2 * TOPK) + 2 * kc
        tl.store(meta, tl.where(dest == d, le, -1), mask=pm)
        tl.store(meta + 1, idx, mask=pm)
        tl.store(dev.peer_region(peer_data, d, off_w, tl.float32) + at[:, None] * TOPK + kc, wv, mask=pm)
    for c0 in range(0, H, XBH):
        c = c0 + tl.arange(0, XBH)
        m = tm[:, None] & (c < H)[None, :]
        o = rows.to(tl.int64)[:, None] * H + c[None, :]
        xv = tl.load(x_ptr + o, mask=m)
        dv = tl.load(dy_ptr + o, mask=m)
        o2 = at[:, None] * H + c[None, :]
        for dd in range(WORLD):  # dynamic: one destination's pointers live at a time
            has = tl.max(tl.where(dest == dd, 1, 0), 1) > 0
            mm = m & has[:, None]
            tl.store(dev.peer_region(peer_data, dd, off_rx, tl.bfloat16) + o2, xv, mask=mm)
            tl.store(dev.peer_region(peer_data, dd, off_rdy, tl.bfloat16) + o2, dv, mask=mm)


@triton.jit
def _ep_publish(send_cnt_ptr, peer_data, peer_sig, off_cnt, El, rank, epoch, WORLD: tl.constexpr,
                ELP2: tl.constexpr, FLAG_BASE: tl.constexpr):
    """The rank's last COMBINE-BWD task: this rank's pair counts of d's experts into d's count row [rank], then
    flag FLAG_BASE + rank = epoch on d (release: every COMBINE task's stores, acquired through the task count)."""
    i = tl.arange(0, ELP2)
    for d in tl.static_range(WORLD):
        c = tl.load(send_cnt_ptr + d * El + i, mask=i < El, other=0)
        tl.store(dev.peer_region(peer_data, d, off_cnt, tl.int32) + rank * El + i, c, mask=i < El)
        dev.notify(dev.peer_ptr(peer_sig, d, tl.int32) + FLAG_BASE + rank, epoch)


@triton.jit
def _ep_ensure_plan(sig_ptr, cnt_ptr, counts_ptr, pad_offs_ptr, first_mtile_ptr, base_ptr, state_ptr, El, rank,
                    epoch, timeout_ns, err_ptr, WORLD: tl.constexpr, WP2: tl.constexpr, ELP2: tl.constexpr,
                    BM: tl.constexpr, PAD: tl.constexpr, FLAG_BASE: tl.constexpr):
    """This call's plan at the holder, once every source's flag holds the epoch (CAS-elected builder, as
    moe_forward._ensure_plan; the others wait for it): counts[e] = sum over sources, pad_offs (the padded layout),
    first_mtile (padded with 2**30 to ELP2, as _mtile_plan's), base[s, e] = the rows of e from sources < s.
    Returns 0 on a timeout."""
    ok = 1
    state = dev.load_uniform(state_ptr)
    if state < 2:
        for s in tl.static_range(WORLD):
            ok = ok & dev.wait_geq(sig_ptr + FLAG_BASE + s, epoch, timeout_ns, err_ptr, OP_MOE_BACKWARD,
                                   WAIT_BWD_COMBINE, rank, -1, s)
        if ok != 0:
            won = 0
            if state == 0:
                won = (tl.atomic_cas(state_ptr, 0, 1, sem="acq_rel", scope="gpu") == 0).to(tl.int32)
            if won != 0:
                si = tl.arange(0, WP2)[:, None]
                ei = tl.arange(0, ELP2)[None, :]
                sm = (si < WORLD) & (ei < El)
                c = tl.load(cnt_ptr + si * El + ei, mask=sm, other=0, volatile=True)
                tot = tl.sum(c, 0)
                e1 = tl.arange(0, ELP2)
                em = e1 < El
                padded = tl.cdiv(tot, PAD) * PAD
                mt = tl.cdiv(tot, BM)
                tl.store(counts_ptr + e1, tot, mask=em)
                tl.store(pad_offs_ptr + e1, tl.cumsum(padded, 0) - padded, mask=em)
                tl.store(first_mtile_ptr + e1, tl.where(em, tl.cumsum(mt, 0) - mt, 2**30))
                tl.store(base_ptr + si * El + ei, tl.cumsum(c, 0) - c, mask=sm)
                tl.debug_barrier()
                tl.atomic_xchg(state_ptr, 2, sem="release", scope="gpu")
    if ok != 0:  # the acquire (and proxy fence) of the plan for every program
        ok = dev.wait_geq(state_ptr, 2, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_PLAN, rank, -1, 0)
    return ok


@triton.jit
def _ep_permute_task(p, recv_x, recv_dy, recv_meta, recv_w, counts_ptr, pad_offs_ptr, base_ptr, x_rows, dy_rows,
                     do_rows, gu_ptr, wp_ptr, valid_ptr, row_meta_ptr, placed_ptr, T, H, F, El, rank,
                     WORLD: tl.constexpr, TOPK: tl.constexpr, KP2: tl.constexpr, XB: tl.constexpr,
                     XBH: tl.constexpr, PAD: tl.constexpr, INTERP: tl.constexpr):
    """PERMUTE-BWD task p. p < El: expert p's gap rows (after its last row, up to the pad) zeroed in x_rows, dy_rows,
    do_rows, g | u, w_pair and valid -- the layout's contract (the flat wgrad and the SwiGLU pass read them).
    Else received rows [b*XB, +XB) of source s = (rank + (p - El) // blocks) % W (own rows first): every pair's
    row at its deterministic place pad_offs[e] + base[s, e] + idx -- (source rank, pair order) inside an expert,
    the multi-launch path's order -- with x, dy, do = bf16(w * dy) (gather_rows_and_scaled's product), w, valid
    and (source, pair) for the dispatch backward. +1 on placed[e] per row and per gap task (release)."""
    if p < El:
        n = tl.load(counts_ptr + p)
        r0 = tl.load(pad_offs_ptr + p) + n
        n_gap = tl.cdiv(n, PAD) * PAD - n
        for g0 in range(0, n_gap, XB):
            r = g0 + tl.arange(0, XB)
            rm = r < n_gap
            row = (r0 + r).to(tl.int64)
            tl.store(wp_ptr + row, tl.zeros([XB], tl.float32), mask=rm)
            tl.store(valid_ptr + row, tl.zeros([XB], tl.uint8), mask=rm)
            zero = tl.zeros([XB, XBH], tl.bfloat16)
            for c0 in range(0, H, XBH):
                c = c0 + tl.arange(0, XBH)
                o = row[:, None] * H + c[None, :]
                m = rm[:, None] & (c < H)[None, :]
                tl.store(x_rows + o, zero, mask=m)
                tl.store(dy_rows + o, zero, mask=m)
                tl.store(do_rows + o, zero, mask=m)
            for c0 in range(0, 2 * F, XBH):
                c = c0 + tl.arange(0, XBH)
                tl.store(gu_ptr + row[:, None] * (2 * F) + c[None, :], zero, mask=rm[:, None] & (c < 2 * F)[None, :])
        tl.debug_barrier()
        tl.atomic_add(placed_ptr + p, 1, sem="release", scope="gpu")
    else:
        n_xb = tl.cdiv(T, XB)
        s = (rank + (p - El) // n_xb) % WORLD
        tok = ((p - El) % n_xb) * XB + tl.arange(0, XB)
        tm = tok < T
        kc = tl.arange(0, KP2)[None, :]
        km = tm[:, None] & (kc < TOPK)
        at = (s * T + tok).to(tl.int64)
        le = tl.load(recv_meta + at[:, None] * (2 * TOPK) + 2 * kc, mask=km, other=-1)
        idx = tl.load(recv_meta + at[:, None] * (2 * TOPK) + 2 * kc + 1, mask=km, other=0)
        valid = km & (le >= 0)
        le = tl.where(valid, le, 0)
        dst = tl.load(pad_offs_ptr + le, mask=valid, other=0) + tl.load(base_ptr + s * El + le, mask=valid,
                                                                        other=0) + idx
        w = tl.load(recv_w + at[:, None] * TOPK + kc, mask=valid, other=0.0)
        d64 = dst.to(tl.int64)
        tl.store(row_meta_ptr + d64 * 2, s + 0 * dst, mask=valid)
        tl.store(row_meta_ptr + d64 * 2 + 1, tok[:, None] * TOPK + kc, mask=valid)
        tl.store(wp_ptr + d64, w, mask=valid)
        tl.store(valid_ptr + d64, tl.full(dst.shape, 1, tl.uint8), mask=valid)
        for c0 in range(0, H, XBH):
            c = c0 + tl.arange(0, XBH)
            cm = (c < H)[None, :]
            so = at[:, None] * H + c[None, :]
            xv = tl.load(recv_x + so, mask=tm[:, None] & cm)
            dv = tl.load(recv_dy + so, mask=tm[:, None] & cm)
            for j in range(TOPK):  # dynamic: unrolled, the k slots' pointers would be live together
                dj = tl.sum(tl.where(kc == j, d64, 0), 1)
                vj = tl.max(tl.where((kc == j) & valid, 1, 0), 1) > 0
                wj = tl.sum(tl.where(kc == j, w, 0.0), 1)
                o = dj[:, None] * H + c[None, :]
                mm = vj[:, None] & cm
                tl.store(x_rows + o, xv, mask=mm)
                tl.store(dy_rows + o, dv, mask=mm)
                tl.store(do_rows + o, _to_out(dv.to(tl.float32) * wj[:, None], tl.bfloat16, INTERP), mask=mm)
        tl.debug_barrier()
        tl.atomic_add(placed_ptr + le, 1, mask=valid, sem="release", scope="gpu")


@triton.jit
def _mtile_expert(first_mtile_ptr, gm, ELP2: tl.constexpr):
    """The expert of global m-tile gm (_mtile_rows' rule)."""
    return tl.sum((tl.load(first_mtile_ptr + tl.arange(0, ELP2)) <= gm).to(tl.int32), 0) - 1


@triton.jit
def _ep_dispatch_mtile(gm, first_mtile_ptr, pad_offs_ptr, counts_ptr, dx_rows, dw_rows, row_meta_ptr, peer_data,
                       peer_ctr, off_cx, off_cdw, H, TOPK: tl.constexpr, ELP2: tl.constexpr, BM: tl.constexpr,
                       XB: tl.constexpr, XBH: tl.constexpr, UT: tl.constexpr):
    """DISPATCH-BWD task gm (its dgrad1 tiles done): each real row's dx (bf16) and gate gradient (fp32) straight
    into its token's rank's combine rows [t*k + j], then +1 per row on that rank's counter of the token's
    UNPERMUTE block (release, system scope: the rows are remote)."""
    e = _mtile_expert(first_mtile_ptr, gm, ELP2)
    lm0 = (gm - tl.load(first_mtile_ptr + e)) * BM
    row0 = tl.load(pad_offs_ptr + e) + lm0
    n_rows = tl.minimum(tl.load(counts_ptr + e) - lm0, BM)
    for r0 in range(0, n_rows, XB):
        r = r0 + tl.arange(0, XB)
        rm = r < n_rows
        row = (row0 + r).to(tl.int64)
        src = tl.load(row_meta_ptr + row * 2, mask=rm, other=0)
        pair = tl.load(row_meta_ptr + row * 2 + 1, mask=rm, other=0)
        dst = dev.peer_region(peer_data, src, off_cx, tl.bfloat16) + pair.to(tl.int64) * H
        for c0 in range(0, H, XBH):
            c = c0 + tl.arange(0, XBH)
            m = rm[:, None] & (c < H)[None, :]
            tl.store(dst[:, None] + c[None, :], tl.load(dx_rows + row[:, None] * H + c[None, :], mask=m), mask=m)
        tl.store(dev.peer_region(peer_data, src, off_cdw, tl.float32) + pair, tl.load(dw_rows + row, mask=rm),
                 mask=rm)
        tl.debug_barrier()
        tl.atomic_add(dev.peer_region(peer_ctr, src, 0, tl.int32) + (pair // TOPK) // UT, 1, mask=rm, sem="release",
                      scope="sys")


@triton.jit
def _takes(stages, s: tl.constexpr, fixed_comm, POLICY: tl.constexpr):
    """Whether this program takes stage ``s``: in the mask ``stages`` and, under the fixed policy, of its role (s a
    communication stage -- BWD_COMM_STAGES -- for programs < fixed_comm, any other for the rest):
    schedule.program_stages' role mask, asked one stage at a time with the program id read afresh
    (device.program_id_fresh). Why not the mask, or the role as one predicate, computed once: either lives in a
    register through the whole launch (the kernel argument ``stages`` is read from the constant bank), and at
    ptxas's 255 cap that made it spill the program id, 12 B, in the fixed build with the router (local Triton
    3.9, W = 2). The self build is has_stage(stages, s), as before."""
    take = sched.has_stage(stages, s)
    if POLICY == sched.POLICY_FIXED:
        if ((BWD_COMM_STAGES >> s) & 1) != 0:
            take = take & (dev.program_id_fresh() < fixed_comm)
        else:
            take = take & (dev.program_id_fresh() >= fixed_comm)
    return take


@triton.jit
def _router_dw_stage(scratch_ptr, take, ok, n_ev, pid, dlhl_ptr, x_ptr, dwr_ptr, T, H, ER, EP, timeout_ns, err_ptr,
                     trace_ptr, RUT: tl.constexpr, RW_BI: tl.constexpr, RW_BJ: tl.constexpr, RW_BR: tl.constexpr,
                     DOT_FP32: tl.constexpr, R_STAGES: tl.constexpr, TRACE: tl.constexpr):
    """The ROUTER_DW stage's loop (module docstring): dWr = dl^T x per [E, H] tile, after one wait per program on
    every dlogits block; ``take``: whether this program takes the stage (_takes). Returns (ok, n_ev)."""
    if take & (ok != 0):
        t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DW)
        n_wj = tl.cdiv(H, RW_BJ)
        waited = 0
        while (t < tl.cdiv(ER, RW_BI) * n_wj) & (ok != 0):
            t0 = _trace_clock(TRACE)
            if waited == 0:  # once per program: every dlogits block (the reduction runs over all tokens)
                ok = dev.wait_geq(scratch_ptr + SCB_ROUTER_DL_DONE, tl.cdiv(T, RUT), timeout_ns, err_ptr,
                                  OP_MOE_BACKWARD, WAIT_BWD_ROUTER_DL, 0, t, -1)
                waited = 1
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                t0 = t1
            if ok != 0:
                hi_w = tl.make_tensor_descriptor(dlhl_ptr, shape=[T, ER], strides=[2 * EP, 1],
                                                 block_shape=[RW_BR, RW_BI])
                lo_w = tl.make_tensor_descriptor(dlhl_ptr + EP, shape=[T, ER], strides=[2 * EP, 1],
                                                 block_shape=[RW_BR, RW_BI])
                x_w = tl.make_tensor_descriptor(x_ptr, shape=[T, H], strides=[H, 1], block_shape=[RW_BR, RW_BJ])
                _router_dw_tile(t // n_wj, t % n_wj, hi_w, lo_w, x_w, dwr_ptr, T, H, ER, RW_BI, RW_BJ, RW_BR,
                                DOT_FP32, R_STAGES)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_ROUTER_DW, t, t0, _trace_clock(TRACE), TRACE)
            t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DW)
    return ok, n_ev


@triton.jit(do_not_specialize=["T", "R_PAD", "scratch_n", "max_mtiles", "timeout_us", "stages", "off_rx", "off_rdy",
                               "off_meta", "off_w", "off_cnt", "off_cx", "off_cdw", "xs_base", "rank",
                               "fixed_comm"])
def _moe_backward_experts_kernel(
        dy_rows_ptr, do_rows_ptr, x_rows_ptr, gu_ptr, wp_ptr, valid_ptr, w13_ptr, w2_ptr,
        pad_offs_ptr, counts_ptr, first_mtile_ptr, inv_ptr,
        z_ptr, dgu_ptr, h_ptr, dw_rows_ptr, dx_rows_ptr, dw13_ptr, dw2_ptr, dx_e_ptr,
        x_ptr, wr_ptr, logits_ptr, experts_ptr, dlhl_ptr, dx_ptr, dwr_ptr, ER, EP, routed_scaling,
        scratch_ptr, scratch_n, max_mtiles, err_ptr, epoch_ptr, timeout_us, stages, trace_ptr,
        T, H, F, E, R_PAD,
        dyt_ptr, wt_ptr, pidx_ptr, send_cnt_ptr, recv_x_ptr, recv_dy_ptr, recv_meta_ptr, recv_w_ptr, cnt_ptr,
        comb_x_ptr, comb_dw_ptr, peer_data, peer_sig, peer_ctr, sig_ptr, ctr_ptr, off_rx, off_rdy, off_meta, off_w,
        off_cnt, off_cx, off_cdw, row_meta_ptr, base_ptr, xs_base, rank, fixed_comm,
        TOPK: tl.constexpr, ELP2: tl.constexpr, PAD: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GEMM_STAGES: tl.constexpr,
        TMA2: tl.constexpr, TMA1: tl.constexpr, SW_BR: tl.constexpr, SW_BF: tl.constexpr,
        W2_BI: tl.constexpr, W2_BJ: tl.constexpr, W1_BI: tl.constexpr, W1_BJ: tl.constexpr, W_BR: tl.constexpr,
        W2_STAGES: tl.constexpr, W1_STAGES: tl.constexpr, UT: tl.constexpr, UBH: tl.constexpr, GRID: tl.constexpr,
        SWIGLU_ON_COMPLETION: tl.constexpr, DOT_FP32: tl.constexpr, TRACE: tl.constexpr,
        WGRAD1_SYNC: tl.constexpr = False, WGRAD_DYNAMIC: tl.constexpr = 0, WGRAD_DYNAMIC_16THS: tl.constexpr = 1,
        LEAN_DGRAD1: tl.constexpr = False, SW_STAGES: tl.constexpr = 1,
        ROUTER: tl.constexpr = False,
        SOFTMAX: tl.constexpr = True,
        RENORM: tl.constexpr = True, ERP2: tl.constexpr = 1, RUT: tl.constexpr = 1,
        RX_BM: tl.constexpr = 16, RX_BN: tl.constexpr = 16, RX_BK: tl.constexpr = 16,
        RW_BI: tl.constexpr = 16, RW_BJ: tl.constexpr = 16, RW_BR: tl.constexpr = 16, R_STAGES: tl.constexpr = 1,
        WORLD: tl.constexpr = 1, WP2: tl.constexpr = 1, KP2: tl.constexpr = 1, XB: tl.constexpr = 1,
        XBH: tl.constexpr = 16, TMA_GU: tl.constexpr = False, FINAL: tl.constexpr = True,
        FLAG_BASE: tl.constexpr = 64, DONE_BASE: tl.constexpr = 0, POLICY: tl.constexpr = 0):
    """The backward's expert part, one persistent launch of GRID programs (module docstring, "The one launch"):
    the stages DGRAD2, SWIGLU (SWIGLU_ON_COMPLETION: run inside the DGRAD2 task that completes the m-tile; else
    its own queue), DGRAD1 (shared atomic heads), WGRAD (each program's own share of both flat wgrad loops),
    UNPERMUTE (shared head), each task's arithmetic the standalone kernel's tile function. ROUTER: the router
    backward too ("The router backward in the launch"): ROUTER_DL after DGRAD1, ROUTER_DW after WGRAD, ROUTER_DX
    after UNPERMUTE (shared heads), dx (bf16) and dWr (fp32) its outputs; without it x_ptr .. dwr_ptr are unused
    (at W > 1 x_ptr and experts_ptr are the token rows' and decisions for COMBINE-BWD either way).
    WORLD > 1 ("The one launch at W > 1"): COMBINE-BWD first, the plan, PERMUTE-BWD and GU (g | u recomputed)
    before DGRAD2, DISPATCH-BWD after DGRAD1, UNPERMUTE from the combine rows, the router's ROUTER_DL and
    ROUTER_DW after UNPERMUTE; the plan arrays (counts, pad_offs, first_mtile, base) are the launch's own
    output, the expert-row buffers sized for the worst case (R_PAD). FINAL: this launch ends the call (zeroes
    the scratch, signals done, advances the epoch; the CPU tests' phase launches but the last do not).
    ``stages``: a bitmask of the stages to run (tests: a stage left out makes its consumers' waits time out;
    at W > 1 the CPU tests' phases).
    POLICY (schedule.POLICY_SELF / POLICY_FIXED; fixed at W > 1 only): under the fixed-role ablation programs
    pid < fixed_comm take only the communication stages (BWD_COMM_STAGES) of ``stages``, the others only the rest,
    and WGRAD's static shares and rendezvous count the GRID - fixed_comm compute programs ("The one launch at
    W > 1": the fixed policy). The self build compiles none of it (fixed_comm unused).
    TRACE: every task and wait as a (kind, task, t0, t1) event of trace_ptr [GRID, TRACE_EVENTS, 4] (codes.EV_*;
    WGRAD one event per flat loop, task -1)."""
    pid = tl.program_id(0)
    timeout_ns = tl.cast(timeout_us, tl.int64) * 1000
    x = tl.arange(0, ELP2)
    n_f = tl.cdiv(F, BN)
    n_h = tl.cdiv(H, BN)
    dgrad2_ctr = scratch_ptr + SCB_MTILES
    swiglu_ctr = dgrad2_ctr + max_mtiles  # then (router in the launch) UNPERMUTE tasks done per RX_BM-token block
    ok = 1
    n_ev = 0
    if WORLD > 1:  # the exchange's stages and the plan (module docstring, "The one launch at W > 1")
        xs = scratch_ptr + xs_base  # [0, 4) heads of COMBINE, PERMUTE, GU, DISPATCH; 4 combined; 5 plan state;
        placed = xs + 6             # then rows placed per local expert [E], GU and DGRAD1 tiles done per m-tile
        gu_ctr = placed + E
        dg1_ctr = gu_ctr + max_mtiles
        n_g = tl.cdiv(2 * F, BN)
        if _takes(stages, STAGE_BWD_COMBINE, fixed_comm, POLICY):  # dy (and x) rows once per destination rank
            n_cb = tl.cdiv(T, XB)
            t = sched.claim(xs + 0)
            handshake = 0
            while (t < n_cb) & (ok != 0):
                t0 = _trace_clock(TRACE)
                epoch = dev.call_epoch(epoch_ptr)
                if handshake == 0:  # a peer may still be reading last call's rows from its receive buffers
                    ok = dev.wait_peers_done(sig_ptr, DONE_BASE, WORLD, epoch, timeout_ns, err_ptr, OP_MOE_BACKWARD,
                                             rank)
                    handshake = 1
                if ok != 0:
                    _ep_combine_block(t, x_ptr, dyt_ptr, experts_ptr, wt_ptr, pidx_ptr, peer_data, off_rx, off_rdy,
                                      off_meta, off_w, T, H, E, rank, WORLD, TOPK, KP2, XB, XBH)
                    tl.debug_barrier()
                    if tl.atomic_add(xs + 4, 1, sem="acq_rel", scope="sys") == n_cb - 1:
                        _ep_publish(send_cnt_ptr, peer_data, peer_sig, off_cnt, E, rank, epoch, WORLD, ELP2,
                                    FLAG_BASE)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_COMM, t, t0, _trace_clock(TRACE), TRACE)
                t = sched.claim(xs + 0)
        # every stage from PERMUTE to WGRAD reads the plan (the fixed policy: those of this program's role -- the
        # role decision, schedule.program_stages; elsewhere asked stage by stage, _takes)
        if ((sched.program_stages(pid, POLICY, fixed_comm, stages, BWD_COMM_STAGES) & EP_PLAN_STAGES) != 0) & (ok != 0):
            t0 = _trace_clock(TRACE)
            ok = _ep_ensure_plan(sig_ptr, cnt_ptr, counts_ptr, pad_offs_ptr, first_mtile_ptr, base_ptr, xs + 5, E, rank,
                                 dev.call_epoch(epoch_ptr), timeout_ns, err_ptr, WORLD, WP2, ELP2, BM, PAD, FLAG_BASE)
            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, -1, t0, _trace_clock(TRACE), TRACE)
        if _takes(stages, STAGE_BWD_PERMUTE, fixed_comm, POLICY) & (ok != 0):  # gap rows, then received rows, own first
            t = sched.claim(xs + 1)
            while t < E + WORLD * tl.cdiv(T, XB):
                t0 = _trace_clock(TRACE)
                _ep_permute_task(t, recv_x_ptr, recv_dy_ptr, recv_meta_ptr, recv_w_ptr, counts_ptr, pad_offs_ptr,
                                 base_ptr, x_rows_ptr, dy_rows_ptr, do_rows_ptr, gu_ptr, wp_ptr, valid_ptr,
                                 row_meta_ptr, placed, T, H, F, E, rank, WORLD, TOPK, KP2, XB, XBH, PAD, DOT_FP32)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_PERMUTE, t, t0, _trace_clock(TRACE), TRACE)
                t = sched.claim(xs + 1)
        if _takes(stages, STAGE_BWD_GU, fixed_comm, POLICY) & (ok != 0):  # [g | u] = x_rows W13[e] per (m-, 2F-tile)
            t = sched.claim(xs + 2)
            while (t < _n_mtiles(counts_ptr, E, ELP2, BM) * n_g) & (ok != 0):
                t0 = _trace_clock(TRACE)
                gm = t // n_g
                e = _mtile_expert(first_mtile_ptr, gm, ELP2)
                ok = dev.wait_geq(placed + e, tl.load(counts_ptr + e) + 1, timeout_ns, err_ptr, OP_MOE_BACKWARD,
                                  WAIT_BWD_PERMUTE, rank, t, e)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                if ok != 0:
                    _dgrad1_tile(gm, t % n_g, x_rows_ptr, w13_ptr, pad_offs_ptr, counts_ptr, first_mtile_ptr, gu_ptr,
                                 2 * F, H, ELP2, BM, BN, BK, DOT_FP32, TMA_GU, GEMM_STAGES, True)
                    tl.debug_barrier()
                    tl.atomic_add(gu_ctr + gm, 1, sem="release", scope="gpu")
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_GEMM1, t, t1, _trace_clock(TRACE), TRACE)
                t = sched.claim(xs + 2)
    n_mt = _n_mtiles(counts_ptr, E, ELP2, BM)  # the m-tiles of all experts (recomputed after DGRAD1: see there)
    if _takes(stages, STAGE_BWD_DGRAD2, fixed_comm, POLICY) & (ok != 0):  # z = dy_rows W2[e]^T per (m-tile, F-tile)
        t = sched.claim(scratch_ptr + STAGE_BWD_DGRAD2)
        while (t < n_mt * n_f) & (ok != 0):
            t0 = _trace_clock(TRACE)
            gm = t // n_f
            if WORLD > 1:  # the m-tile's rows placed (its expert's every row and gap)
                e = _mtile_expert(first_mtile_ptr, gm, ELP2)
                ok = dev.wait_geq(placed + e, tl.load(counts_ptr + e) + 1, timeout_ns, err_ptr, OP_MOE_BACKWARD,
                                  WAIT_BWD_PERMUTE, rank, t, e)
            if ok != 0:
                _dgrad1_tile(gm, t % n_f, dy_rows_ptr, w2_ptr, pad_offs_ptr, counts_ptr, first_mtile_ptr, z_ptr, F,
                             H, ELP2, BM, BN, BK, DOT_FP32, TMA2, GEMM_STAGES)
                tl.debug_barrier()
                done = tl.atomic_add(dgrad2_ctr + gm, 1, sem="acq_rel", scope="gpu")
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_DGRAD2, t, t0, t1, TRACE)
                if SWIGLU_ON_COMPLETION:
                    # the m-tile's last dgrad2 tile: its SwiGLU pass here, beside the other programs' GEMMs (the
                    # wait is satisfied at once: it is the acquire -- and proxy -- fence of every thread)
                    if (done == n_f - 1) & _takes(stages, STAGE_BWD_SWIGLU, fixed_comm, POLICY):
                        dev.wait_geq(dgrad2_ctr + gm, n_f, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_DGRAD2, 0,
                                     t, gm)
                        if WORLD > 1:  # and its recomputed g | u
                            ok = dev.wait_geq(gu_ctr + gm, n_g, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_GU,
                                              rank, t, gm)
                        if ok != 0:
                            _bwd_swiglu_mtile(gm, x, first_mtile_ptr, pad_offs_ptr, counts_ptr, z_ptr, gu_ptr, wp_ptr,
                                              dgu_ptr, h_ptr, dw_rows_ptr, valid_ptr, swiglu_ctr,
                                              scratch_ptr + SCB_SWIGLU_DONE, F, BM, PAD, SW_BR, SW_BF, DOT_FP32,
                                              SW_STAGES)
                            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_SWIGLU, gm, t1, _trace_clock(TRACE), TRACE)
            t = sched.claim(scratch_ptr + STAGE_BWD_DGRAD2)
    if not SWIGLU_ON_COMPLETION:  # SWIGLU as its own queue: per m-tile, waiting for its dgrad2 tiles
        if _takes(stages, STAGE_BWD_SWIGLU, fixed_comm, POLICY):  # (asked before the claim: else a task is lost)
            t = sched.claim(scratch_ptr + STAGE_BWD_SWIGLU)
            while (t < n_mt) & (ok != 0):
                t0 = _trace_clock(TRACE)
                ok = dev.wait_geq(dgrad2_ctr + t, n_f, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_DGRAD2, 0, t, t)
                if WORLD > 1:
                    if ok != 0:
                        ok = dev.wait_geq(gu_ctr + t, n_g, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_GU, rank, t,
                                          t)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                if ok != 0:
                    _bwd_swiglu_mtile(t, x, first_mtile_ptr, pad_offs_ptr, counts_ptr, z_ptr, gu_ptr, wp_ptr, dgu_ptr,
                                      h_ptr, dw_rows_ptr, valid_ptr, swiglu_ctr, scratch_ptr + SCB_SWIGLU_DONE, F, BM,
                                      PAD, SW_BR, SW_BF, DOT_FP32, SW_STAGES)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_SWIGLU, t, t1, _trace_clock(TRACE), TRACE)
                t = sched.claim(scratch_ptr + STAGE_BWD_SWIGLU)
    if _takes(stages, STAGE_BWD_DGRAD1, fixed_comm, POLICY) & (ok != 0):  # dx_rows = [dg | du] W13[e]^T per (m, H-tile)
        # LEAN_DGRAD1 (W = 1; BWD_DGRAD1_LEAN): no per-task wait once this program has seen every SwiGLU pass done,
        # and its finished tiles counted into SCB_DGRAD1_DONE once, after its last (UNPERMUTE waits for the total)
        lean = LEAN_DGRAD1 & (WORLD == 1)
        sw_all = 0
        n_done = 0
        t = sched.claim(scratch_ptr + STAGE_BWD_DGRAD1)
        while (t < n_mt * n_h) & (ok != 0):
            t0 = _trace_clock(TRACE)
            gm = t // n_h
            if lean:
                if sw_all == 0:
                    sw_all = dev.reached(scratch_ptr + SCB_SWIGLU_DONE, n_mt, GPU_TMA=True).to(tl.int32)
                    if sw_all == 0:
                        ok = dev.wait_geq(swiglu_ctr + gm, 1, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_SWIGLU, 0,
                                          t, gm, GPU_TMA=True)
            else:
                ok = dev.wait_geq(swiglu_ctr + gm, 1, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_SWIGLU, 0, t, gm)
            t1 = _trace_clock(TRACE)
            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
            if ok != 0:
                _dgrad1_tile(gm, t % n_h, dgu_ptr, w13_ptr, pad_offs_ptr, counts_ptr, first_mtile_ptr, dx_rows_ptr,
                             H, 2 * F, ELP2, BM, BN, BK, DOT_FP32, TMA1, GEMM_STAGES)
                if WORLD > 1:  # per m-tile: its DISPATCH-BWD task waits for it
                    tl.debug_barrier()
                    tl.atomic_add(dg1_ctr + gm, 1, sem="release", scope="gpu")
                elif lean:
                    n_done += 1
                else:
                    tl.debug_barrier()
                    tl.atomic_add(scratch_ptr + SCB_DGRAD1_DONE, 1, sem="release", scope="gpu")
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_DGRAD1, t, t1, _trace_clock(TRACE), TRACE)
            t = sched.claim(scratch_ptr + STAGE_BWD_DGRAD1)
        if lean:  # this program's tiles, released once (its stores before it: the barrier, then the release)
            if n_done > 0:
                tl.debug_barrier()
                tl.atomic_add(scratch_ptr + SCB_DGRAD1_DONE, n_done, sem="release", scope="gpu")
    if WORLD > 1:  # each m-tile's rows back to their tokens' ranks (dx rows and gate gradients)
        if _takes(stages, STAGE_BWD_DISPATCH, fixed_comm, POLICY) & (ok != 0):
            t = sched.claim(xs + 3)
            while (t < n_mt) & (ok != 0):
                t0 = _trace_clock(TRACE)
                ok = dev.wait_geq(dg1_ctr + t, n_h, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_DGRAD1_MTILE,
                                  rank, t, t, True)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                if ok != 0:
                    _ep_dispatch_mtile(t, first_mtile_ptr, pad_offs_ptr, counts_ptr, dx_rows_ptr, dw_rows_ptr,
                                       row_meta_ptr, peer_data, peer_ctr, off_cx, off_cdw, H, TOPK, ELP2, BM, XB, XBH,
                                       UT)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_COMM, t, t1, _trace_clock(TRACE), TRACE)
                t = sched.claim(xs + 3)
    if (WORLD == 1) & ROUTER:  # the gate gradients through the routing: dl per token block, split hi | lo
        if _takes(stages, STAGE_BWD_ROUTER_DL, fixed_comm, POLICY) & (ok != 0):
            t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DL)
            waited = 0
            while (t < tl.cdiv(T, RUT)) & (ok != 0):
                t0 = _trace_clock(TRACE)
                if waited == 0:  # once per program: every m-tile's SwiGLU pass (the rows' gate gradients)
                    ok = dev.wait_geq(scratch_ptr + SCB_SWIGLU_DONE, _n_mtiles(counts_ptr, E, ELP2, BM), timeout_ns,
                                      err_ptr, OP_MOE_BACKWARD, WAIT_BWD_SWIGLU, 0, t, -1)
                    waited = 1
                    t1 = _trace_clock(TRACE)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                    t0 = t1
                if ok != 0:
                    _router_dlogits_block(t, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, dlhl_ptr, T, ER, EP,
                                          routed_scaling, TOPK, ERP2, RUT, SOFTMAX, RENORM, DOT_FP32)
                    tl.debug_barrier()
                    tl.atomic_add(scratch_ptr + SCB_ROUTER_DL_DONE, 1, sem="release", scope="gpu")
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_ROUTER_DL, t, t0, _trace_clock(TRACE), TRACE)
                t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DL)
    if _takes(stages, STAGE_BWD_WGRAD, fixed_comm, POLICY) & (ok != 0):  # this program's share of both flat loops
        t0 = _trace_clock(TRACE)
        # n_mt recomputed (a few loads of counts): kept in a register across WGRAD, ptxas spilled it (with the
        # router stages and fp32 weight gradients)
        ok = dev.wait_geq(scratch_ptr + SCB_SWIGLU_DONE, _n_mtiles(counts_ptr, E, ELP2, BM), timeout_ns, err_ptr,
                          OP_MOE_BACKWARD, WAIT_BWD_SWIGLU, 0, -1, -1)
        t1 = _trace_clock(TRACE)
        n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, -1, t0, t1, TRACE)
        # the programs sharing WGRAD's static shares: all of them (self: constexprs, as before), or under the
        # fixed policy the compute programs (program pid - S of GRID - S)
        w_pid = pid
        w_grid = GRID
        if POLICY == sched.POLICY_FIXED:
            w_pid = pid - fixed_comm
            w_grid = GRID - fixed_comm
        if ok != 0:
            _wgrad_flat_run(w_pid, h_ptr, do_rows_ptr, pad_offs_ptr, counts_ptr, dw2_ptr, F, H, E, R_PAD, W2_BI,
                            W2_BJ, W_BR, w_grid, ELP2, DOT_FP32, W2_STAGES, scratch_ptr + SCB_WGRAD2_HEAD,
                            WGRAD_DYNAMIC, WGRAD_DYNAMIC_16THS)
            t0 = _trace_clock(TRACE)
            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_WGRAD2, -1, t1, t0, TRACE)
            if WGRAD1_SYNC:  # every program starts WGRAD1 together (BWD_WGRAD1_SYNC; WGRAD's head slot counts them)
                tl.atomic_add(scratch_ptr + STAGE_BWD_WGRAD, 1, sem="relaxed", scope="gpu")
                dev.soft_barrier(scratch_ptr + STAGE_BWD_WGRAD, w_grid, BWD_WGRAD1_SYNC_NS)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, -2, t0, t1, TRACE)
                t0 = t1
            _wgrad_flat_run(w_pid, x_rows_ptr, dgu_ptr, pad_offs_ptr, counts_ptr, dw13_ptr, H, 2 * F, E, R_PAD,
                            W1_BI, W1_BJ, W_BR, w_grid, ELP2, DOT_FP32, W1_STAGES, scratch_ptr + SCB_WGRAD1_HEAD,
                            WGRAD_DYNAMIC, WGRAD_DYNAMIC_16THS)
            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_WGRAD1, -1, t0, _trace_clock(TRACE), TRACE)
    if (WORLD == 1) & ROUTER:  # the long compute-bound dWr tiles first (beside UNPERMUTE's memory-bound blocks)
        ok, n_ev = _router_dw_stage(scratch_ptr, _takes(stages, STAGE_BWD_ROUTER_DW, fixed_comm, POLICY), ok,
                                    n_ev, pid, dlhl_ptr, x_ptr, dwr_ptr, T, H, ER, EP,
                                    timeout_ns, err_ptr, trace_ptr, RUT, RW_BI, RW_BJ, RW_BR, DOT_FP32, R_STAGES, TRACE)
    if _takes(stages, STAGE_BWD_UNPERMUTE, fixed_comm, POLICY) & (ok != 0):  # each token's k rows summed in slot order
        t = sched.claim(scratch_ptr + STAGE_BWD_UNPERMUTE)
        waited = 0
        while (t < tl.cdiv(T, UT)) & (ok != 0):
            t0 = _trace_clock(TRACE)
            if WORLD > 1:  # the block's rows from every rank (k per token), in the combine rows [t*k + j]
                ok = dev.wait_geq(ctr_ptr + t, tl.minimum(T - t * UT, UT) * TOPK, timeout_ns, err_ptr,
                                  OP_MOE_BACKWARD, WAIT_BWD_DISPATCH, rank, t, t)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                t0 = t1
            elif waited == 0:  # one wait per program: the counter only grows, the acquire covers what follows
                ok = dev.wait_geq(scratch_ptr + SCB_DGRAD1_DONE, _n_mtiles(counts_ptr, E, ELP2, BM) * n_h,
                                  timeout_ns, err_ptr, OP_MOE_BACKWARD,
                                  WAIT_BWD_DGRAD1, 0, t, -1)
                waited = 1
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                t0 = t1
            if ok != 0:
                tok = t * UT + tl.arange(0, UT)
                tm = tok < T
                tok = tl.minimum(tok, T - 1)[:, None]  # past T: a valid index, nothing stored
                for c0 in range(0, H, UBH):
                    c = c0 + tl.arange(0, UBH)
                    if WORLD > 1:  # inv: the identity (the combine rows are in pair order)
                        _unpermute_sum_cols(tok, c[None, :], tm[:, None] & (c < H)[None, :], comb_x_ptr, inv_ptr,
                                            dx_e_ptr, H, TOPK, True)
                    else:
                        _unpermute_sum_cols(tok, c[None, :], tm[:, None] & (c < H)[None, :], dx_rows_ptr, inv_ptr,
                                            dx_e_ptr, H, TOPK, True)
                if WORLD > 1:  # consumer reset: peers add to it again only after this rank's next COMBINE-BWD
                    tl.debug_barrier()
                    tl.store(ctr_ptr + t, 0)
                if ROUTER:  # +1 on the token block's count (the router's dx tiles of those tokens wait for it)
                    tl.debug_barrier()
                    tl.atomic_add(scratch_ptr + SCB_MTILES + 2 * max_mtiles + (t * UT) // RX_BM, 1, sem="release",
                                  scope="gpu")
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_UNPERMUTE, t, t0, _trace_clock(TRACE), TRACE)
            t = sched.claim(scratch_ptr + STAGE_BWD_UNPERMUTE)
    if (WORLD > 1) & ROUTER:  # the gate gradients came back with the rows: ROUTER_DL per token block, then dWr
        if _takes(stages, STAGE_BWD_ROUTER_DL, fixed_comm, POLICY) & (ok != 0):
            t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DL)
            while (t < tl.cdiv(T, RUT)) & (ok != 0):
                t0 = _trace_clock(TRACE)
                m = (t * RUT) // RX_BM  # its tokens' UNPERMUTE tasks (they acquired the combine rows' gate gradients)
                ok = dev.wait_geq(scratch_ptr + SCB_MTILES + 2 * max_mtiles + m,
                                  tl.cdiv(tl.minimum(T - m * RX_BM, RX_BM), UT), timeout_ns, err_ptr,
                                  OP_MOE_BACKWARD, WAIT_BWD_UNPERMUTE, rank, t, m)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                if ok != 0:
                    _router_dlogits_block(t, logits_ptr, experts_ptr, inv_ptr, comb_dw_ptr, dlhl_ptr, T, ER, EP,
                                          routed_scaling, TOPK, ERP2, RUT, SOFTMAX, RENORM, DOT_FP32)
                    tl.debug_barrier()
                    tl.atomic_add(scratch_ptr + SCB_ROUTER_DL_DONE, 1, sem="release", scope="gpu")
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_ROUTER_DL, t, t1, _trace_clock(TRACE), TRACE)
                t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DL)
        ok, n_ev = _router_dw_stage(scratch_ptr, _takes(stages, STAGE_BWD_ROUTER_DW, fixed_comm, POLICY), ok,
                                    n_ev, pid, dlhl_ptr, x_ptr, dwr_ptr, T, H, ER, EP,
                                    timeout_ns, err_ptr, trace_ptr, RUT, RW_BI, RW_BJ, RW_BR, DOT_FP32, R_STAGES, TRACE)
    if ROUTER:
        if _takes(stages, STAGE_BWD_ROUTER_DX, fixed_comm, POLICY) & (ok != 0):  # dx = bf16(dx_e + dl Wr) per tile
            t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DX)
            n_xn = tl.cdiv(H, RX_BN)
            waited = 0
            while (t < tl.cdiv(T, RX_BM) * n_xn) & (ok != 0):
                t0 = _trace_clock(TRACE)
                m = t // n_xn
                if waited == 0:  # once per program: every dlogits block (in practice long done: before WGRAD)
                    ok = dev.wait_geq(scratch_ptr + SCB_ROUTER_DL_DONE, tl.cdiv(T, RUT), timeout_ns, err_ptr,
                                      OP_MOE_BACKWARD, WAIT_BWD_ROUTER_DL, 0, t, -1)
                    waited = 1
                if ok != 0:  # the token block's dispatch backward (its UNPERMUTE tasks)
                    ok = dev.wait_geq(scratch_ptr + SCB_MTILES + 2 * max_mtiles + m,
                                      tl.cdiv(tl.minimum(T - m * RX_BM, RX_BM), UT), timeout_ns, err_ptr,
                                      OP_MOE_BACKWARD, WAIT_BWD_UNPERMUTE, 0, t, m)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                if ok != 0:
                    hi_x = tl.make_tensor_descriptor(dlhl_ptr, shape=[T, ER], strides=[2 * EP, 1],
                                                     block_shape=[RX_BM, RX_BK])
                    lo_x = tl.make_tensor_descriptor(dlhl_ptr + EP, shape=[T, ER], strides=[2 * EP, 1],
                                                     block_shape=[RX_BM, RX_BK])
                    wr_x = tl.make_tensor_descriptor(wr_ptr, shape=[ER, H], strides=[H, 1],
                                                     block_shape=[RX_BK, RX_BN])
                    _router_dx_tile(m, t % n_xn, hi_x, lo_x, wr_x, dx_e_ptr, dx_ptr, T, H, ER, RX_BM, RX_BN, RX_BK,
                                    DOT_FP32, R_STAGES)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_ROUTER_DX, t, t1, _trace_clock(TRACE), TRACE)
                t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DX)
    # the epoch read here, not at the start: still before this program's exit atomic (device.py's argument: the last
    # program out stores it only after every program's exit atomic), and no register held across the whole launch
    # for it (with the router stages, ptxas spilled it across WGRAD: 4 B with fp32 weight gradients)
    if FINAL:
        epoch = dev.call_epoch(epoch_ptr)
        if WORLD > 1:  # done[rank] = epoch on every peer: they may write into this rank's buffers again
            dev.exit_program_zeroing(scratch_ptr, scratch_n, SCB_EXIT, GRID, peer_sig, DONE_BASE, rank, WORLD, epoch,
                                     epoch_ptr, BWD_ZERO_BLOCK)
        else:
            dev.exit_program_zeroing(scratch_ptr, scratch_n, SCB_EXIT, GRID, err_ptr, 0, 0, 1, epoch, epoch_ptr,
                                     BWD_ZERO_BLOCK)


def _pair_rows(order: torch.Tensor, row_of=None) -> torch.Tensor:
    """Each pair p = t*k + j's expert row (inv[order[i]] = i, or row_of[i] in the padded layout): the dispatch
    backward's gather index (unpermute_sum and the one launch)."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.shape[0], dtype=order.dtype, device=order.device) if row_of is None else \
        row_of.to(order.dtype)
    return inv


def _bwd_tiles(out_dtype: torch.dtype, h: int, f: int):
    """The one launch's tiles: ((BM, BN, BK, stages) of both dgrads, (SwiGLU rows, columns), wgrad2's and wgrad1's
    (BI, BJ, BR, stages), (UNPERMUTE tokens, columns), warps) -- today's kernels' (the interpreter's small ones)."""
    if planning.interpreting():
        return (16, 16, 16, 1), (4, 16), (16, 16, 16, 1), (16, 16, 16, 1), (2, 16), 4
    bm, bn, bk, warps, stages = DGRAD1_TILES
    w2 = wgrad_flat_tiles(out_dtype, f, h)
    w1 = wgrad_flat_tiles(out_dtype, h, 2 * f)
    if not warps == w2[3] == w1[3] == 8 or w2[2] != w1[2]:  # one kernel: one warp count, one row step
        raise ValueError(f"the one launch needs one warp count and one wgrad row step: dgrad {DGRAD1_TILES}, "
                         f"wgrad2 {w2}, wgrad1 {w1}")
    return ((bm, bn, bk, stages), (8, min(256, triton.next_power_of_2(f))), (*w2[:3], w2[4]), (*w1[:3], w1[4]),
            (BWD_UNPERMUTE_TOKENS, min(256, triton.next_power_of_2(h))), warps)


class RouterBackward(NamedTuple):
    """The router backward's inputs for the one launch (expert_backward_one_launch(router=)): the layer's input x
    [T, H] and router weight [E, H] (both used as bf16, as moe_backward's tensor-core router GEMMs use them), the
    fp32 logits [T, E] (recomputed before the launch by bf16_mm_fp32(x, router_weight.t())), the decision experts
    [T, k], and the routing's differentiable part: ``routing`` ("softmax" or "sigmoid-grouped": the bias and the
    groups only chose the experts, they get no gradient), ``renormalize``, ``routed_scaling``."""
    x: torch.Tensor
    router_weight: torch.Tensor
    logits: torch.Tensor
    experts: torch.Tensor
    routing: str = "softmax"
    renormalize: bool = True
    routed_scaling: float = 1.0


def _router_tiles():
    """The router stages' tiles: (tokens per ROUTER_DL task, (BM, BN, BK) of dx_r, (BI, BJ, BR) of dWr, stages)."""
    if planning.interpreting():
        return 4, (16, 16, 16), (16, 16, 16), 1
    if BWD_ROUTER_DX_TILES[3] != BWD_ROUTER_DW_TILES[3]:
        raise ValueError(f"the router's dx and dWr tiles need one stage count: {BWD_ROUTER_DX_TILES}, "
                         f"{BWD_ROUTER_DW_TILES}")
    return BWD_ROUTER_TOKENS, BWD_ROUTER_DX_TILES[:3], BWD_ROUTER_DW_TILES[:3], BWD_ROUTER_DX_TILES[3]


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t bf16, contiguous and 16-byte aligned (a copy only where it is not)."""
    t = t.to(torch.bfloat16).contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _no_ep_args(stand_in: torch.Tensor) -> tuple:
    """The kernel's W > 1 arguments at W = 1 (unused there: typed stand-ins and zeros; fixed_comm last)."""
    return (stand_in,) * 16 + (0,) * 7 + (stand_in,) * 2 + (0, 0, 0)


def expert_backward_one_launch(dy_rows, do_rows, x_rows, gu, w_pair, valid, w13, w2, counts, pad_offs, inv,
                               n_tok: int, top_k: int, out_dtype: torch.dtype = torch.bfloat16, *,
                               programs: int | None = None, stages: int = BWD_ALL_STAGES, timeout_ns=None,
                               trace: torch.Tensor | None = None, router: RouterBackward | None = None):
    """moe_backward's expert part at W = 1 in ONE launch (_moe_backward_experts_kernel) on rows in the padded
    layout: dy_rows, do_rows (= w * dy_rows), x_rows [R_pad, H], gu [R_pad, 2F] bf16, w_pair [R_pad] fp32, valid
    [R_pad] bool (padded_layout's real_of >= 0; gap rows zero in dy_rows, do_rows, x_rows, gu, w_pair), w13
    [E, H, 2F], w2 [E, F, H] bf16, counts [E], pad_offs [E] (padded_row_offsets), inv [T*k] (each pair's padded
    row, _pair_rows). Returns (dx_e [T, H] fp32: the dispatch backward's rows summed in slot order, dw_rows
    [R_pad] fp32: the gate gradients <dy_t, o_p> of the rows -- gap rows unspecified --, dw13, dw2 in
    ``out_dtype``), bitwise what the multi-launch path computes (the same tile functions, tiles and orders).
    ``programs``: the grid (None: one per SM; the interpreter: BWD_INTERP_PROGRAMS). ``stages`` and ``timeout_ns``
    (None: the workspace's) for tests. ``trace`` (int64 [grid, codes.TRACE_EVENTS, 4], zeroed): each program's
    tasks and waits as (kind, task, t0, t1) events (runtime.TRACE_KINDS), for the timeline. On CUDA a timed-out
    wait raises KosmosTimeoutError at the next KOSMOS call or kosmos.check_errors() (the workspace's error record);
    on the CPU right away. CUDA, or the CPU under TRITON_INTERPRET=1.

    ``router`` (a RouterBackward): the router backward in the launch too (the stages ROUTER_DL, ROUTER_DW,
    ROUTER_DX; the module docstring's "The router backward in the launch"), and the return value is then (dx [T, H]
    bf16 = bf16(dx_e + dl Wr) -- moe_backward's dx --, dw_rows, dw13, dw2, d_router [E, H] fp32 = dl^T x)."""
    from .. import runtime
    r_pad, h = dy_rows.shape
    n_exp, f, _ = w2.shape
    (bm, bn, bk, gemm_stages), (sw_br, sw_bf), w2t, w1t, (ut, ubh), warps = _bwd_tiles(out_dtype, h, f)
    rut, (rx_bm, rx_bn, rx_bk), (rw_bi, rw_bj, rw_br), r_stages = _router_tiles()
    dev_ = dy_rows.device
    if router is not None:
        if router.routing not in ("softmax", "sigmoid-grouped"):
            raise ValueError(f"unknown routing {router.routing!r}; choose from softmax, sigmoid-grouped")
        n_r = router.router_weight.shape[0]
        if router.x.shape != (n_tok, h) or router.router_weight.shape != (n_r, h) or \
                router.logits.shape != (n_tok, n_r) or router.experts.shape != (n_tok, top_k):
            raise ValueError(f"router tensors disagree with T={n_tok}, H={h}, k={top_k}: x {tuple(router.x.shape)}, "
                             f"router_weight {tuple(router.router_weight.shape)}, logits "
                             f"{tuple(router.logits.shape)}, experts {tuple(router.experts.shape)}")
        if rx_bm % ut:
            raise ValueError(f"the router's dx m-tile {rx_bm} must be a multiple of the UNPERMUTE block {ut}")
        ep = -(-n_r // 8) * 8  # dl's hi | lo halves: each row 2 * EP bf16 (16-byte aligned halves for TMA)
        r_x, r_wr = _tma_ready(router.x), _tma_ready(router.router_weight)
        r_logits = router.logits.float().contiguous()
        r_experts = router.experts.to(torch.int32).contiguous()
        dlhl = torch.empty((max(n_tok, 1), 2 * ep), dtype=torch.bfloat16, device=dev_)
        dx = torch.empty((n_tok, h), dtype=torch.bfloat16, device=dev_)
        d_router = torch.empty((n_r, h), dtype=torch.float32, device=dev_)
        if n_tok == 0:  # no token: dWr = 0 (an empty sum), nothing else to compute (no zero-row descriptor)
            d_router.zero_()
            stages &= ~((1 << BWD_ROUTER_DL) | (1 << BWD_ROUTER_DW) | (1 << BWD_ROUTER_DX))
        n_tb = -(-n_tok // rx_bm)
    if WGRAD_PAD_ROWS % w2t[2] or bm % w2t[2]:
        raise ValueError(f"the wgrad row step {w2t[2]} must divide the pad {WGRAD_PAD_ROWS} and the m-tile {bm}")
    counts32, offs, first_mtile, elp2, max_mt = _mtile_plan(counts, r_pad, bm, pad_offs)
    bf = dict(dtype=torch.bfloat16, device=dev_)
    z, dgu, hb, dx_rows = (torch.empty((r_pad, n), **bf) for n in (f, 2 * f, f, h))
    dw_rows = torch.empty((r_pad,), dtype=torch.float32, device=dev_)
    dw13 = torch.empty((n_exp, h, 2 * f), dtype=out_dtype, device=dev_)
    dw2 = torch.empty((n_exp, f, h), dtype=out_dtype, device=dev_)
    dx_e = torch.empty((n_tok, h), dtype=torch.float32, device=dev_)
    scratch_n = int(SCB_MTILES.value) + 2 * max_mt + (n_tb if router is not None else 0)
    ws = runtime.get_workspace(None, dev_) if dev_.type == "cuda" else None
    errors = runtime.one_rank_errors(ws, dev_)  # (at W = 1 no peer: the workspace is a plain 1 MiB buffer)
    if dev_.type == "cuda":
        scratch = ws.local("moe_bwd.scratch", scratch_n, torch.int32)
        epoch_slot = ws.local("moe_bwd.epoch", 1, torch.int32)  # its own: nothing else keeps step with it
        grid = programs or runtime.num_sms(dev_)
        timeout_ns = ws.timeout_ns() if timeout_ns is None else timeout_ns
    else:  # the interpreter (or dev/kernel_resources' compile-only run): fresh buffers
        scratch = torch.zeros(scratch_n, dtype=torch.int32)
        epoch_slot = torch.zeros(1, dtype=torch.int32)
        grid = programs or (BWD_INTERP_PROGRAMS if planning.interpreting() else 132)
        if timeout_ns is None:  # the interpreter runs programs one after another: a correct launch never spins
            timeout_ns = BWD_INTERP_TIMEOUT_NS if planning.interpreting() else int(runtime.DEFAULT_TIMEOUT_S * 1e9)
    if trace is not None and (trace.dtype != torch.int64 or tuple(trace.shape) != (grid, TRACE_EVENTS.value, 4)
                              or trace.device != dev_):
        raise ValueError(f"trace must be an int64 [{grid}, {TRACE_EVENTS.value}, 4] tensor on {dev_}, got "
                         f"{trace.dtype} {tuple(trace.shape)} on {trace.device}")
    runtime.ensure_triton_allocator()
    aligned = lambda k, w: k % 8 == 0 and w.is_contiguous() and w.data_ptr() % 16 == 0  # noqa: E731 (expert_dgrad1's)
    _moe_backward_experts_kernel[(grid,)](
        dy_rows, do_rows, x_rows, gu.contiguous(), w_pair.float().contiguous(), valid.contiguous().view(torch.uint8),
        w13, w2, offs, counts32, first_mtile, inv,
        z, dgu, hb, dw_rows, dx_rows, dw13, dw2, dx_e,
        *((r_x, r_wr, r_logits, r_experts, dlhl, dx, d_router, n_r, ep, float(router.routed_scaling))
          if router is not None else (errors,) * 7 + (0, 0, 1.0)),
        scratch, scratch_n, max_mt, errors, epoch_slot, max(1, timeout_ns // 1000), stages,
        errors if trace is None else trace, n_tok, h, f, n_exp, r_pad, *_no_ep_args(errors),
        TOPK=top_k, ELP2=elp2, PAD=WGRAD_PAD_ROWS, BM=bm, BN=bn, BK=bk, GEMM_STAGES=gemm_stages,
        TMA2=aligned(h, w2) and dy_rows.data_ptr() % 16 == 0, TMA1=aligned(2 * f, w13) and dgu.data_ptr() % 16 == 0,
        SW_BR=sw_br, SW_BF=sw_bf, W2_BI=w2t[0], W2_BJ=w2t[1], W1_BI=w1t[0], W1_BJ=w1t[1], W_BR=w2t[2],
        W2_STAGES=w2t[3], W1_STAGES=w1t[3], UT=ut, UBH=ubh, GRID=grid, DOT_FP32=planning.interpreting(),
        SWIGLU_ON_COMPLETION=BWD_SWIGLU_ON_COMPLETION, TRACE=trace is not None, WGRAD1_SYNC=BWD_WGRAD1_SYNC,
        WGRAD_DYNAMIC=BWD_WGRAD_DYNAMIC, WGRAD_DYNAMIC_16THS=BWD_WGRAD_DYNAMIC_16THS, LEAN_DGRAD1=BWD_DGRAD1_LEAN,
        SW_STAGES=BWD_SWIGLU_STAGES,
        **(dict(ROUTER=True, SOFTMAX=router.routing == "softmax", RENORM=bool(router.renormalize),
                ERP2=triton.next_power_of_2(n_r), RUT=rut, RX_BM=rx_bm,
                RX_BN=rx_bn, RX_BK=rx_bk, RW_BI=rw_bi, RW_BJ=rw_bj, RW_BR=rw_br, R_STAGES=r_stages)
           if router is not None else {}),
        num_warps=warps, num_stages=gemm_stages)
    runtime.after_one_rank_launch(ws, dev_, errors)
    if router is not None:
        return dx, dw_rows, dw13, dw2, d_router
    return dx_e, dw_rows, dw13, dw2


class EPLayout:
    """The one launch at W > 1: byte offsets of its regions in a rank's symmetric data buffer (every rank the same
    T, H, F, E, k: the forward's contract) and the host-known bounds of its local buffers (the worst case: every
    token of every rank to this rank's experts, as moe_forward.Layout)."""

    def __init__(self, world: int, tokens: int, hidden: int, ffn: int, top_k: int, local_experts: int, bm: int,
                 ut: int):
        def up(v):
            return (v + 255) // 256 * 256
        wt = world * tokens
        self.off_recv_x = 0                                         # [W*T, H] bf16: source s's token t at s*T + t
        self.off_recv_dy = up(wt * hidden * 2)                      # [W*T, H] bf16
        self.off_meta = up(self.off_recv_dy + wt * hidden * 2)      # [W*T, 2k] int32: (local expert or -1, place)
        self.off_w = up(self.off_meta + wt * 2 * top_k * 4)         # [W*T, k] fp32: the gate weights
        self.off_cnt = up(self.off_w + wt * top_k * 4)              # [W, E/W] int32: pairs per (source, expert)
        self.off_comb_x = up(self.off_cnt + world * local_experts * 4)  # [T*k, H] bf16: the pairs' dx rows back
        self.off_comb_dw = up(self.off_comb_x + tokens * top_k * hidden * 2)  # [T*k] fp32: their gate gradients
        self.data_bytes = up(self.off_comb_dw + tokens * top_k * 4)
        self.max_rows = wt * min(top_k, local_experts)
        self.r_pad = padded_rows_bound(self.max_rows, local_experts)
        self.max_mtiles = -(-self.max_rows // bm) + local_experts
        self.fold_blocks = -(-tokens // ut)                         # the symmetric counters: one per UNPERMUTE block

    def regions(self, data: torch.Tensor, world: int, tokens: int, hidden: int, top_k: int, local_experts: int):
        """(recv_x, recv_dy, meta, w, cnt, comb_x, comb_dw) views of a rank's symmetric data buffer (uint8)."""
        wt = world * tokens
        def view(off, n, dtype):
            return data[off:off + n * torch.tensor([], dtype=dtype).element_size()].view(dtype)
        return (view(self.off_recv_x, wt * hidden, torch.bfloat16), view(self.off_recv_dy, wt * hidden, torch.bfloat16),
                view(self.off_meta, wt * 2 * top_k, torch.int32), view(self.off_w, wt * top_k, torch.float32),
                view(self.off_cnt, world * local_experts, torch.int32),
                view(self.off_comb_x, tokens * top_k * hidden, torch.bfloat16),
                view(self.off_comb_dw, tokens * top_k, torch.float32))


def ep_tiles():
    """(tokens per COMBINE / PERMUTE block, their column step) of the one launch at W > 1."""
    return (4, 16) if planning.interpreting() else (BWD_EP_TOKENS, BWD_EP_COLS)


def ep_layout(world: int, tokens: int, hidden: int, ffn: int, top_k: int, local_experts: int,
              out_dtype: torch.dtype = torch.bfloat16) -> EPLayout:
    """The EPLayout of a call (the launch's m-tile and UNPERMUTE block)."""
    (bm, *_), _, _, _, (ut, _), _ = _bwd_tiles(out_dtype, hidden, ffn)
    return EPLayout(world, tokens, hidden, ffn, top_k, local_experts, bm, ut)


def ep_local_buffers(alloc, lay: EPLayout, hidden: int, ffn: int, top_k: int, tokens: int, local_experts: int,
                     world: int) -> dict:
    """The one launch's local buffers at W > 1 from ``alloc(name, numel, dtype)`` (a workspace's ``local``, or the
    tests' allocator): the expert rows in the padded layout (worst case R_pad rows), their metadata, the plan,
    the intermediates, the scratch; none needs clearing between calls (the launch writes what it reads)."""
    r = lay.r_pad
    elp2 = triton.next_power_of_2(max(local_experts, 1))
    b = dict(dy_rows=(r, hidden), do_rows=(r, hidden), x_rows=(r, hidden), gu=(r, 2 * ffn), z=(r, ffn),
             dgu=(r, 2 * ffn), h=(r, ffn), dx_rows=(r, hidden))
    out = {k: alloc(f"moe_bwd.ep.{k}", s[0] * s[1], torch.bfloat16)[:s[0] * s[1]].view(s) for k, s in b.items()}
    out.update(w_pair=alloc("moe_bwd.ep.w_pair", r, torch.float32)[:r],
               dw_rows=alloc("moe_bwd.ep.dw_rows", r, torch.float32)[:r],
               valid=alloc("moe_bwd.ep.valid", r, torch.uint8)[:r],
               row_meta=alloc("moe_bwd.ep.row_meta", 2 * r, torch.int32)[:2 * r],
               counts=alloc("moe_bwd.ep.counts", local_experts, torch.int32)[:local_experts],
               pad_offs=alloc("moe_bwd.ep.pad_offs", local_experts, torch.int32)[:local_experts],
               first_mtile=alloc("moe_bwd.ep.first_mtile", elp2, torch.int32)[:elp2],
               base=alloc("moe_bwd.ep.base", world * local_experts, torch.int32)[:world * local_experts],
               iota=alloc("moe_bwd.ep.iota", tokens * top_k, torch.int32)[:tokens * top_k])
    return out


def ep_pair_places(experts: torch.Tensor, n_exp: int):
    """(place [T*k] int32, per-expert pairs [E] int32) of this rank's pairs p = t*k + j: p's place among this rank's
    pairs of its expert in token order (the stable expert sort's rank inside the expert: the multi-launch path's
    order) -- computed at the source, sent with the rows, so the holder places every row without atomics. Device
    ops only: no host synchronisation."""
    flat = experts.reshape(-1).long()
    per = expert_counts(flat, n_exp)
    order = torch.sort(flat, stable=True).indices
    place = torch.empty_like(flat)
    place[order] = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(per, 0) - per)[flat[order]]
    return place.to(torch.int32), per.to(torch.int32)


def expert_backward_ep_launch(x, dy, weights, experts, w13, w2, bufs: dict, *, rank: int, world: int, epoch_slot,
                              timeout_ns: int, grid: int, out_dtype: torch.dtype = torch.bfloat16,
                              router: RouterBackward | None = None, stages: int = BWD_ALL_STAGES, final: bool = True,
                              outs: dict | None = None, trace: torch.Tensor | None = None, policy: str = "self",
                              comm_programs: int | None = None):
    """moe_backward's expert part at W > 1 in ONE launch with its exchanges (module docstring, "The one launch at
    W > 1") on explicit buffers: x, dy [T, H] bf16 (this rank's tokens), weights [T, k] fp32 and experts [T, k]
    (global ids) of the forward's decision, w13 [E/W, H, 2F] / w2 [E/W, F, H] this rank's experts. ``bufs``:
    ``layout`` (EPLayout), ``data`` (this rank's symmetric bytes), ``sig`` / ``ctr`` (its signals, counters),
    ``peer_data`` / ``peer_sig`` / ``peer_ctr`` (int64 address tables), ``errors``, ``scratch`` (int32, zeroed
    once), and ep_local_buffers' entries. ``epoch_slot``: the rank's device epoch (the workspace's: shared with
    every op on it, as the done flags are). ``stages`` / ``final``: the CPU tests' phases (EP_PHASES; only the
    launch with ``final`` ends the call) and a stage left out; ``outs``: the outputs of an earlier phase launch
    of the same call (returned by this one). Returns (dx_e [T, H] fp32 -- or, with ``router``, dx [T, H] bf16 --,
    dweights [T, k] fp32 (the pairs' gate gradients, a copy), dw13, dw2 in ``out_dtype``[, d_router [E, H] fp32])
    and the outs dict as the last element. ``policy="fixed"`` with ``comm_programs=S`` (1 <= S < grid): the
    fixed-role ablation -- programs pid < S run only the communication stages (BWD_COMM_STAGES), the others only
    the rest ("The one launch at W > 1": the fixed policy); the same arithmetic and row order, so the same bits as
    the self policy. On the CPU its phases are EP_PHASES_FIXED (DISPATCH-BWD alone), not EP_PHASES."""
    from .. import runtime
    pol, fixed_comm = policy_args(policy, comm_programs, grid)  # 1 <= S < grid: both roles need a program
    if policy == "fixed" and world < 2:
        raise ValueError("policy='fixed': no communication at world size 1 (the fixed-role split needs W > 1)")
    lay: EPLayout = bufs["layout"]
    n_tok, h = x.shape
    k = experts.shape[1]
    el, f, _ = w2.shape
    dev_ = x.device
    (bm, bn, bk, gemm_stages), (sw_br, sw_bf), w2t, w1t, (ut, ubh), warps = _bwd_tiles(out_dtype, h, f)
    rut, (rx_bm, rx_bn, rx_bk), (rw_bi, rw_bj, rw_br), r_stages = _router_tiles()
    xb, xbh = ep_tiles()
    if n_tok == 0:
        raise ValueError("the one launch at W > 1 needs T >= 1 tokens per rank (its COMBINE-BWD publishes the counts)")
    if lay.fold_blocks != -(-n_tok // ut) or lay.max_rows != world * n_tok * min(k, el):
        raise ValueError(f"bufs['layout'] was made for another shape than T={n_tok}, k={k}, E/W={el}, W={world}")
    if router is not None and rx_bm % ut or rx_bm % rut:
        raise ValueError(f"the router's dx m-tile {rx_bm} must be a multiple of the UNPERMUTE block {ut} and the "
                         f"dlogits block {rut}")
    recv_x, recv_dy, meta, wts, cnt, comb_x, comb_dw = lay.regions(bufs["data"], world, n_tok, h, k, el)
    exp32 = experts.to(torch.int32).contiguous()
    x_b = _tma_ready(x)
    if outs is None:  # this call's first launch: the pairs' places, the outputs
        place, per = ep_pair_places(experts, el * world)
        outs = dict(place=place, per=per, dw13=torch.empty((el, h, 2 * f), dtype=out_dtype, device=dev_),
                    dw2=torch.empty((el, f, h), dtype=out_dtype, device=dev_),
                    dx_e=torch.empty((n_tok, h), dtype=torch.float32, device=dev_))
        bufs["iota"].copy_(torch.arange(n_tok * k, dtype=torch.int32, device=dev_))
        if router is not None:
            n_r = router.router_weight.shape[0]
            ep = -(-n_r // 8) * 8
            outs.update(dlhl=torch.empty((n_tok, 2 * ep), dtype=torch.bfloat16, device=dev_),
                        dx=torch.empty((n_tok, h), dtype=torch.bfloat16, device=dev_),
                        d_router=torch.empty((n_r, h), dtype=torch.float32, device=dev_))
    if router is not None:
        if router.routing not in ("softmax", "sigmoid-grouped"):
            raise ValueError(f"unknown routing {router.routing!r}; choose from softmax, sigmoid-grouped")
        n_r = router.router_weight.shape[0]
        ep = -(-n_r // 8) * 8
        r_args = (x_b, _tma_ready(router.router_weight), router.logits.float().contiguous(), exp32, outs["dlhl"],
                  outs["dx"], outs["d_router"], n_r, ep, float(router.routed_scaling))
        n_tb = -(-n_tok // rx_bm)
    else:
        r_args = (x_b, bufs["errors"], bufs["errors"], exp32, bufs["errors"], bufs["errors"], bufs["errors"], 0, 0,
                  1.0)
        n_tb = 0
    xs_base = int(SCB_MTILES.value) + 2 * lay.max_mtiles + n_tb
    scratch_n = xs_base + 6 + el + 2 * lay.max_mtiles
    if bufs["scratch"].numel() < scratch_n:
        raise ValueError(f"bufs['scratch'] holds {bufs['scratch'].numel()} int32, the launch needs {scratch_n}")
    if trace is not None and (trace.dtype != torch.int64 or tuple(trace.shape) != (grid, TRACE_EVENTS.value, 4)):
        raise ValueError(f"trace must be an int64 [{grid}, {TRACE_EVENTS.value}, 4] tensor")
    b = bufs
    aligned = lambda kk, w: kk % 8 == 0 and w.is_contiguous() and w.data_ptr() % 16 == 0  # noqa: E731
    runtime.ensure_triton_allocator()
    _moe_backward_experts_kernel[(grid,)](
        b["dy_rows"], b["do_rows"], b["x_rows"], b["gu"], b["w_pair"], b["valid"], w13, w2,
        b["pad_offs"], b["counts"], b["first_mtile"], b["iota"],
        b["z"], b["dgu"], b["h"], b["dw_rows"], b["dx_rows"], outs["dw13"], outs["dw2"], outs["dx_e"],
        *r_args, b["scratch"], scratch_n, lay.max_mtiles, b["errors"], epoch_slot, max(1, timeout_ns // 1000), stages,
        b["errors"] if trace is None else trace, n_tok, h, f, el, lay.r_pad,
        dy.to(torch.bfloat16).contiguous(), weights.float().contiguous(), outs["place"], outs["per"], recv_x, recv_dy,
        meta, wts, cnt, comb_x, comb_dw, b["peer_data"], b["peer_sig"], b["peer_ctr"], b["sig"], b["ctr"],
        lay.off_recv_x, lay.off_recv_dy, lay.off_meta, lay.off_w, lay.off_cnt, lay.off_comb_x, lay.off_comb_dw,
        b["row_meta"], b["base"], xs_base, rank, fixed_comm,
        TOPK=k, ELP2=triton.next_power_of_2(max(el, 1)), PAD=WGRAD_PAD_ROWS, BM=bm, BN=bn, BK=bk,
        GEMM_STAGES=gemm_stages, TMA2=aligned(h, w2), TMA1=aligned(2 * f, w13), SW_BR=sw_br, SW_BF=sw_bf,
        W2_BI=w2t[0], W2_BJ=w2t[1], W1_BI=w1t[0], W1_BJ=w1t[1], W_BR=w2t[2], W2_STAGES=w2t[3], W1_STAGES=w1t[3],
        UT=ut, UBH=ubh, GRID=grid, SWIGLU_ON_COMPLETION=BWD_SWIGLU_ON_COMPLETION, WGRAD1_SYNC=BWD_WGRAD1_SYNC,
        WGRAD_DYNAMIC=BWD_WGRAD_DYNAMIC, WGRAD_DYNAMIC_16THS=BWD_WGRAD_DYNAMIC_16THS, DOT_FP32=planning.interpreting(),
        TRACE=trace is not None,
        **(dict(ROUTER=True, SOFTMAX=router.routing == "softmax", RENORM=bool(router.renormalize),
                ERP2=triton.next_power_of_2(router.router_weight.shape[0]), RUT=rut, RX_BM=rx_bm, RX_BN=rx_bn,
                RX_BK=rx_bk, RW_BI=rw_bi, RW_BJ=rw_bj, RW_BR=rw_br, R_STAGES=r_stages) if router is not None else {}),
        WORLD=world, WP2=triton.next_power_of_2(world), KP2=triton.next_power_of_2(k), XB=xb, XBH=xbh,
        TMA_GU=aligned(h, w13) and 2 * f % 8 == 0, FINAL=final, FLAG_BASE=runtime.FLAG_BASE,
        DONE_BASE=runtime.DONE_BASE, POLICY=pol, num_warps=warps, num_stages=gemm_stages)
    dweights = comb_dw.view(n_tok, k).clone()  # the workspace's rows: the next call overwrites them
    first = outs["dx"] if router is not None else outs["dx_e"]
    res = (first, dweights, outs["dw13"], outs["dw2"]) + ((outs["d_router"],) if router is not None else ())
    return res + (outs,)


# moe_backward's expert rows in the padded layout (padded_layout) by default, for the flat wgrad loop (session 13,
# one H200, dev/moe_bwd_tiles, results/h200x1/s13/a: deepseek-v3 4k wgrad2 3.74 -> 2.97 ms, qwen3 4k wgrad2 1.23
# -> 0.92, wgrad1 2.16 -> 1.82); False: the rows packed, the persistent wgrad kernel
def expert_backward_gemms(dy_rows, do_rows, x_rows, gu, w_pair, w13, w2, counts, wgrad_dtype, *, pad_offs=None,
                          valid=None):
    """The backward's expert part on rows already grouped by local expert (the multi-launch path of
    ``moe_backward``; ``kosmos bench moe --direction bwd`` times it alone as kosmos-expert-gemms): dy_rows [R, H]
    (each row its token's output gradient), do_rows = w_pair * dy_rows, x_rows [R, H], gu [R, 2F] (GEMM1's
    g | u), w_pair [R] fp32 (the rows' gate weights) ->
      dgrad2 + SwiGLU backward + gate gradient (expert_dgrad2_swiglu, h = silu(g) u from its epilogue too, or
      swiglu_h: dgrad2_emits_h()), dW2 = h^T do and dW13 = x_rows^T [dg | du] (expert_weight_grads), dx_rows =
      [dg | du] W13^T (expert_dgrad1),
    returned as (dx_rows [R, H], dw_rows [R] fp32 -- the gate weights' gradients --, dw13, dw2 in
    ``wgrad_dtype``). ``pad_offs`` (padded_layout's): the rows in the padded layout (gap rows zero, ``valid``
    False there), both weight gradients on the flat loop (expert_weight_grads_padded); None: packed rows."""
    f, hidden = w2.shape[1], w2.shape[2]
    padded = pad_offs is not None
    if dgrad2_emits_h() or padded:  # h = silu(g) u from dgrad2's epilogue (bitwise swiglu_h's)
        dgu, dw_rows, h = expert_dgrad2_swiglu(dy_rows, gu, w2, w_pair, counts, emit_h=True,
                                               fused=False if padded else None, offs=pad_offs, valid=valid)
    else:
        dgu, dw_rows = expert_dgrad2_swiglu(dy_rows, gu, w2, w_pair, counts)
        h = swiglu_h(gu, f)
    if padded:  # do (gathered with dy_rows; gap rows zero) and both weight gradients on the flat loop
        dw2 = expert_weight_grads_padded(h, do_rows, counts, pad_offs, out_dtype=wgrad_dtype,
                                         tiles=wgrad_flat_tiles(wgrad_dtype, f, hidden))
        dw13 = expert_weight_grads_padded(x_rows, dgu, counts, pad_offs, out_dtype=wgrad_dtype,
                                          tiles=wgrad_flat_tiles(wgrad_dtype, hidden, 2 * f))
        dx_rows = expert_dgrad1(dgu, w13, counts, offs=pad_offs)
    else:
        dw2 = expert_weight_grads(h, do_rows, counts, out_dtype=wgrad_dtype, tiles=wgrad2_tiles(h, counts))
        dw13 = expert_weight_grads(x_rows, dgu, counts, out_dtype=wgrad_dtype)
        dx_rows = expert_dgrad1(dgu, w13, counts)
    return dx_rows, dw_rows, dw13, dw2


def expert_backward_operands(x_sorted, dy_sorted, w_sorted, w13, counts, *, padded: bool | None = None) -> dict:
    """``expert_backward_gemms``'s operands (a dict of its arguments but the weights and the wgrad dtype, plus
    ``row_of``) from rows already sorted by local expert and packed -- x_sorted, dy_sorted [R, H] bf16, w_sorted
    [R] fp32, counts [E_local] -- in the layout ``moe_backward`` puts them in (padded: PADDED_ROWS where it
    applies, as there); gu = GEMM1 of x (bf16, torch._grouped_mm: what the forward saves). ``row_of`` [R]: the
    row of the layout that packed row i is (None: packed). For timing the expert part alone (the bench)."""
    rows, hidden = x_sorted.shape
    f = w13.shape[2] // 2
    if padded is None:
        padded = PADDED_ROWS
    padded = padded and _triton_runs(x_sorted) and hidden % 8 == 0 and f % 8 == 0
    w_sorted = w_sorted.float()
    if not padded:
        return dict(dy_rows=dy_sorted, do_rows=(dy_sorted.float() * w_sorted[:, None]).to(dy_sorted.dtype),
                    x_rows=x_sorted, gu=_expert_gemm1(x_sorted, w13, counts), w_pair=w_sorted, counts=counts,
                    pad_offs=None, valid=None, row_of=None)
    pad_offs, row_of, real_of, end = padded_layout(counts, rows)
    valid, real = real_of >= 0, real_of.clamp(min=0)
    idx = torch.where(valid, real, -1) if rows else torch.full_like(real_of, -1)
    w_pair = torch.where(valid, w_sorted[real], 0.0) if rows else torch.zeros(real_of.shape, device=x_sorted.device)
    x_rows = gather_rows(x_sorted, idx, end)
    dy_rows, do_rows = gather_rows_and_scaled(dy_sorted, idx, w_pair, end)
    return dict(dy_rows=dy_rows, do_rows=do_rows, x_rows=x_rows, gu=_expert_gemm1(x_rows, w13, counts, pad_offs),
                w_pair=w_pair, counts=counts, pad_offs=pad_offs, valid=valid, row_of=row_of)


PADDED_ROWS = True
# moe_backward's default for one_launch where it is supported at W = 1 (the padded layout; W > 1: ONE_LAUNCH_EP
# below): True since session 21 -- dw13 / dw2 bitwise the multi-launch
# path, dx / d_router fp32-level (the router in the launch), and faster once DGRAD1 lost its per-task
# synchronisation and the SWIGLU pass was pipelined (s21b, deepseek-v3 zipf:1.2: 8k 0.988x, 4k 0.991x the
# multi-launch time; s21c: the other points; the module docstring's "Session 21"). False: the multi-launch path.
ONE_LAUNCH = True
# the same at W > 1 (the one launch with its exchanges as stages, on CUDA where g | u was not saved: the forward
# cannot save it at W > 1, kosmos.nn.MoE does not): True since session 22. Neither path has run on two GPUs: one
# GPU cannot time a W > 1 exchange, so this is the design's choice (the exchanges hidden under the GEMM tiles, as
# the forward's 1.61x at EP = 2), not a measured one; at W = 1 the launch ties the multi-launch path (0.988-1.004x).
# Correctness on the GPU: simulated ranks W = 2, 4 and two ranks on one GPU (s19b / s19c, s22). False: the
# multi-launch path (all-to-alls between the W = 1 kernels).
ONE_LAUNCH_EP = True


def moe_backward(x, router_weight, w13, w2, dy, weights, experts, *, group=None, routing: str = "softmax",
                 renormalize: bool = True, routed_scaling: float = 1.0, wgrad_dtype=None, saved_gu=None,
                 padded: bool | None = None, one_launch: bool | None = None, programs: int | None = None,
                 router_in_launch: bool | None = None, policy: str = "self", comm_programs: int | None = None):
    """Gradients of the MoE layer over the EP ``group`` (None or one rank: all E experts local) for this rank's
    output gradient dy [T, H], given the forward's routing decision for this rank's tokens (``weights`` [T, k]
    fp32 and ``experts`` [T, k], global expert ids, e.g. ``moe_forward(..., return_routing=True)``), with
    w13 [E/W, H, 2F] / w2 [E/W, F, H] this rank's experts: (dx [T, H] bf16, d_router_weight [E, H] fp32 -- this
    rank's tokens' part, to be all-reduced like any replicated parameter's gradient --, dw13 [E/W, H, 2F] and
    dw2 [E/W, F, H] in the parameters' dtype (bf16: fp32 accumulation, rounded once; ``wgrad_dtype=torch.float32``
    for the fp32 accumulators), from every rank's tokens) -- moe_reference.moe_backward_ref's stages, with the three
    expert GEMM shapes on this module's kernels and the rest in torch:

      pairs sorted by expert (stable: ascending p = t*k + j inside an expert), hence by destination rank;
      W > 1: the expert rows x_rows, dy_rows and the pairs' gate weights to the experts' ranks
      (dist.all_to_all_single, split sizes read on the host: one sync), regrouped by local expert (stable:
      source rank, then pair order); at W = 1 nothing synchronises with the host (counts by expert_counts,
      not torch.bincount; test_moe_backward_w1_never_syncs_gpu, written in session 11, not yet run);
      [g | u]: the forward's (``saved_gu``, a moe_forward.SavedGateUp from ``moe_forward(..., save_gu=True)``,
      gathered into this order) or recomputed (GEMM1 again, torch._grouped_mm);
      dgrad2 + SwiGLU backward + gate gradient (expert_dgrad2_swiglu; h = silu(g) u from its epilogue too,
      or swiglu_h: dgrad2_emits_h()); dW2 = h^T (w dy) and
      dW13 = x_rows^T [dg | du] (expert_weight_grads); dx_rows = [dg | du] W13^T (expert_dgrad1);
      W > 1: dx_rows and the gate gradients back to the tokens' ranks;
      dispatch backward (slot order), router backward in fp32 (logits recomputed), dx = dx_experts + dx_router.

    The stages above are the multi-launch path: several launches and, at W > 1, NCCL (or gloo) all-to-alls
    between them -- the one launch's correctness twin, and what runs where the one launch does not (the CPU,
    saved g | u at W > 1, one_launch=False). Deterministic (no atomics anywhere; stable sorts; fixed summation orders;
    the all-to-alls only move rows).

    ``padded`` (None: PADDED_ROWS; only where Triton runs and H, F are multiples of 8): the expert rows (x_rows,
    dy_rows, g | u, do, h, [dg | du], dx_rows) in the padded layout -- each expert's rows from a multiple of
    WGRAD_PAD_ROWS, the gap rows zero, written so by the row gathers themselves -- and both weight gradients
    by the flat wgrad loop (expert_weight_grads_padded). Every row's arithmetic is the packed layout's and the
    gap rows add exact zeros: the same bits (tested).

    ``one_launch`` (None: ONE_LAUNCH at W = 1 on the padded layout, ONE_LAUNCH_EP at W > 1 on CUDA without
    ``saved_gu``; elsewhere the multi-launch path): the expert part -- dgrad2, the SwiGLU backward,
    dgrad1, both weight gradients and the dispatch backward -- in ONE persistent launch
    (expert_backward_one_launch; the module docstring's "The one launch"), at W = 1 on the padded layout (the same
    tile arithmetic and orders, so the same bits: tested); at W > 1 on CUDA the whole backward with its exchanges as
    stages of that launch over the group's workspace (expert_backward_ep_launch; "The one launch at W > 1": g | u
    recomputed inside it, ``saved_gu`` refused; not the multi-launch path's bits, its g | u being torch's); elsewhere
    (the packed layout, W > 1 on the CPU) a ValueError. ``programs``:
    its grid (None: one program per SM). ``router_in_launch`` (None: BWD_ROUTER_IN_LAUNCH; with one_launch only):
    the router backward as stages of that launch too (the module docstring's "The router backward in the launch":
    dx and d_router from the launch, fp32-level like the torch ops' -- not their bits); False: the torch ops after
    the launch, bitwise the multi-launch path.

    ``policy="fixed"`` with ``comm_programs=S`` (1 <= S < the grid): the fixed-role ablation of the one launch at
    W > 1 (one_launch=True) -- programs pid < S run only its communication stages (COMBINE-BWD, PERMUTE-BWD,
    DISPATCH-BWD, UNPERMUTE), the others only the rest; the same gradients, bit for bit, as the self policy. Not
    timed yet (one GPU cannot time a W > 1 exchange). A ValueError at W = 1 (no communication) and with the
    multi-launch path (no programs to split)."""
    from ..runtime import world_size
    import torch.distributed as dist
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
    n_tok, hidden = x.shape
    n_exp = router_weight.shape[0]
    local = w13.shape[0]
    world = 1 if local == n_exp else world_size(group)  # every expert here: nothing to exchange
    if local * world != n_exp:
        raise ValueError(f"w13 holds {local} experts per rank: {local} x {world} ranks != {n_exp} router experts")
    if policy == "fixed" and world == 1:
        raise ValueError("moe_backward(policy='fixed'): no communication at world size 1 (the fixed-role split needs "
                         "W > 1)")
    if one_launch is None and world > 1:  # the same decision on every rank (same devices, same saved_gu use)
        one_launch = (ONE_LAUNCH_EP and x.is_cuda and saved_gu is None and padded is not False
                      and hidden % 8 == 0 and w2.shape[1] % 8 == 0)
    if policy == "fixed" and not one_launch:
        raise ValueError("moe_backward(policy='fixed') needs one_launch=True: the fixed-role split is of the one "
                         "launch's programs (the multi-launch path has none)")
    if one_launch and world > 1:  # the exchanges inside the launch (checked before any: every rank the same way)
        return _moe_backward_ep(x, router_weight, w13, w2, dy, weights, experts, group, routing, renormalize,
                                routed_scaling, wgrad_dtype, saved_gu, padded, programs, router_in_launch, policy,
                                comm_programs)
    k = experts.shape[1]
    experts = experts.long()
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices                    # expert-sorted pair i <- pair order[i]
    tok = order // k
    dy_b = dy.to(torch.bfloat16)
    w_pair = weights.reshape(-1).float()[order].contiguous()
    per_expert = expert_counts(flat, n_exp)  # no host sync (torch.bincount syncs on CUDA)
    if world > 1:
        x_rows, dy_rows = x[tok].contiguous(), dy_b[tok].contiguous()
        send = per_expert.view(world, local)                         # [dest rank, local expert]
        recv = torch.empty_like(send)                                # [source rank, local expert]
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # the one host sync
        x_rows, dy_rows, w_pair = (_exchange(t, send_splits, recv_splits, group) for t in (x_rows, dy_rows, w_pair))
        # per source rank, rows sorted by local expert: regroup by local expert (stable: source rank order)
        chunk_expert = torch.arange(local, device=x.device).repeat(world)
        src_expert = torch.repeat_interleave(chunk_expert, recv.reshape(-1).to(x.device), output_size=x_rows.shape[0])
        by_expert = torch.sort(src_expert, stable=True).indices
        src_x, src_dy, src_idx = x_rows, dy_rows, by_expert          # sorted row i = src[src_idx[i]]
        w_pair = w_pair[by_expert].contiguous()
        counts = recv.sum(0)
    else:
        send_splits = recv_splits = by_expert = None
        src_x, src_dy, src_idx = x, dy_b, tok
        counts = per_expert
    rows = src_idx.shape[0]
    f = w2.shape[1]
    if padded is None:
        padded = PADDED_ROWS
    padded = padded and _triton_runs(x) and hidden % 8 == 0 and f % 8 == 0
    if one_launch is None:
        one_launch = ONE_LAUNCH and world == 1 and padded
    if router_in_launch and not one_launch:
        raise ValueError("moe_backward(router_in_launch=True) needs the one launch (one_launch=True, or ONE_LAUNCH "
                         "where it applies): the router backward is a stage of that launch")
    elif one_launch and not padded:
        raise ValueError(f"moe_backward(one_launch=True) needs the padded row layout (padded=False was given, or "
                         f"H={hidden} / F={f} are not multiples of 8, or Triton cannot run on {x.device})")
    if padded:  # every expert row gathered straight into the padded layout (gap rows: index -1, zeros)
        pad_offs, row_of, real_of, end = padded_layout(counts, rows)
        valid, real = real_of >= 0, real_of.clamp(min=0)
        def into_padded(idx):  # a gather index of the sorted rows -> of the padded ones (-1: a zero row)
            return torch.where(valid, idx[real], -1) if rows else torch.full_like(real_of, -1)
        src_idx = into_padded(src_idx)
        w_pair = torch.where(valid, w_pair[real], 0.0) if rows else torch.zeros(real_of.shape, device=x.device)
        x_rows = gather_rows(src_x, src_idx, end)  # rows past ``end``: left unwritten (read by no one)
        dy_rows, do_rows = gather_rows_and_scaled(src_dy, src_idx, w_pair, end)  # do = w * dy: one read of dy
    else:
        pad_offs = row_of = None
        if world == 1:
            x_rows, dy_rows = x[tok].contiguous(), dy_b[tok].contiguous()
        else:
            x_rows, dy_rows = x_rows[by_expert].contiguous(), dy_rows[by_expert].contiguous()
    if saved_gu is not None:
        if saved_gu.gu.shape[1] != w13.shape[2] or saved_gu.world != world or saved_gu.top_k != k:
            raise ValueError(f"saved_gu (rows of width {saved_gu.gu.shape[1]}, world {saved_gu.world}, top_k "
                             f"{saved_gu.top_k}) is not this layer's forward (2F={w13.shape[2]}, world {world}, "
                             f"top_k {k})")
        if padded:
            gu = gather_rows(saved_gu.gu, into_padded(saved_gu.backward_order_index(counts, rows)), end)
        else:
            gu = saved_gu.in_backward_order(counts, rows)
    else:
        gu = _expert_gemm1(x_rows, w13, counts, pad_offs)
    wdt = _wgrad_dtype(w13, wgrad_dtype)
    if one_launch:  # the expert part in one launch (W = 1, padded); the router backward too (router_in_launch)
        in_launch = BWD_ROUTER_IN_LAUNCH if router_in_launch is None else router_in_launch
        router = RouterBackward(x, router_weight, bf16_mm_fp32(x, router_weight.t()), experts, routing,
                                renormalize, routed_scaling) if in_launch else None
        out = expert_backward_one_launch(
            dy_rows, do_rows, x_rows, gu, w_pair, valid, w13, w2, counts, pad_offs, _pair_rows(order, row_of), n_tok,
            k, wdt, programs=programs, router=router)
        if router is not None:
            dx, _, dw13, dw2, d_router = out
            return dx, d_router, dw13, dw2
        dx_e, dw_rows, dw13, dw2 = out
    else:
        if not padded:
            do_rows = do_rows_of(dy, tok, dy_rows, w_pair, world)
        dx_rows, dw_rows, dw13, dw2 = expert_backward_gemms(dy_rows, do_rows, x_rows, gu, w_pair, w13, w2, counts,
                                                            wdt, pad_offs=pad_offs, valid=valid if padded else None)
        if by_expert is not None:  # back to the received order, then to the tokens' ranks
            if row_of is not None:  # out of the padded layout first
                dx_rows, dw_rows, row_of = dx_rows[row_of], dw_rows[row_of], None
            dx_back, dw_back = torch.empty_like(dx_rows), torch.empty_like(dw_rows)
            dx_back[by_expert], dw_back[by_expert] = dx_rows, dw_rows
            dx_rows = _exchange(dx_back, recv_splits, send_splits, group)
            dw_rows = _exchange(dw_back, recv_splits, send_splits, group)
        dx_e = unpermute_sum(dx_rows, order, k, row_of=row_of)          # pair order p = t*k + j; slot order, fp32
    dweights = torch.empty((order.shape[0],), dtype=dw_rows.dtype, device=dw_rows.device)
    dweights[order] = dw_rows if row_of is None else dw_rows[row_of]
    return _router_backward_torch(x, router_weight, experts, dweights.view(n_tok, k), dx_e, routing, renormalize,
                                  routed_scaling) + (dw13, dw2)


def _router_backward_torch(x, router_weight, experts, dweights, dx_e, routing, renormalize, routed_scaling):
    """The router backward in torch after the expert part (logits recomputed, fp32 routing backward, the router
    GEMMs on bf16 tensor cores): (dx = bf16(dx_e + dx_r), d_router)."""
    from .. import moe_reference as mr
    logits = bf16_mm_fp32(x, router_weight.t())
    w_re, full, denom = mr.routing_weights_ref(logits, experts, routing, renormalize=renormalize,
                                               routed_scaling=routed_scaling)
    dq = mr.router_weights_backward_ref(dweights, w_re, denom, routed_scaling=routed_scaling)
    dlogits = mr.router_logits_backward_ref(dq, full, experts, routing)
    d_router, dx_r = router_gemm_backward(dlogits, x, router_weight)
    return (dx_e + dx_r).to(torch.bfloat16), d_router


def _moe_backward_ep(x, router_weight, w13, w2, dy, weights, experts, group, routing, renormalize, routed_scaling,
                     wgrad_dtype, saved_gu, padded, programs, router_in_launch, policy="self", comm_programs=None):
    """moe_backward(one_launch=True) at W > 1: the one launch with its exchanges (expert_backward_ep_launch) on the
    group's workspace -- its symmetric data, signals, counters and peer tables, its epoch slot and done flags
    (shared with the forward and the TP ops, as every op on a workspace shares them), its error record (a timeout
    raises KosmosTimeoutError at the next KOSMOS call or kosmos.check_errors()). No host synchronisation in the
    steady state (the first call of a shape: the forward's cross-rank shape check and the buffers' growth)."""
    from .. import runtime
    from ..moe_reference import ROUTINGS
    from .moe_forward import _check_same_shape_on_every_rank
    n_tok, hidden = x.shape
    f = w2.shape[1]
    if not x.is_cuda:
        raise ValueError(f"moe_backward(one_launch=True) at W > 1 needs CUDA tensors (the symmetric workspace), got "
                         f"{x.device}")
    if saved_gu is not None:
        raise ValueError("moe_backward(one_launch=True) at W > 1 recomputes g | u inside the launch: saved_gu is not "
                         "used there (pass saved_gu=None)")
    if padded is False or hidden % 8 or f % 8:
        raise ValueError(f"moe_backward(one_launch=True) needs the padded row layout (padded=False was given, or "
                         f"H={hidden} / F={f} are not multiples of 8)")
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTINGS)}")
    grid = programs or runtime.num_sms(x.device)
    policy_args(policy, comm_programs, grid)  # a bad split: a ValueError before any collective or launch
    ws = runtime.get_workspace(group, x.device)
    world, rank, el, k = ws.world.size, ws.world.rank, w13.shape[0], experts.shape[1]
    wdt = _wgrad_dtype(w13, wgrad_dtype)
    lay = ep_layout(world, n_tok, hidden, f, k, el, wdt)
    _check_same_shape_on_every_rank(ws, (n_tok, hidden, f, router_weight.shape[0], k, ROUTINGS.index(routing)))
    ws.ensure(lay.data_bytes, world)
    ws.ensure_counters(lay.fold_blocks)
    bufs = ep_local_buffers(ws.local, lay, hidden, f, k, n_tok, el, world)
    n_scratch = int(SCB_MTILES.value) + 4 * lay.max_mtiles + -(-n_tok // _router_tiles()[1][0]) + 6 + el
    bufs.update(layout=lay, data=ws.data, sig=ws.signals, ctr=ws.counters, peer_data=ws.peer_data,
                peer_sig=ws.peer_signals, peer_ctr=ws.peer_counters, errors=ws.errors,
                scratch=ws.local("moe_bwd.ep.scratch", n_scratch, torch.int32))  # zeroed once, then by the launch
    in_launch = BWD_ROUTER_IN_LAUNCH if router_in_launch is None else router_in_launch
    router = RouterBackward(x, router_weight, bf16_mm_fp32(x, router_weight.t()), experts, routing, renormalize,
                            routed_scaling) if in_launch else None
    ws.before_launch()
    got = expert_backward_ep_launch(x, dy, weights, experts, w13, w2, bufs, rank=rank, world=world,
                                    epoch_slot=ws.epoch_slot, timeout_ns=ws.timeout_ns(), grid=grid, out_dtype=wdt,
                                    router=router, policy=policy, comm_programs=comm_programs)
    ws.after_launch()
    if router is not None:
        dx, _, dw13, dw2, d_router, _ = got
        return dx, d_router, dw13, dw2
    dx_e, dweights, dw13, dw2, _ = got
    return _router_backward_torch(x, router_weight, experts.long(), dweights, dx_e, routing, renormalize,
                                  routed_scaling) + (dw13, dw2)


def moe_backward_w1(x, router_weight, w13, w2, dy, weights, experts, *, routing: str = "softmax",
                    renormalize: bool = True, routed_scaling: float = 1.0, wgrad_dtype=None, saved_gu=None,
                    padded: bool | None = None, one_launch: bool | None = None, programs: int | None = None,
                    router_in_launch: bool | None = None):
    """``moe_backward`` at one rank (all E experts local)."""
    return moe_backward(x, router_weight, w13, w2, dy, weights, experts, group=None, routing=routing,
                        renormalize=renormalize, routed_scaling=routed_scaling, wgrad_dtype=wgrad_dtype,
                        saved_gu=saved_gu, padded=padded, one_launch=one_launch, programs=programs,
                        router_in_launch=router_in_launch)
