"""Gluon probe (issue 14): a persistent bf16 GEMM for Hopper whose mainloop rounds A to its MXFP8 values.

    PYTHONPATH=. python -m dev.gluon_mx_probe [--shapes qkv-4k,...] [--variants ...] [--json OUT.jsonl]
    PYTHONPATH=. python -m dev.gluon_mx_probe --variants expand --profile qkv-4k   # the MX-input builds (s23)
    PYTHONPATH=. python -m dev.gluon_mx_probe --compile-only [--json OUT.jsonl]   # no GPU: sm_90a resources, SASS
    PYTHONPATH=. python -m dev.gluon_mx_probe --emulate                           # no GPU: rounding / expansion

A fork of kosmos.gemm.w1_mx._w1_mx_matmul_kernel (as of 339b35e, then kernels/w1_mx_matmul.py; the product was cut
from this probe's gluon-mx-rowpass build in 1c503b5): _gemm_kernel's ROW_PASS build, _mma_partition, _issue_loads
and _next_step are the product kernel, its _mma_loop, _issue_loads and _next_step with every other build's switches
(ROUND_MX, A_REGS, LOAD_S, PROF) beside them; one tile, 128 x 256 (since session 24 the product's tile_width also
picks 128 x 128); GROUP_M an argument; M, N, K multiples of the tile and of KC; the row-pass waits unbounded
(_wait_rows: no timeout, no error record; the product's _wait_count is bounded); the counts never reset (launch e
waits for e times the parts; the product's last program out zeroes them and advances the device epoch). The row
pass, the tile epilogue, the packed rounding, the cvt expansion and the waits' acquire / proxy fence are the
product's, imported.

The default GPU run (~2.5 min): bitwise checks of every rounding and expansion code path it times, a SASS check of
the in-register builds, GEMM checks of every build (B [N, K] and [K, N]), then torch / gluon / gluon-mx-packed /
gluon-ws-copy / gluon-mx-ws-norm / gluon-rs-copy / gluon-mx-rs / gluon-mx-expand / gluon-mx-expand-bits /
quantize+gluon-mx-expand at the 8 llama shapes, then a clock64 profile of each build's k-step at fc1-8k; the tables
last. Sections "s22" below: why the rounding partition was slow, the builds that answer it; "s23": A given in MX
form (kosmos.quant's payload + scales) and expanded in the mainloop, and ``--variants expand`` (torch, gluon,
gluon-rs-copy, the two expand builds, quantize+gluon-mx-expand: under a minute warm).

A developer probe, not product code: C [M, N] = A [M, K] @ B with B the weight [N, K] (or [K, N]), bf16 in,
fp32 accumulation, bf16 out, M, N, K multiples of 128, 256, 64. ROUND_MX=False is the plain GEMM (does Gluon
reach cuBLAS on its own?); ROUND_MX=True multiplies the MX values of A -- dequantize_mx(*quantize_mx(A)), exactly
-- by B, rounding A inside the mainloop. Written for Triton 3.6.0 (the GPU box's); Triton 3.9's Gluon differs.

Why
---
Issue 14: the MXFP8 AllGather+GEMM at W=1 must cost <= 1.05x a bf16 cuBLAS GEMM. Today A is quantized in one
pass, dequantized in another, then a bf16 GEMM runs: 1.14-1.2x. A memory pass over A cannot fit in 5%, so A must
be rounded to its MX values (which are exact bf16 values: kosmos/quant.py) inside the GEMM, overlapped with the
tensor cores. Triton's tl cannot overlap it on 3.6: a tile changed in registers goes to wgmma from registers and
the MMA is not pipelined (measured 1.36-2.5x). Gluon exposes shared memory, mbarriers, TMA, async
warpgroup_mma and warp_specialize, so the rounding can run in its own warps, between two shared-memory rings.

Design (tile 128x256x64, the largest wgmma shape: m64n256k16, one per warpgroup and 16 of K)
------------------------------------------------------------------------------------------------
* MMA partition (the default one, 8 warps = 2 warpgroups of 64 rows; accumulator 128 fp32 registers a thread):
  persistent over tiles dealt round-robin (GROUP_M=8 row tiles walk the columns together), async wgmma with A and
  B both read from shared memory, one wgmma group in flight. It also owns the B ring (STAGES=4 slots of 32 KiB,
  TMA, loaded STAGES-1 k-steps ahead by an elected thread, right after it frees the slot) and the epilogue
  (accumulator -> bf16 -> 4 pieces of 128x64 through one 16 KiB buffer -> TMA stores).
* Rounding partition (ROUND_MX only, ROUND_WARPS=4 warps): owns the raw-A ring (RAW_STAGES=3 slots of 16 KiB, TMA,
  refilled as soon as a slot's tile is in registers, so loads run 3 k-steps ahead). Per k-step it reads the raw
  bf16 tile into registers (each thread: whole MX blocks -- 32 consecutive elements of a row, 16-byte
  ld.shared.v4; by the layout's arithmetic free of bank conflicts under the 128-byte swizzle), rounds it, and only
  then waits for its slot of the rounded-A ring (A_STAGES=2 slots of 16 KiB, read by wgmma) and writes it there.
* Plain build: the MMA partition alone (8 warps), loading A and B into a 4-slot ring itself -- the same mainloop
  minus the rounding warps, so the two builds differ by the rounding only.
* Shared memory: plain 4 x 48 + 16 = 208 KiB; ROUND_MX 4 x 32 (B) + 2 x 16 (A) + 3 x 16 (raw A) + 16 (C) = 224 KiB
  of the 227.
* Why not a separate 1-warp loader (16 warps): with 512 threads a thread gets 128 registers at launch, and ptxas
  (Triton 3.6's CUDA 12.8) refused to compile the 128x256 wgmma (needs ~154) under that cap even after
  setmaxnreg raised the MMA partition's budget ("Insufficient registers (128)"). With 12 warps (384 threads)
  the cap is 168: the plain build uses 164, the MMA partition of the ROUND_MX build runs under setmaxnreg 200
  (ROUND_REGS=104 for the rounding warps), no spills.

Barrier protocol (all mbarriers count 1; Triton issues each arrive from one thread after a barrier of its
partition, and each TMA from one elected thread; phases are k-step // slots & 1)
---------------------------------------------------------------------------------------------------------
    raw_ready[r]  TMA (expect 16 KiB)      -> rounding: raw A of k-step i landed in raw slot i % 3
    a_ready[s]    rounding (after stores + fence.proxy.async) -> MMA: rounded A of k-step i in slot i % 2
    a_done[s]     MMA (after wgmma_wait(1) + a barrier of both warpgroups: k-step i-1's wgmma finished)
                                           -> rounding: slot (i-1) % 2 may be overwritten
    b_ready[s]    TMA (expect 32 KiB; plain: 48 KiB with A) -> MMA: B (and A) of k-step i in slot i % 4
The raw and B rings need no "empty" barriers: their only consumer is the partition that refills them, after it
has finished reading (raw: fence.proxy.async + partition barrier before the TMA; B: wgmma_wait(1) + barrier). A
tile's last k-step releases its A slot after wgmma_wait(0), before the epilogue; the next tile's loads were
issued during the previous tile's last k-steps, so the rings stay full across the epilogue.

The rounding (bitwise kosmos.quant.mx_round_bf16 / dequantize_mx(*quantize_mx(.)))
-------------------------------------------------------------------------------
Two implementations (``--variants``):
* "kosmos": mx_round_bf16 itself -- Gluon compiles a plain @triton.jit function called from a @gluon.jit one
  (the layouts follow the argument: a [rows, 2, 32] bf16 tile in a BlockedLayout whose threads hold whole
  blocks, so the amax is a reduction within a thread). The same code as the MoE epilogue: ~19 SASS instructions
  an element (fp32 bits, integer max, _rceil_exponent, _mx_round_scaled's fp32 add/subtract of 2**(...), the
  integer fp32 -> bf16 rounding, NaN select, sign, repacking), ~2/3 of them on the 16-lane integer pipe.
* "packed": the same values from 7 bf16x2 PTX instructions per pair of elements (mul/fma/sub/mul.rn.bf16x2,
  max.xorsign.abs.bf16x2, and, lop3) plus a 15-op max tree per block, on int32 words holding two bf16 (the
  tile's shared memory reinterpreted as int32: a 128-byte swizzle moves 16-byte chunks, whatever the element
  width). Per block: amax bits -> X by kosmos.quant._rceil_exponent (called as is), the same +-64 pre-scaling as
  _mx_round_scaled (shift s), and four packed constants S16 = 2**(s+4), S = 2**s, Cb = 2**(X+s-2), 2**-s
  (S16 = S = NaN for a block with NaN/Inf). Per element v:
      c = (v * S16) & 0xFF80           sign and binade of v * 2**(s+4): +-2**(e+s+4)
      c = +-max(|c|, Cb)               (xorsign keeps v's sign): +-2**(max(e, X-6) + s + 4)
      t = fma(v, S, c)                 v * 2**s + c rounded ONCE to bf16: bf16 has 7 fraction bits, |v 2**s| + |c|
                                       lies in [|c|, 2|c|), so the rounding quantum is |c| * 2**-7 = 2**(max(e, X-6)
                                       + s - 3): 3 fraction bits in E4M3's normal binades, the subnormal spacing
                                       2**(X-9) below them -- the MX value times 2**s, ties to even
      r = (t - c) * 2**-s              exact, except the final round to nearest of a value below bf16's normal
                                       range -- where mx_round_bf16 rounds its exact fp32 result the same way
      r |= sign(v)                     (a zero result keeps v's sign, as in mx_round_bf16)
  NaN/Inf blocks: S = NaN makes every element NaN, but the hardware's NaN is 0x7FFF (with v's sign), where
  mx_round_bf16 writes 0x7FC0 -- the only difference (no GEMM result can tell). Equality with kosmos.quant's
  references is checked twice: ``--emulate`` (CPU, float64 emulation of each instruction as "exact result,
  rounded once to bf16": every bf16 value of both signs under every X in [-127, 120], 8.7 M elements, 0
  mismatches), and, on the GPU, the rounding-only kernel against dequantize_mx(*quantize_mx(x)) bit for bit
  (random bit patterns, subnormal rows, +-2**100 rows, zeros, ties, NaN/Inf). The GPU check is what confirms the
  two hardware assumptions: bf16x2 add/mul/fma round once to nearest even and keep bf16 subnormals.
  ~4.8 SASS instructions an element, 3/5 of them HMUL2/HFMA2/HADD2 (FP16 pipe) or HMNMX2.

Compile check (Triton 3.6.0 + its ptxas, CPU, sm_90a, B as [N, K], default config; ``--compile-only``)
----------------------------------------------------------------------------------------------------
    build             regs  spills  smem KiB  setmaxnreg (MMA / rounding)   wgmma A from smem  TMA loads
    gluon              164    0      208.0     -                                 yes              yes
    gluon-mx-packed    168    0      224.2     200 / 104                         yes              yes
    gluon-mx-kosmos    168    0      224.2     184 / 128                         yes              yes
("regs" is the launch's figure, 64K / 384 threads for the ROUND_MX builds.) The PTX of every build has
wgmma.mma_async.m64n256k16.f32.bf16.bf16 with a shared-memory descriptor for A (the TTGIR's warp_group_dot
takes a !ttg.memdesc A) and cp.async.bulk.tensor loads; B [K, N] compiles the same.

PREDICTION (written before any GPU run)
---------------------------------------
Per k-step: MMA 128 x 256 x 64 = 2.10 M FMA; H200 dense bf16 = 2048 FMA/clk/SM, so >= 1024 clk at peak, ~1300-1400
clk at cuBLAS-like 70-80% of peak. Rounding: 8192 elements over 4 warps, one warp per SM sub-partition (SMSP),
64 elements a thread. Each SMSP also hosts 2 MMA warps (~100 instructions a k-step each, mostly uniform-datapath
ops, 4 HGMMA). SASS of the ROUND_MX builds' loops, per warp per k-step (executed path):
    packed: 409 instructions, ~190 on the 16-lane ALU pipe (LOP3, HMNMX2 if it is there) -> issue 409 + 200 (MMA
            warps) ~ 610 cycles, ALU <= 380 cycles: ~45-60% of an SMSP against >= 1024 -- hidden.
    kosmos: 1231 instructions, ~820 on the ALU pipe -> ~1640 ALU cycles > 1024-1400: ALU-bound.
So, relative to the plain Gluon GEMM at the llama3 shapes:
    gluon-mx-packed / gluon  = 1.00-1.03  (the residue: 32 KiB more shared-memory traffic per k-step beside the
                                           wgmma operand reads and 48 KiB of TMA writes; the rounded tile waits
                                           in registers for its slot, then store + fence + barrier + arrive sit
                                           between the MMA freeing a slot and wanting it one k-step later; the
                                           rounding warps' issue slots beside the MMA warps' barriers)
    gluon-mx-kosmos / gluon  = 1.25-1.6   (~1640 ALU clk per k-step against ~1024-1400)
And relative to torch.matmul (cuBLAS): the plain Gluon GEMM is the open question. The Triton tutorial's Hopper
persistent kernel with this tile is quoted at ~650-670 TFLOPS (H100, fp16); this one adds nothing cuBLAS lacks
and its epilogue stalls the tensor cores (~1 us a tile; 1-2% at K = 8192, ~2-3% at K = 4096), and 128x256
tiles leave 1.3-3% in the last wave on 132 SMs. Guess: gluon / torch = 1.00-1.10, so gluon-mx-packed / torch =
1.00-1.13: the 1.05 bar is met if the plain Gluon GEMM is within ~3% of cuBLAS; if it is not, what remains is
GEMM tuning (epilogue overlap, tile/scheduling), not the MX rounding.

MEASURED (s21d, one H200, results/h200x1/s21/s21d/gluon-mx-probe.log; time / torch.matmul at the 8 shapes)
----------------------------------------------------------------------------------------------------------
    gluon 0.985-1.004x (the open question answered: Gluon reaches cuBLAS); gluon-mx-packed 1.42-1.56x (predicted
    1.00-1.03x: wrong by ~45%); gluon-mx-kosmos 2.27-2.36x (predicted 1.25-1.6x). Per k-step at qkv-4k (5 tiles x
    128 k-steps on the busiest SM): plain 0.66 us, packed 0.98 us, kosmos 1.57 us, i.e. ~1160-1310 / ~1710-1930 /
    ~2750-3100 cycles at 1.75-1.98 GHz.

s22: why the rounding partition is ~2.4x slower than its instruction count (SASS of the s21 packed build)
-------------------------------------------------------------------------------------------------------
(nvdisasm of the sm_90a cubin, Triton 3.6.0 / ptxas 12.8; ``--compile-only`` prints these counts, ``_sass_loops``)
* The count was right: the rounding loop executes 409 instructions per k-step and warp (the tile-change division
  left out): bf16x2 HMUL2 64 + HFMA2 32 + HADD2 32, HMNMX2 62 (30 for the 15-op max trees, 32 in the element step),
  LOP3 77, other ALU ~51 (ISETP, SEL, IADD3, VIADD, LEA, SHF, SGXT, VIMNMX, PLOP3), IMAD 28, uniform 29, LDS.128 8,
  STS.128 8, 1 UTMALDG, branch 4, sync 13. No spills (104 registers under setmaxnreg), no shuffles (sizePerThread
  [1, 16] words: every thread owns whole MX blocks), 128-bit shared accesses, conflict-free (a phase's 8 threads
  read rows r..r+3, chunks j and j+4: the 128-byte swizzle sends them to 8 distinct 16-byte chunks). The MMA
  loop: 99 instructions per k-step and warp (4 HGMMA, 61 uniform).
* What the estimate missed is that one warp per SMSP runs a strictly serial chain per k-step, and the chain is
  made of memory round trips: BAR.SYNC -> mbarrier try_wait (raw) -> 8 LDS.128 -> MEMBAR.ALL.CTA (what
  fence.proxy.async becomes, with FENCE.VIEW.ASYNC.S: it waits for the loads) -> BAR.SYNC -> expect + BAR.SYNC ->
  UTMALDG -> 330 instructions of rounding -> try_wait (a_done) -> 4 STS.128 -> BAR.SYNC (membar-inserted between
  the two 64-row chunks) -> 4 STS.128 -> MEMBAR.ALL.CTA (waits for the stores) -> FENCE -> BAR.SYNC -> arrive: 5
  barriers of 128 threads, 2 full memory fences and 2 mbarrier waits per k-step, nothing of k-step i + 1 started
  before k-step i's stores are fenced. The rings (RAW_STAGES 3, A_STAGES 2, B 4: 224.2 KiB of 227) keep TMA ahead
  but cannot overlap this chain with itself: A_STAGES 2 lets the rounding run one k-step ahead, no more, and a
  deeper A ring only helps if the chain is shorter than the MMA's k-step, which it is not.
* And the chain's memory operations queue behind the tensor cores: a k-step of the plain build moves 128 KiB
  through shared memory (TMA writes A 16 + B 32 KiB; wgmma reads A 2 x 8 + B 2 x 32 KiB -- each warpgroup reads
  all of B), ~100-113 B/clk of the SM's 128 at ~1160-1310 cycles; the partition adds LDS 16 + STS 16 KiB (+25%,
  160 KiB: >= 1280 cycles at the full 128 B/clk), and its LDS/STS/MEMBAR wait behind wgmma operand reads.
  (kosmos: 1230 instructions, 818 on the 16-lane ALU -> >= 1640 ALU cycles plus the same chain: 2.3x.)
Hence the s22 builds: diagnostics that separate the two effects, and a design with neither (A rounded in wgmma's
register operand: no extra shared-memory traffic, no cross-partition handoff, the rounding spread over 8 warps).

s22 builds (``BUILDS``; the default run times the first six and torch)
--------------------------------------------------------------------
* gluon-ws-copy (diagnostic): the s21 partition with the rounding removed (IMPL "copy", LDS -> STS; C = A @ B):
  the partition design's floor -- its handoffs and its +32 KiB of shared traffic per k-step, no arithmetic.
* gluon-mx-ws-norm: the s21 partition with the "norm" constants (below): 364 instead of 409 instructions.
* gluon-rs-copy (diagnostic): the plain build with A taken through registers (LDSM into wgmma's A-operand layout,
  wgmma with A from registers, no rounding): the cost of the register path itself.
* gluon-mx-rs (A_REGS=2): the MMA warps round A themselves between the LDSM and the wgmma (no rounding partition,
  plain's 8 warps and 4-slot A+B ring, 208 KiB). Per warp and k-step a thread holds 32 elements of 2 rows x 2
  blocks (4 pairs of each block; the quad of lanes holds the block): block max on 32-bit words (max.NaN.xorsign.abs
  .bf16x2: 3 in-thread ops + 2 shuffle rounds, one swap + max puts the amax in both halves), the "norm" constants
  on words (9 ops), the 7-op element step per pair. The rounding of k-step i runs while wgmma(i - 1) of both
  warpgroups executes (issued one step earlier, wait_group 1).
* gluon-mx-rs1 (A_REGS=1, not in the default run): the same with gl.reduce on bf16 scalars and the constants per
  element: 315 instructions instead of 276.
* The wgmma A-register hazard: a wgmma reads its register A operand asynchronously, and ptxas does not stop the
  next k-step from overwriting those registers (Triton issue #9433, where upstream's fix copies A into fresh
  registers right before each wgmma). A first A_REGS build did exactly that (its LDSM of k-step i + 1 wrote the registers of the
  in-flight wgmma i: 27 such writes in the SASS). The A_REGS k-loop is therefore unrolled twice: even and odd
  k-steps use distinct PTX registers, each set written only after wait_group 1 has retired the wgmma that read it,
  and ptxas then keeps the two sets apart (A_REGS builds need K % 128 == 0). ``_a_regs_hazards`` replays the
  loop's SASS and lists any write to an in-flight group's A registers: 0 for rs, rs1, rs-copy (the GPU run checks
  the compiled kernel again before timing it).
* The "norm" constants: every block is normalised to X = 0 instead of the +-64 shift -- s = -X - 4, so Cb =
  2**(X + s - 2) is the constant 2**-6 and S16 = 2**-X, S1 = 2**(-X - 4), Sinv = 2**(X + 4) are all normal for X in
  [-127, 120]; from the amax bits A: P = 2**(X + 8) = max((A + 0x1F) & 0x7F80, 0x0400) (adding 0x1F carries into
  the exponent exactly when the fraction is above 0x60: RCEIL's +1; the max is the clamp X >= -127), S16 = 0x8300 -
  P, S1 = 0x8100 - P, Sinv = P - 0x0200, and a NaN/Inf block gets Cb = NaN (fma(A, 0, 2**-6)), spread to every
  element by max.NaN.xorsign.abs. The element step is the packed one (mul, and, max, fma, sub, mul, lop3). --emulate
  checks both constant schemes on every bf16 value under every X, amax just above 448 * 2**X, tiny blocks, NaN/Inf
  (8.7 M elements, 0 mismatches each); the GPU run checks each timed rounding path bitwise (round-only kernels:
  the partition's layout for packed / norm, wgmma's A layout for A_REGS 2).
* PROF (profile_shape, default fc1-8k): each build once more with clock64 around its phases: MMA loop (b/a_ready
  wait, A_REGS rounding, wgmma_wait(1), barrier + refill), rounding loop (raw wait, load + refill, round, a_done
  wait, store + fence + arrive), cycles per k-step and warp.
* More rounding warps (16 warps: 8 MMA + 8 rounding) still fails in ptxas 12.8 ("Insufficient registers (128) ...
  register target of 154": it allocates every partition under the launch cap, setmaxnreg notwithstanding); two
  k-steps per handoff (128x128 A slots) does not fit 227 KiB with 4 B stages.

s22 compile check (Triton 3.6.0, ptxas 12.8, sm_90a, B [N, K]; instructions per k-step and warp from the SASS)
-------------------------------------------------------------------------------------------------------------
    build             regs spill smem KiB  MMA loop  rounding loop (partition warp)
    gluon              164    0    208.0     100       -
    gluon-mx-packed    168    0    224.2      99     409 (fp16x2 128, hmnmx2 62, alu 128, imad 28, lds 8, sts 8)
    gluon-mx-kosmos    168    0    224.2      99    1230 (alu 818, fp32 256, imad 93)
    gluon-mx-ws-norm   168    0    224.2      99     364 (fp16x2 130, hmnmx2 66, alu 92, imad 13, lds 8, sts 8)
    gluon-ws-copy      168    0    224.2      99      91 (alu 15, imad 13, lds 8, sts 8, sync 13)
    gluon-rs-copy      204    0    208.0      96       -   (LDSM 4, A from registers, hazards 0)
    gluon-mx-rs        217    0    208.0     276       -   (fp16x2 68, hmnmx2 44, alu 76, imad 11, shfl 8, LDSM 4)
    gluon-mx-rs1       209    0    208.0     315       -   (fp16x2 64, hmnmx2 49, alu 110, imad 16, shfl 8)
(B [K, N]: the same within +-4 instructions; rs 220 registers. The WS builds: setmaxnreg 200 MMA / 104 rounding,
kosmos 184 / 128.)

s22 PREDICTION (before the GPU run; time / plain gluon at the llama shapes; gluon ~ torch as measured)
---------------------------------------------------------------------------------------------------
Budget per k-step on the busiest SM: ~1160-1310 cycles (plain, measured); 4 SMSPs, each: 2 MMA warps (+ 1
rounding warp in the WS builds); the 16-lane ALU takes 2 cycles a warp instruction, bf16x2 ~1.
    gluon-ws-copy     1.10-1.30  the chain of memory round trips and +25% shared traffic without the arithmetic;
                                 above 1.05 means the partition design cannot meet issue 14 whatever its arithmetic
    gluon-mx-ws-norm  1.35-1.50  packed minus ~45 instructions (~90 ALU cycles) of a ~1700-1900-cycle chain
    gluon-rs-copy     0.99-1.03  same shared traffic as plain (LDSM replaces wgmma's A reads), 4 LDSM per warp
    gluon-mx-rs       1.00-1.06  per SMSP and k-step 2 x 276 = 552 issue slots of ~1160-1310, ALU 2 x ~120 x 2 =
                                 ~480 cycles; the critical path of k-step i's A (barrier + refill ~150, LDSM ~40,
                                 rounding of both warps of the SMSP ~550) ~750 cycles < wgmma(i - 1) ~1100-1300
    (gluon-mx-packed   1.42-1.56 again; gluon-mx-rs1 1.01-1.08)
Read with the profile: gluon-mx-rs hides the rounding if its "A_REGS round" phase stays well under its
"wgmma_wait(1)" + round total, i.e. the MMA warps still wait for the tensor cores at every k-step.

MEASURED (session 21, after the s22 builds; one H200, Triton 3.6.0; results/h200x1/s21/s21f, probe2 / probe3)
---------------------------------------------------------------------------------------------------------------
Time / plain gluon at qkv-4k, fc1-4k, attn_out-4k (plain gluon 0.995-1.008x torch.matmul): gluon-rs-copy 1.004 /
1.008 / 1.005 (predicted 0.99-1.03: right -- A through registers costs nothing here, unlike tl's on Triton 3.6);
gluon-mx-rs 1.342 / 1.336 / 1.342 (predicted 1.00-1.06: wrong); gluon-ws-copy 1.190 / 1.214 / 1.165 (predicted
1.10-1.30: the partition design alone costs ~20%, so it cannot meet issue 14); gluon-mx-ws-norm 1.364 (qkv-4k);
gluon-mx-packed 1.475-1.492. Every check passed (rounding bitwise but the NaN payload; no write to an in-flight
wgmma's A registers in the SASS; GEMMs 1.7e-3 against fp32).
Cycle profile at qkv-4k (clock64, mean per k-step and warp): plain gluon 947 cycles a k-step (wgmma_wait 544);
gluon-rs-copy 953; gluon-mx-rs 1427 -- its A_REGS round phase 924 cycles against wgmma_wait 148: the rounding of
k-step i is longer than wgmma(i - 1) (~550-580 cycles of waiting in plain), so it is exposed by ~480 cycles.
gluon-mx-ws-norm: rounding partition 1600 a k-step (load + refill 608, round 586, store + fence + arrive 239).
So the register path is the design to keep; the rounding must fit in ~550 cycles per k-step and warp (now 924):
~40% fewer cycles, or the rounding split so that one warpgroup rounds while the other's wgmma runs.

If none reaches ~1.05 (next)
----------------------------
* rs-copy > 1.03: the register path itself costs; keep SS wgmma and let the MMA warps round their own A slot in
  place (LDS -> round -> STS into the ring slot -> fence -> wgmma): +16 KiB of shared traffic instead of +32 and no
  cross-partition handoff.
* rs's round phase too long: cut the per-pair step from 7 to 5 ops (c = +-2**max(e, X - 6) from v & 0xFF80 and
  Cb, t = fma(c, 16, v), r = fma(c, -16, t), sign: by the same quantum argument exact for about -120 <= X <= 115,
  to be settled with --emulate) with a warp-uniform fallback for the rare blocks beyond; compute the 4 blocks' constants of a
  thread in 16-bit lanes (2 blocks a word); decouple the two warpgroups (a producer warp, slot release by a count-2
  mbarrier instead of the 256-thread barrier) so one warpgroup rounds while the other's wgmma runs.
* ws-copy <= 1.05 but ws-norm not: the partition's arithmetic is the limit -- software-pipeline the rounding warp
  (loads of k-step i + 1 issued before the stores of i), then cut instructions as above.

s23: A given in MX form, expanded in the mainloop (2026-12-04; helper branch gluon-mx-expand; not yet run on a GPU)
-------------------------------------------------------------------------------------------------------------------
Rounding bf16 A to MX in the mainloop costs 1.34x (gluon-mx-rs, s21f); the register path itself is free (rs-copy
1.004-1.008x). The cheaper job: A arrives already quantized (kosmos.quant.quantize_mx's MXTensor, the public layout:
payload [M, K] float8_e4m3fn, scales [M, K/32] uint8 E8M0 -- at W > 1 what the all-gather delivers) and the MMA
warps only EXPAND it to its bf16 values, P * 2**(S - 127) (exact bf16 values: kosmos/quant.py), in wgmma's
register operand. Builds (BUILDS; gemm_launch takes the MXTensor):
* gluon-mx-expand (A_REGS=4): the rs-copy mainloop (8 MMA warps, one partition, the ring loaded by the MMA warps
  STAGES - 1 k-steps ahead, wgmma A from registers, the two-register-set unroll) with, per ring slot, the payload
  tile uint8 [128, 64] (8 KiB, TMA, 64-byte swizzle), the scale box uint8 [2, 128] (256 B, TMA, no swizzle) and B
  [256, 64] (32 KiB) under one mbarrier (expect 40.25 KiB). 4 slots: 161 + 16 (C piece) = 177 KiB.
* Where the scales come from (s23 layout): k-major, scales_t [K/32, M] (``mx_a``: a transpose of kosmos.quant's
  public [M, K/32]; a quantizer can write it directly). A k-step's box is [BK/32 = 2 blocks, 128 rows] at (off_k /
  32, off_m): its inner dimension starts at off_m, 16-byte aligned, as a tiled TMA box must (s22's [128, 16] box of
  the public layout started at byte 2 * k-step: the illegal instruction below). The MMA warps read it through a
  permuted shared view ([128, 2]). TMA needs the row stride, M bytes, to be a multiple of 16.
* Registers: the payload slot read as int16 [128, 32] (k-pairs; the same bytes, _pair_view) in DotOperandLayout
  (k_width 1), which is the bf16 A layout (k_width 2) in pair units: a thread holds rows r and r + 8 of its warp's
  16 and pairs c, c + 4, ..., c + 28 (c = lane % 4) -- 16 LDS.U16 per thread and k-step, conflict-free by the
  layout's arithmetic (a request's 8 rows x 8 bytes fall in 8 distinct 8-byte bank groups under the 64-byte
  swizzle, chunk ^= (row / 2) % 4): 16 wavefronts per warp, as the bf16 build's 4 LDSM.x4. The scales: loaded in the
  slice layout of the same, 2 LDS.U16 per thread (2 rows x the step's 2 blocks). Each pair expands into one 32-bit
  word, the bf16x2 register wgmma takes (join + reshape back to the k_width 2 layout is free: convert_layout with
  assert_trivial=True compiles). The first try, the payload as uint8 in the k_width 2 layout, made Triton unpack the
  bytes and repack them into 32-bit registers: 60 PRMT per thread and k-step.
* The expansion, bit for bit kosmos.quant.dequantize_mx (exact values; results below bf16's normal range rounded to
  nearest even, to subnormals or +-0 with the sign kept; >= 2**128 -> +-inf; a NaN payload byte or scale 0xFF ->
  0x7FC0), two ways (``_EXPAND_CVT`` / ``_EXPAND_BITS``, comments there):
    cvt  (gluon-mx-expand, 7 SASS per pair): cvt.rn.f16x2.e4m3x2, 2 x f16 -> f32 (HADD2.F32), 2 fp32 multiplies by
         the block's 2**(S - 127) (kosmos.quant.mx_scale_f32: S = 0 the fp32 subnormal 2**-127, 0xFF NaN),
         cvt.rn.bf16x2.f32 (the one rounding), min.s16x2 with 0x7FC0 (the hardware's NaN 0x7FFF -> 0x7FC0).
    bits (gluon-mx-expand-bits, A_REGS=5, 8 per pair, no conversion instruction): prmt (bytes to halves, sign
         replicated) + shl 4 + and: bf16 bits of v * 2**-120 (E4M3 subnormals land on bf16 subnormals); two bf16x2
         multiplies by 2**min(S - 7, 127) and 2**max(S - 134, 0) (one of them rounds, the other is exact); abs +
         set.gt against 448 * 2**-120 (-1 for S = 0xFF) + lop3 select of 0x7FC0 (NaN bytes, NaN scales).
  The candidate "f16 bits with the exponent shifted by the scale" loses to both: zeros and the E4M3 NaN need
  per-element fix-ups (f16 NaN shifted is a finite bf16), and the shifted exponent leaves bf16's normal range
  outside S in [10, 246] (a per-block fallback on top).
  --emulate checks both on every payload byte under every scale byte (65536 elements: 766 NaN, 560 +-inf, 554 bf16
  subnormal and 524 zero results) against dequantize_mx_ref with the kernel's 0x7FC0 NaN: 0 mismatches each; the GPU
  run checks the expand-only kernel (the GEMM's TMA, layouts and code) against dequantize_mx on every (byte, scale)
  pair twice, shuffled, plus 61440 random blocks and quantize_mx(_round_inputs), NaN bits included.

Compile check (Triton 3.6.0 + its ptxas 12.8, sm_90a, --compile-only; B [N, K], B [K, N] in brackets)
    build                  regs  spills  smem KiB  wgmma A   MMA loop: SASS per k-step and warp (32 A elements a thread)
    gluon-rs-copy          204 [196]  0   208.0    registers   96  (LDSM 4, A-register hazards 0)
    gluon-mx-expand        215 [219]  0   184.0    registers  270  (hazards 0)   s23 layout: 215, 0, 177.0, 268
    gluon-mx-expand-bits   207 [213]  0   184.0    registers  298  (hazards 0)   s23 layout: 207, 0, 177.0, 296
  gluon-mx-expand's +174 over rs-copy, per element: the expansion 3.5 (F2FP 32 -- 16 E4M3x2 -> f16x2, 16 f32x2 ->
  bf16x2 --, HADD2.F32 32, FMUL 32, VIMNMX 16 per thread), payload loads 0.5 (16 LDS.U16; rs-copy: 4 LDSM), scales
  0.8 (2 LDS.U16, 4 PRMT, 8 ISETP, 4 IMAD.SHL, 8 FSEL: 4 multipliers), the third TMA and its address and loop
  arithmetic ~0.7 (mostly uniform datapath). gluon-mx-expand-bits: the expansion 4.0 (PRMT 16, IMAD.SHL 16, LOP3 32,
  HFMA2 16 -- the abs --, HSET2 16, HMUL2 32), scales ~1.0. (gluon-mx-rs: 276, its rounding ~5.6 per element.)
  The PTX's wgmma.m64n256k16 take A as a {4 x b32} register list (TTGIR: warp_group_dot with a tensor A).

PREDICTION (2026-12-04, before any GPU run; time / plain gluon at the 8 llama shapes unless said)
----------------------------------------------------------------------------------------------
The budget (s21f, qkv-4k, per k-step and warp): plain 947 cycles of which 544 wait in wgmma_wait(1) -- the MMA
warps idle while the tensor cores run k-step i - 1; rs-copy's "A_REGS round" phase is 27 cycles (LDSM issue). An
A_REGS build is as fast as plain while its phase stays below that ~550-cycle wait. A model that reproduces gluon-mx-
rs's measured 924-cycle phase: every extra instruction that is not FP32 / IMAD / uniform issues at 2 cycles a warp
(taken as 16-lane pipes: the integer ALU, HMNMX2, bf16x2), both MMA warps of an SMSP count (they work at once),
plus the dependency chain (rs: 2 x 188 x 2 = 752, chain ~170: 920). For gluon-mx-expand: 2-cycle class per warp
F2FP 32 (pipe unpublished: taken as 2 cycles), HADD2.F32 32, VIMNMX 16, scales' ISETP / FSEL / PRMT ~20, misc ~4
= 104 -> 2 x 104 x 2 = 416, FMUL and IMAD in parallel on the FMA pipe, chain ~80 (LDS ~30, 5 dependent ops; the
scales' 6): ~500 cycles, just under the wait. gluon-mx-expand-bits: 2-cycle class LOP3 32, PRMT 20, bf16x2 64,
VIMNMX / ISETP / SEL ~17 = 133 -> 532 + chain ~80: ~610, ~60 over.
    gluon-mx-expand       1.00-1.06 (central 1.02); its profile phase ~400-550 cycles, wgmma_wait ~50-150, k-step
                          ~950-1000 at qkv-4k. If F2FP issues at the programming guide's "other conversions" rate
                          (16 a clock per SM: 8 cycles a warp), its 32 take 512 cycles per SMSP and k-step alone:
                          1.08-1.15, and -bits is the one to keep.
    gluon-mx-expand-bits  1.02-1.10 (central 1.05); 1.00-1.03 if bf16x2 multiplies issue at full rate.
So, against torch.matmul (plain gluon measured 0.985-1.004x): gluon-mx-expand 0.99-1.07x -- the op with MX input
meets the 1.05 bar at W = 1 if the central estimate holds. quantize+gluon-mx-expand = that plus quantize_mx, a
memory pass of 3 bytes per element measured at 2.33 TB/s ([4096, 8192]: 43.5 us; NOTES.md): +10.2% of torch at qkv
(K 8192, N 5120), +1.8% at fc1, +6.3% at attn_out, +6.4% at fc2 (the same at 4k and 8k tokens): 1.09-1.17x qkv
(central 1.12), 1.01-1.09x fc1 (1.03), 1.05-1.13x attn_out and fc2 (1.08). The op from bf16 misses 1.05 at W = 1 on
3 of the 4 GEMMs however free the expansion is: what would remain is the standalone quantize pass, not the GEMM (at
W > 1 a rank quantizes only its own 1/W of the rows before the all-gather).
Unverified until the GPU run: F2FP's issue rate (above); the hardware semantics the emulation assumes (no flush of
fp32 / bf16 subnormals in FMUL, cvt.rn.bf16x2.f32 and HMUL2.BF16; NaN out of cvt / FMUL as 0x7FFF; HSET2's 0xFFFF
per-half mask) -- the expand-only check settles them; the LDS.U16 being conflict-free; the scale box's TMA at a
column that is not 16-byte aligned (the expand-only kernel loads it the same way).

Gluon 3.6 notes
---------------
* Nothing needed was missing: shared-memory rings, mbarriers (init/expect/wait/arrive with predicates),
  TMA loads/stores from descriptors, async warpgroup_mma from shared memory with a permuted (K-major) B view,
  warp_specialize with tensor-free worker partitions, setmaxnreg budgets, memdesc slice/index/_reinterpret,
  inline PTX on packed words, and plain @triton.jit helpers (kosmos.quant's) inside @gluon.jit code.
* Worries: (1) the ptxas register cap above (no separate loader warp at 128x256); (2) _reinterpret of a
  swizzled bf16 tile as int32 is an underscore API; (3) Triton's membar pass adds partition barriers around the
  mbarrier.expect and arrive (with the probe's own, 4 bar.sync of 256 threads per k-step in the MMA loop, 5 of
  128 in the rounding loop) -- cheap in the SASS count, untested for latency; (4) no Hopper TMA multicast in
  3.6.0 (NOTES.md); (5) the plain build is the non-warp-specialised mainloop (loads issued by the MMA warps) -- a
  producer warp would need 16 warps, see above;
  (6) Triton 3.9's Gluon renamed the TMA calls (async_copy_global_to_shared -> async_load): the probe imports
  there but compiles under 3.6 only, as the GPU box has it.

MEASURED (s22b / s22c, one H200, Triton 3.6.0; results/h200x1/s22): every MX-input kernel -- both expand-only kernels
and both GEMM builds -- dies with "an illegal instruction". compute-sanitizer puts it at the scale box's TMA load
(the expand-only kernel's ``tma.async_copy_global_to_shared(s_desc, [off_m, off_k // 32], ...)``) in programs whose
box starts at byte 22 / 24 of a scale row: a tiled TMA box must start 16-byte aligned in its inner dimension, on top
of the 16-byte box width and row stride. Fix to make (not made): the scales as [K/32, M] (box [2, 128] at column
off_m, a permuted shared view for the load; the quantizer can write that layout directly), or a 16-aligned [128, 16]
box kept for 8 k-steps with its column a constexpr of an unrolled 8-step loop. Nothing of the prediction above is
measured yet; the expansion arithmetic is checked only by --emulate.
s23 (2026-12-04): the first fix made (k-major scales, ``mx_a``; compiles under 3.6.0 with the same registers, the
loop 2 instructions shorter). The quantize+gluon-mx-expand row now also times the scales' transpose (M * K / 32
bytes, ~1 MB at 4k tokens and K 8192: a few microseconds). Then a second fault: ``permute`` of the box's NVMMA
shared layout loaded the bytes as if they were [BM, 2] row-major (dev/archive/gluon_expand_diag ``map``: block 1 of row r
read row 2r + 1's block 0); read through a plain row-major SwizzledSharedLayout, permuted (_scale_view), every
check passes (s23a).

MEASURED s23 (one H200, Triton 3.6.0; results/h200x1/s23, predictions in s23/predictions.md), time / plain Gluon
over the 8 llama shapes: gluon-mx-expand 1.196-1.226 (predicted 1.00-1.06: wrong), -bits 1.218-1.283; profile
qkv-4k: expansion 626 cycles per k-step and warp (predicted 400-550), wgmma_wait 153 (plain 544), barrier + refill
390 (272): the k-step 1269 against 947. The expansion does not hide under the wgmma, and it is redone for every
column tile (N / 256 times per A element). quantize+gluon-mx-expand 1.23-1.33x of torch.matmul. Lost.

s23: the row pass (gluon-mx-rowpass / gluon-mx-expandpass, ROW_PASS 1 / 2). A's MX values made ONCE for the grid
by a 4-warp partition (now w1_mx_matmul's _row_pass, parts [16, 512] in the order the tiles need them, release counts per (row
block, chunk) and per row block) into a bf16 buffer; the MMA warps run the plain mainloop, acquiring the row
block's total once per tile (while short, each chunk's count). Measured, time / torch.matmul: rowpass (from bf16)
1.004-1.052, expandpass (from an MX A) 0.995-1.039, quantize+expandpass 1.017-1.129 (s23c); a wait per chunk
instead of the per-tile total cost +1.5-2% (s23b's first run); KC = 1024 and 32-row parts: no better (s23b).
Profile qkv-4k: k-step 975 cycles (plain 947), barrier + refill 379 (270), wgmma_wait 451 (545). This became
the product's W = 1 MX kernel, kosmos/kernels/w1_mx_matmul.py (which now holds the one copy of the packed
rounding -- with a NaN / Inf block written as quant.mx_round's 0x7FC0, +32 ALU per k-step and warp in the
gluon-mx-packed build, whose s21 timings predate it -- of the cvt expansion, of the row pass and of the tile
epilogue: the probe's ROW_PASS builds now run the product's masked _row_pass, their s23 timings above were taken
with the probe's own unmasked copy; the product's PTX is unchanged by the move, the plain build's too).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kosmos.gemm.tiles import _grouped_tile
from kosmos.gemm.w1_mx import _EXPAND_PAIR as _EXPAND_CVT  # the product's copies (s23)
from kosmos.gemm.w1_mx import (_absmax_bf16x2, _acquire, _mx_round_words, _proxy_fence, _splat2,
                                         _store_tile, _tree_absmax)
from kosmos.gemm.w1_mx import KC as KC_PRODUCT, PART_ROWS as PART_ROWS_PRODUCT
from kosmos.gemm.w1_mx import _row_pass as _product_row_pass
from kosmos.quant import _BF16_QNAN, _rceil_exponent, dequantize_mx, mx_round, mx_round_bf16, mx_scale_f32, quantize_mx

DEVICE = "cuda"  # the checks' and timings' device (a CPU dry run of the host code sets "cpu")
IMPLS = {"kosmos": 0, "packed": 1, "norm": 2, "copy": 3}  # IMPL: the rounding partition's arithmetic
# (module docstring; "copy" rounds nothing: a diagnostic of the partition's data movement)


# ============================================================================================ MX rounding of a tile
@gluon.jit
def _word_view(buf):
    """An int32 view [BM, BK/2] of a bf16 [BM, BK] tile with a 128-byte-swizzled NVMMA layout: the same bytes (the
    swizzle permutes 16-byte chunks within 128-byte rows, whatever the element width)."""
    return buf._reinterpret(gl.int32, [buf.shape[0], buf.shape[1] // 2],
                            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))


@gluon.jit
def _round_load(src, IMPL: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """Registers of a bf16 [BM, BK] shared tile, in BM / ROWS chunks of ROWS rows (a tuple): each thread holds whole
    MX blocks (32 consecutive elements of a row; "kosmos": bf16 [ROWS, BK], "packed": int32 words [ROWS, BK/2])."""
    BM: gl.constexpr = src.shape[0]
    BK: gl.constexpr = src.shape[1]
    xs = ()
    if IMPL == 0:
        lay: gl.constexpr = gl.BlockedLayout([1, 32], [32 * 32 // BK, BK // 32], [WARPS, 1], [1, 0])
        for c in gl.static_range(BM // ROWS):
            xs = xs + (src.slice(c * ROWS, ROWS).load(lay), )
    else:
        lay: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 32 // BK, BK // 32], [WARPS, 1], [1, 0])
        words = _word_view(src)
        for c in gl.static_range(BM // ROWS):
            xs = xs + (words.slice(c * ROWS, ROWS).load(lay), )
    return xs


@gluon.jit
def _round_compute(xs, IMPL: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """The MX values of the chunks of ``_round_load`` (a tuple of the same shapes and layouts)."""
    BKX: gl.constexpr = xs[0].shape[1]  # BK ("kosmos": bf16) or BK / 2 ("packed": int32 words)
    ys = ()
    for c in gl.static_range(len(xs)):
        x = xs[c]
        if IMPL == 0:
            y = gl.reshape(mx_round_bf16(gl.reshape(x, [ROWS, BKX // 32, 32])), [ROWS, BKX])
        elif IMPL == 1:
            y = gl.reshape(_mx_round_words(gl.reshape(x, [ROWS, BKX // 16, 16])), [ROWS, BKX])
        elif IMPL == 2:
            y = gl.reshape(_mx_round_words_norm(gl.reshape(x, [ROWS, BKX // 16, 16])), [ROWS, BKX])
        else:  # IMPL 3, "copy": no rounding (a diagnostic: the partition's data movement alone)
            y = x
        ys = ys + (gl.convert_layout(y, x.type.layout), )
    return ys


@gluon.jit
def _round_write(ys, dst, IMPL: gl.constexpr, ROWS: gl.constexpr):
    """Store the chunks of ``_round_compute`` into the bf16 [BM, BK] tile ``dst``."""
    if IMPL == 0:
        for c in gl.static_range(len(ys)):
            dst.slice(c * ROWS, ROWS).store(ys[c])
    else:
        words = _word_view(dst)
        for c in gl.static_range(len(ys)):
            words.slice(c * ROWS, ROWS).store(ys[c])


# The "norm" constants (RS build): every block normalised to X = 0 (shift s = -X - 4 instead of +-64 / 0), so
# that Cb is the constant 2**-6 and S16, S1, Sinv are integer offsets of one power of two (module docstring).
_ROUND_STEP = """{{
        .reg .b32 c, t;
        mul.rn.bf16x2 c, $1, {s16};
        and.b32 c, c, 0xFF80FF80;
        max.NaN.xorsign.abs.bf16x2 c, c, {cb};
        fma.rn.bf16x2 t, $1, {s1}, c;
        sub.rn.bf16x2 t, t, c;
        mul.rn.bf16x2 t, t, {sinv};
        lop3.b32 $0, t, $1, 0x80008000, 0xF8;
        }}"""  # the element step on a bf16 pair $1 given the block's S16, Cb, S1, Sinv operands
_ROUND_NORM = gl.constexpr(_ROUND_STEP.format(s16="$2", cb="$3", s1="$4", sinv="$5"))


@gluon.jit
def _absmax_bf16(a, b):
    """max(|a|, |b|) of two bf16, NaN-propagating (canonical NaN 0x7FFF); the sign bit is meaningless (xorsign)."""
    return gl.inline_asm_elementwise("max.NaN.xorsign.abs.bf16 $0, $1, $2;", "=h,h,h", [a, b], dtype=gl.bfloat16,
                                     is_pure=True, pack=1)


@gluon.jit
def _norm_consts(amax):
    """The blocks' constants (bf16 bit patterns in int32) from their amax magnitude bits (bf16 pattern & 0x7FFF):
    P = 2**(X + 8) = max((amax + 0x1F) & 0x7F80, 2**-119) -- adding 0x1F carries into the exponent exactly when
    the fraction is above 0x60, RCEIL's +1; the max is X's clamp at -127 -- then S16 = 2**-X, S1 = 2**(-X - 4),
    Sinv = 2**(X + 4) by exponent arithmetic on P's bits (all normal for X in [-127, 120]), and Cb = 2**-6, or
    NaN for a block holding NaN/Inf (max.NaN spreads it to every element)."""
    p = gl.maximum((amax + 0x1F) & 0x7F80, 0x400)
    return 0x8300 - p, gl.where(amax >= 0x7F80, 0x7FC0, 0x3C80), 0x8100 - p, p - 0x200


@gluon.jit
def _bits_bf16(x):
    """int32 holding a 16-bit pattern -> that bf16."""
    return x.to(gl.int16).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _mx_round_dot(a):
    """The MX values of a bf16 [BM, BK] tile in wgmma's A-operand register layout (DotOperandLayout, k_width 2:
    each thread holds 8 elements of a 32-element block, as 4 pairs; the quad of lanes holds the block), same layout
    back. amax: gl.reduce with max.NaN.xorsign.abs.bf16 (7 in-thread ops and 2 shuffle rounds per block); the
    element step: the packed 7 instructions per pair with the "norm" constants."""
    BM: gl.constexpr = a.shape[0]
    BK: gl.constexpr = a.shape[1]
    a3 = a.reshape([BM, BK // 32, 32])
    amax = gl.reduce(a3, 2, _absmax_bf16)
    s16, cb, s1, sinv = _norm_consts(amax.to(gl.int16, bitcast=True).to(gl.int32) & 0x7FFF)
    y3 = gl.inline_asm_elementwise(
        _ROUND_NORM, "=r,r,r,r,r,r",
        [a3, gl.expand_dims(_bits_bf16(s16), 2), gl.expand_dims(_bits_bf16(cb), 2), gl.expand_dims(_bits_bf16(s1), 2),
         gl.expand_dims(_bits_bf16(sinv), 2)], dtype=gl.bfloat16, is_pure=True, pack=2)
    return gl.convert_layout(y3.reshape([BM, BK]), a.type.layout, assert_trivial=True)


# The element step of the "words" variant: as _ROUND_NORM, on a bf16 pair ($1) with the block's constants given
# as int32 words whose halves are equal (each appears twice, pack = 2: $2/$3 S16, $4/$5 Cb, $6/$7 S1, $8/$9 Sinv).
_ROUND_WORDS = gl.constexpr(_ROUND_STEP.format(s16="$2", cb="$4", s1="$6", sinv="$8"))


@gluon.jit
def _pair_words(x):
    """bf16 [R, NB, 2n] -> int32 [R, NB, n]: each word the pair (2i, 2i + 1) as the register holds it (the low half the
    even element). Costs nothing: the pair already is one 32-bit register."""
    w = gl.inline_asm_elementwise("mov.b32 $0, $2;\n mov.b32 $1, $2;", "=r,=r,r", [x], dtype=gl.int32,
                                  is_pure=True, pack=2)
    lo, hi = w.reshape([x.shape[0], x.shape[1], x.shape[2] // 2, 2]).split()
    return lo


@gluon.jit
def _swap_halves(w):
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x1032;", "=r,r", [w], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _bf16x2_op(a, b, OP: gl.constexpr):
    return gl.inline_asm_elementwise(OP + " $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _norm_consts_words(amax_w):
    """_norm_consts on words whose two halves both hold the block's amax (signs meaningless): the same four
    constants, each in both halves (the halves never carry or borrow into each other: P in [0x0400, 0x7F80])."""
    clean = amax_w & 0x7FFF7FFF
    p = _bf16x2_op((clean + 0x001F001F) & 0x7F807F80, gl.full(clean.shape, 0x04000400, gl.int32,
                                                                 clean.type.layout), "max.bf16x2")
    cb = gl.inline_asm_elementwise("{ .reg .b32 z, k;\n mov.b32 z, 0;\n mov.b32 k, 0x3C803C80;\n"
                                   " fma.rn.bf16x2 $0, $1, z, k; }", "=r,r", [clean], dtype=gl.int32,
                                   is_pure=True, pack=1)  # 2**-6, or NaN where amax is NaN / Inf (0 * Inf)
    return -0x7CFF7D00 - p, cb, -0x7EFF7F00 - p, p - 0x02000200  # 0x83008300 - p, 0x81008100 - p (mod 2**32)


@gluon.jit
def _mx_round_dot_words(a):
    """_mx_round_dot with the amax and the constants on 32-bit words (two elements each): the in-thread part of
    the block max on words (3 ops for a thread's 4 words of a block), the 2 shuffle rounds on words, one swap
    + max to put the block amax in both halves, and the constants computed once per word (module docstring)."""
    BM: gl.constexpr = a.shape[0]
    BK: gl.constexpr = a.shape[1]
    a3 = a.reshape([BM, BK // 32, 32])
    w = _pair_words(a3)                                        # [BM, BK/32, 16] words
    m = gl.reduce(w, 2, _absmax_bf16x2)
    m = _absmax_bf16x2(m, _swap_halves(m))
    s16, cb, s1, sinv = _norm_consts_words(m)
    lay: gl.constexpr = gl.SliceLayout(2, a3.type.layout)
    y3 = gl.inline_asm_elementwise(
        _ROUND_WORDS, "=r,r,r,r,r,r,r,r,r,r",
        [a3, gl.expand_dims(gl.convert_layout(s16, lay, assert_trivial=True), 2),
         gl.expand_dims(gl.convert_layout(cb, lay, assert_trivial=True), 2),
         gl.expand_dims(gl.convert_layout(s1, lay, assert_trivial=True), 2),
         gl.expand_dims(gl.convert_layout(sinv, lay, assert_trivial=True), 2)],
        dtype=gl.bfloat16, is_pure=True, pack=2)
    return gl.convert_layout(y3.reshape([BM, BK]), a.type.layout, assert_trivial=True)


@gluon.jit
def _mx_round_words_norm(w):
    """_mx_round_words with the "norm" constants (_norm_consts_words; the element step _ROUND_NORM): the tree's
    word (even / odd halves' maxima) is folded into both halves by one swap + max, then 9 ops give the four
    constants per block, against ~20 for the +-64 shift's."""
    m = _tree_absmax(w)
    m = _absmax_bf16x2(m, _swap_halves(m))
    s16, cb, s1, sinv = _norm_consts_words(m)
    return gl.inline_asm_elementwise(
        _ROUND_NORM, "=r,r,r,r,r,r",
        [w, gl.expand_dims(s16, 2), gl.expand_dims(cb, 2), gl.expand_dims(s1, 2), gl.expand_dims(sinv, 2)],
        dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _round_only_kernel(x_desc, y_desc, IMPL: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr):
    """y = the MX values of x (bf16 [M, K], one [BM, BK] tile per program), through the same shared-memory path as
    the GEMM's rounding partition: for the bitwise check against kosmos.quant."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    off_m = gl.program_id(0) * BM
    off_k = gl.program_id(1) * BK
    src = gl.allocate_shared_memory(x_desc.dtype, [BM, BK], x_desc.layout)
    dst = gl.allocate_shared_memory(y_desc.dtype, [BM, BK], y_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [off_m, off_k], bar, src)
    mbarrier.wait(bar, 0)
    xs = _round_load(src, IMPL, ROWS, num_warps)
    _round_write(_round_compute(xs, IMPL, ROWS, num_warps), dst, IMPL, ROWS)
    fence_async_shared()
    tma.async_copy_shared_to_global(y_desc, [off_m, off_k], dst)
    tma.store_wait(0)
    mbarrier.invalidate(bar)


@gluon.jit
def _round_only_dot_kernel(x_desc, y_desc, A_REGS: gl.constexpr, num_warps: gl.constexpr):
    """y = the MX values of x through the A_REGS rounding (1: _mx_round_dot, 2: _mx_round_dot_words) in wgmma's
    A-operand register layout, as the GEMM loads it (one [BM, BK] tile per program, num_warps = 8): the bitwise
    check of the in-register rounding."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, 256, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    off_m = gl.program_id(0) * BM
    off_k = gl.program_id(1) * BK
    src = gl.allocate_shared_memory(x_desc.dtype, [BM, BK], x_desc.layout)
    dst = gl.allocate_shared_memory(y_desc.dtype, [BM, BK], y_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [off_m, off_k], bar, src)
    mbarrier.wait(bar, 0)
    a = src.load(a_layout)
    if A_REGS == 1:
        y = _mx_round_dot(a)
    else:
        y = _mx_round_dot_words(a)
    dst.store(y)
    fence_async_shared()
    tma.async_copy_shared_to_global(y_desc, [off_m, off_k], dst)
    tma.store_wait(0)
    mbarrier.invalidate(bar)


# ============================================================================================ MX expansion of a tile
# The E4M3 payload of A (TMA'd into shared memory as it is) -> its bf16 values P * 2**(S - 127) in wgmma's
# A-operand registers, bit for bit kosmos.quant.dequantize_mx (module docstring, "gluon-mx-expand"). Both steps
# work on one k-pair of payload bytes ($1, 16 bits: element 2j in the low byte, 2j + 1 in the high one) and return
# its two bf16 values as one word ($0: 2j in the low half), the layout wgmma's register operand wants.
#
# EXPAND 1 ("cvt"), the block's multiplier 2**(S - 127) as fp32 in $2 (kosmos.quant.mx_scale_f32: S = 0 the fp32
# subnormal 2**-127, 0xFF NaN): E4M3x2 -> f16x2 in hardware (exact: every E4M3 value is an f16 normal or zero, and
# E4M3 NaN gives NaN), f16 -> f32 (exact), fp32 multiply (exact: an MX value has 4 significant bits and its lowest
# set bit is >= 2**-136, above fp32's subnormal grid 2**-149; a value >= 2**128 is inf, as dequantize_mx's), f32x2
# -> bf16x2 rounding to nearest even once (bf16 subnormals and underflow to +-0 exactly as dequantize_mx's integer
# rounding of the same fp32), then a signed 16-bit min with 0x7FC0: the hardware's canonical NaN 0x7FFF becomes
# dequantize_mx's 0x7FC0, and every other result (<= 0x7F80 or negative as an int16) is left alone.
# _EXPAND_CVT: kosmos.kernels.w1_mx_matmul._EXPAND_PAIR (imported above; the product keeps the one copy)
# EXPAND 2 ("bits"), no conversion instruction: the byte pair spread to two halves with each byte's sign replicated
# above it (prmt 0x9180), shifted left 4 and masked: S 0000 eeee mmm 0000 per half, which read as bf16 is the E4M3
# value times 2**-120 exactly (the E4M3 exponent field lands in the bottom of bf16's, so E4M3 subnormals become bf16
# subnormals with the same fraction). Then two bf16x2 multiplies by the block's M1 = 2**min(S - 7, 127) ($2) and
# M2 = 2**max(S - 134, 0) ($3), both normal: for S <= 134 the first rounds (bf16 subnormals, underflow to +-0) and the
# second is exact (times 1); for S > 134 the first is exact (v * 2**127, normal) and the second rounds (overflow to
# inf) -- one rounding to nearest even of the exact value either way. NaN: |v * 2**-120| > 448 * 2**-120 only for
# the E4M3 NaN byte; the block's threshold T ($4) is 448 * 2**-120 (bf16 0x07E0), or -1 for a NaN scale (every
# element above it), and the elements above it are replaced by 0x7FC0 (lop3 select).
_EXPAND_BITS = gl.constexpr("""{
        .reg .b32 x, a, t, m;
        cvt.u32.u16 x, $1;
        prmt.b32 a, x, 0, 0x9180;
        shl.b32 a, a, 4;
        and.b32 a, a, 0x87F087F0;
        abs.bf16x2 t, a;
        set.gt.u32.bf16x2 m, t, $4;
        mul.rn.bf16x2 a, a, $2;
        mul.rn.bf16x2 a, a, $3;
        lop3.b32 $0, m, a, 0x7FC07FC0, 0xAC;
        }""")
EXPANDS = {"cvt": 1, "bits": 2}  # A_REGS 4 / 5: the expansion's arithmetic (EXPAND = A_REGS - 3)


@gluon.jit
def _pair_view(buf):
    """An int16 view [BM, BK/2] of a uint8 payload tile [BM, BK] with a 64-byte-swizzled NVMMA layout (the TMA
    descriptor's for 64-byte rows): the same bytes, each int16 a k-pair (the swizzle moves 16-byte chunks)."""
    return buf._reinterpret(gl.int16, [buf.shape[0], buf.shape[1] // 2],
                            gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))


@gluon.jit
def _scale_view(box):
    """The k-major scale box uint8 [BK/32, BM] (TMA-written, no swizzle) as [BM, BK/32]: the same bytes through a
    plain row-major SwizzledSharedLayout, then permuted. (s23a: ``box.permute`` of the NVMMA layout itself loaded as
    if the bytes were [BM, BK/32] row-major -- the block-1 scale of row r read as row 2r + 1's, etc.)"""
    return box._reinterpret(gl.uint8, box.shape, gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])).permute((1, 0))


@gluon.jit
def _words_bf16(w):
    """int32 [R, C] words, each two bf16 (the low half the even element) -> bf16 [R, 2C] (free: a word is the
    register the pair occupies)."""
    lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [w], dtype=(gl.bfloat16, gl.bfloat16),
                                       is_pure=True, pack=1)
    return gl.join(lo, hi).reshape([w.shape[0], 2 * w.shape[1]])


@gluon.jit
def _mx_expand_dot(pairs, sc_smem, EXPAND: gl.constexpr):
    """The bf16 values [BM, BK] of an MX tile of A in wgmma's A-operand register layout (DotOperandLayout k_width
    2), from its payload k-pairs ``pairs`` (int16 [BM, BK/2] in DotOperandLayout k_width 1 -- the same thread and
    register for each pair: a thread holds 2 rows x 2 MX blocks x 4 pairs) and the E8M0 bytes of shared ``sc_smem``
    (uint8 [BM, BK/32], a permuted view of the k-major box: this k-step's blocks of the tile's rows; each thread
    loads its 4). EXPAND: 1 "cvt", 2
    "bits" (_EXPAND_CVT / _EXPAND_BITS)."""
    BM: gl.constexpr = pairs.shape[0]
    BK2: gl.constexpr = pairs.shape[1]
    p3 = pairs.reshape([BM, BK2 // 16, 16])
    sb = sc_smem.load(gl.SliceLayout(2, p3.type.layout)).to(gl.int32)
    if EXPAND == 1:
        w3 = gl.inline_asm_elementwise(_EXPAND_CVT, "=r,h,r", [p3, gl.expand_dims(mx_scale_f32(sb), 2)],
                                       dtype=gl.int32, is_pure=True, pack=1)
    else:
        m1 = (gl.minimum(sb, 134) + 120) * 0x00800080              # bf16 2**min(S - 7, 127), both halves
        m2 = (gl.maximum(sb, 134) - 7) * 0x00800080                # bf16 2**max(S - 134, 0)
        th = gl.where(sb == 255, -0x40804080, 0x07E007E0)          # bf16 -1 (0xBF80), or 448 * 2**-120
        w3 = gl.inline_asm_elementwise(_EXPAND_BITS, "=r,h,r,r,r",
                                       [p3, gl.expand_dims(m1, 2), gl.expand_dims(m2, 2), gl.expand_dims(th, 2)],
                                       dtype=gl.int32, is_pure=True, pack=1)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=pairs.type.layout.parent, k_width=2)
    return gl.convert_layout(_words_bf16(w3.reshape([BM, BK2])), a_layout, assert_trivial=True)


@gluon.jit
def _expand_only_kernel(p_desc, s_desc, y_desc, EXPAND: gl.constexpr, num_warps: gl.constexpr):
    """y = dequantize_mx(payload, scales) through the GEMM's expansion (one [BM, BK] tile per program, num_warps
    = 8): the payload tile and the k-major scale box [BK/32, BM] TMA'd into shared memory as
    the GEMM does, the pairs loaded into wgmma's A-operand layout, _mx_expand_dot, stored: the bitwise check."""
    BM: gl.constexpr = p_desc.block_type.shape[0]
    BK: gl.constexpr = p_desc.block_type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, 256, 16])
    w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)
    off_m = gl.program_id(0) * BM
    off_k = gl.program_id(1) * BK
    src = gl.allocate_shared_memory(p_desc.dtype, [BM, BK], p_desc.layout)
    sc = gl.allocate_shared_memory(s_desc.dtype, s_desc.block_type.shape, s_desc.layout)
    dst = gl.allocate_shared_memory(y_desc.dtype, [BM, BK], y_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, p_desc.block_type.nbytes + s_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(p_desc, [off_m, off_k], bar, src)
    tma.async_copy_global_to_shared(s_desc, [off_k // 32, off_m], bar, sc)
    mbarrier.wait(bar, 0)
    y = _mx_expand_dot(_pair_view(src).load(w_layout), _scale_view(sc), EXPAND)
    dst.store(y)
    fence_async_shared()
    tma.async_copy_shared_to_global(y_desc, [off_m, off_k], dst)
    tma.store_wait(0)
    mbarrier.invalidate(bar)


# ============================================================================================ the GEMM's partitions
@gluon.jit
def _clock():
    """The SM's cycle counter (PROF builds: where each partition's k-step goes)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _first_step(M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """A load cursor at this program's first k-step: (k index, tile id, off_m, off_n). Tiles are dealt round-robin
    (program p takes tiles p, p + nprog, ...); the cursor walks their k-steps in order."""
    t = gl.program_id(0)
    pid_m, pid_n = _grouped_tile(t, gl.cdiv(M, BM), gl.cdiv(N, BN), GROUP_M)
    return 0, t, pid_m * BM, pid_n * BN


@gluon.jit
def _next_step(ki, t, off_m, off_n, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
               GROUP_M: gl.constexpr):
    """The cursor one k-step on (the tile coordinates are recomputed only when the tile changes: the divisions
    of _grouped_tile would cost ~100 instructions per k-step in every warp that loads)."""
    ki += 1
    if ki == gl.cdiv(K, BK):
        ki = 0
        t += gl.num_programs(0)
        pid_m, pid_n = _grouped_tile(t, gl.cdiv(M, BM), gl.cdiv(N, BN), GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
    return ki, t, off_m, off_n


@gluon.jit
def _issue_loads(s, ki, t, off_m, off_n, a_desc, b_desc, a_bufs, b_bufs, b_ready, M, N, LOAD_A: gl.constexpr,
                 B_KMAJOR: gl.constexpr, s_desc, s_bufs, LOAD_S: gl.constexpr, flags, target, K,
                 ROW_PASS: gl.constexpr, KC: gl.constexpr, rows_ok):
    """TMA loads of the cursor's k-step into MMA-ring slot s: B, and A too when ``LOAD_A`` (the plain build; the
    MX payload in the expand builds), and with ``LOAD_S`` the k-major scale box [BK/32, BM] of the k-step's blocks
    and the tile's rows; ``b_ready`` completes when the bytes have
    landed. None past the last tile. ROW_PASS: A's rows are written by the row-pass partitions (w1_mx_matmul._row_pass). At a
    tile's first k-step one acquire of the row block's total (``flags[rb, K / KC]``) says whether all of its parts
    are written (``rows_ok``, returned: the tile's later chunks need no check); while not, each KC-column chunk's
    first k-step waits for that (row block, chunk)'s count. (s23b: a wait per chunk -- an atomic round trip every 8
    k-steps -- cost the MMA loop ~40 cycles per k-step.) Returns ``rows_ok``."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    if B_KMAJOR:
        BN: gl.constexpr = b_desc.block_type.shape[0]
    else:
        BN: gl.constexpr = b_desc.block_type.shape[1]
    exists = t < gl.cdiv(M, BM) * gl.cdiv(N, BN)
    off_k = ki * BK
    if ROW_PASS:
        if exists & (off_k % KC == 0):
            row = flags + 1 + (off_m // BM) * (K // KC + 1)  # the product's count layout (w1_mx_matmul)
            if off_k == 0:
                rows_ok = (gl.atomic_add(row + K // KC, 0, sem="acquire", scope="gpu") >= target * (K // KC)).to(
                    gl.int32)
                if rows_ok != 0:
                    _proxy_fence()
            if rows_ok == 0:
                _wait_rows(row + off_k // KC, target)
    bar = b_ready.index(s)
    if LOAD_S:
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes + s_desc.block_type.nbytes,
                        pred=exists)
        tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_bufs.index(s), pred=exists)
        tma.async_copy_global_to_shared(s_desc, [off_k // 32, off_m], bar, s_bufs.index(s), pred=exists)
    elif LOAD_A:
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=exists)
        tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_bufs.index(s), pred=exists)
    else:
        mbarrier.expect(bar, b_desc.block_type.nbytes, pred=exists)
    if B_KMAJOR:
        tma.async_copy_global_to_shared(b_desc, [off_n, off_k], bar, b_bufs.index(s), pred=exists)
    else:
        tma.async_copy_global_to_shared(b_desc, [off_k, off_n], bar, b_bufs.index(s), pred=exists)
    return rows_ok


@gluon.jit
def _issue_raw(r, ki, t, off_m, a_desc, raw, raw_ready, M, N, BN: gl.constexpr):
    """TMA load of the cursor's bf16 A tile into raw slot r (``raw_ready``); none past the last tile."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    exists = t < gl.cdiv(M, BM) * gl.cdiv(N, BN)
    mbarrier.expect(raw_ready.index(r), a_desc.block_type.nbytes, pred=exists)
    tma.async_copy_global_to_shared(a_desc, [off_m, ki * BK], raw_ready.index(r), raw.index(r), pred=exists)


@gluon.jit
def _wait_rows(flag, target):
    """Spin until the row-pass count at ``flag`` reaches ``target`` (gpu-scope acquire), then the proxy fence: the
    rows were written by generic stores of other SMs and are read next by TMA."""
    v = _acquire(flag)
    while v < target:
        v = _acquire(flag)
    _proxy_fence()


@gluon.jit
def _num_steps(M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """(k-steps per tile, this program's k-steps over all its tiles)."""
    num_tiles = gl.cdiv(M, BM) * gl.cdiv(N, BN)
    my_tiles = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))
    k_steps = gl.cdiv(K, BK)
    return k_steps, my_tiles * k_steps


@gluon.jit
def _round_partition(a_desc, raw, raw_ready, a_bufs, a_ready, a_done, M, N, K, IMPL: gl.constexpr,
                     ROWS: gl.constexpr, WARPS: gl.constexpr, GROUP_M: gl.constexpr, BN: gl.constexpr,
                     prof, PROF: gl.constexpr):
    """The rounding partition (WARPS warps), ROUND_MX only. It owns the raw A ring (R slots): loads R k-steps
    ahead, and refills a slot as soon as its registers hold the tile. Per k-step g: wait ``raw_ready``; raw bf16 A
    tile -> registers; refill the slot with step g + R; round to MX values; wait until the MMA that last read
    rounded slot g % SA is done (``a_done``); store; fence (generic -> async proxy); arrive ``a_ready``."""
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    SA: gl.constexpr = a_bufs.shape[0]
    R: gl.constexpr = raw.shape[0]
    k_steps, total = _num_steps(M, N, K, BM, BN, BK)
    ki, t, off_m, off_n = _first_step(M, N, BM, BN, GROUP_M)
    for g in gl.static_range(R):
        _issue_raw(g, ki, t, off_m, a_desc, raw, raw_ready, M, N, BN)
        ki, t, off_m, off_n = _next_step(ki, t, off_m, off_n, M, N, K, BM, BN, BK, GROUP_M)
    if PROF:  # cycles: raw wait, loads + refill, rounding, a_done wait, stores + fence + arrive, whole k-step
        q0 = _clock() * 0
        q1 = q0
        q2 = q0
        q3 = q0
        q4 = q0
        q5 = q0
    for it in range(total):
        if PROF:
            c0 = _clock()
        r = it % R
        mbarrier.wait(raw_ready.index(r), (it // R) & 1)
        if PROF:
            c1 = _clock()
        xs = _round_load(raw.index(r), IMPL, ROWS, WARPS)
        fence_async_shared()  # our generic reads of the slot before the async-proxy (TMA) write that refills it
        gl.thread_barrier()   # ... of all WARPS warps
        _issue_raw(r, ki, t, off_m, a_desc, raw, raw_ready, M, N, BN)  # k-step it + R
        ki, t, off_m, off_n = _next_step(ki, t, off_m, off_n, M, N, K, BM, BN, BK, GROUP_M)
        if PROF:
            c2 = _clock()
        ys = _round_compute(xs, IMPL, ROWS, WARPS)  # before the wait: overlaps the MMA of the slot's last step
        sa = it % SA
        if PROF:
            c3 = _clock()
        mbarrier.wait(a_done.index(sa), ((it // SA) & 1) ^ 1)
        if PROF:
            c4 = _clock()
        _round_write(ys, a_bufs.index(sa), IMPL, ROWS)
        fence_async_shared()  # our generic writes before the wgmma's async-proxy reads
        mbarrier.arrive(a_ready.index(sa))
        if PROF:
            c5 = _clock()
            q0 += c1 - c0
            q1 += c2 - c1
            q2 += c3 - c2
            q3 += c4 - c3
            q4 += c5 - c4
            q5 += c5 - c0
    if PROF:
        base = prof + gl.program_id(0) * 16
        gl.store(base + 8, total.to(gl.int64))
        gl.store(base + 9, q0)
        gl.store(base + 10, q1)
        gl.store(base + 11, q2)
        gl.store(base + 12, q3)
        gl.store(base + 13, q4)
        gl.store(base + 14, q5)


@gluon.jit
def _mma_partition(a_desc, b_desc, c_desc, a_bufs, b_bufs, b_ready, a_ready, a_done, c_smem, M, N, K,
                   ROUND_MX: gl.constexpr, B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr,
                   num_warps: gl.constexpr, A_REGS: gl.constexpr, prof, PROF: gl.constexpr, s_desc, s_bufs, flags,
                   target, ROW_PASS: gl.constexpr, KC: gl.constexpr):
    """The MMA warps (num_warps = 8: two warpgroups of 64 rows each). Owns the B ring (SB slots; plain and A_REGS:
    the A+B ring) and loads SB - 1 k-steps ahead. A_REGS (1, 2: round; 3: copy; 4, 5: expand an MX A -- payload
    and scale box in the ring beside B, _mx_expand_dot with EXPAND = A_REGS - 3): A goes shared -> registers
    (wgmma's A-operand layout) -> rounding -> wgmma from registers, the k-loop unrolled twice so that consecutive
    k-steps use distinct registers (module docstring, s22: the A-register hazard). Per k-step g: wait ``b_ready`` (and ``a_ready``, ROUND_MX); async wgmma
    on (A slot, B slot); wait until one wgmma group is in flight, i.e. step g - 1's is done; release step g - 1:
    ``a_done`` (ROUND_MX) and the refill of its B slot with step g - 1 + SB. Epilogue per tile: fp32 accumulator
    -> bf16 -> c_smem in BN / EPI_N column pieces -> TMA stores (waited for before the piece buffer is reused)."""
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    SA: gl.constexpr = a_bufs.shape[0]
    SB: gl.constexpr = b_bufs.shape[0]
    EPI_N: gl.constexpr = c_smem.shape[1]
    if B_KMAJOR:
        BN: gl.constexpr = b_bufs.shape[1]
    else:
        BN: gl.constexpr = b_bufs.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    k_steps, total = _num_steps(M, N, K, BM, BN, BK)
    lk, lt, l_m, l_n = _first_step(M, N, BM, BN, GROUP_M)  # the load cursor, SB - 1 k-steps ahead
    LOAD_S: gl.constexpr = A_REGS >= 4
    rows_ok = gl.to_tensor(0)  # ROW_PASS: the load cursor's row block fully written (_issue_loads)
    for g in gl.static_range(SB - 1):
        rows_ok = _issue_loads(g, lk, lt, l_m, l_n, a_desc, b_desc, a_bufs, b_bufs, b_ready, M, N, not ROUND_MX,
                               B_KMAJOR, s_desc, s_bufs, LOAD_S, flags, target, K, ROW_PASS, KC, rows_ok)
        lk, lt, l_m, l_n = _next_step(lk, lt, l_m, l_n, M, N, K, BM, BN, BK, GROUP_M)
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)  # payload k-pairs
    UNROLL: gl.constexpr = 2 if A_REGS else 1
    it = 0
    if PROF:  # cycles: b_ready/a_ready waits, A_REGS rounding, wgmma_wait(1), barrier + refill, whole k-step
        p0 = _clock() * 0
        p1 = p0
        p2 = p0
        p3 = p0
        p4 = p0
    for tile in range(total // k_steps):
        pid_m, pid_n = _grouped_tile(gl.program_id(0) + tile * gl.num_programs(0), gl.cdiv(M, BM), gl.cdiv(N, BN),
                                    GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        for kk in range(k_steps // UNROLL):
            for h in gl.static_range(UNROLL):  # A_REGS: two register sets, alternating (see _mx_round_dot)
                ki = kk * UNROLL + h
                if PROF:
                    c0 = _clock()
                s = it % SB
                mbarrier.wait(b_ready.index(s), (it // SB) & 1)
                if ROUND_MX:
                    sa = it % SA
                    mbarrier.wait(a_ready.index(sa), (it // SA) & 1)
                    a = a_bufs.index(sa)
                else:
                    a = a_bufs.index(s)
                if PROF:
                    c1 = _clock()
                if A_REGS == 1:
                    a = _mx_round_dot(a.load(a_layout))
                elif A_REGS == 2:
                    a = _mx_round_dot_words(a.load(a_layout))
                elif A_REGS == 3:  # "rs-copy": the register path without rounding (a diagnostic)
                    a = a.load(a_layout)
                elif A_REGS >= 4:  # "mx-expand": the MX payload and its scales -> bf16 values
                    a = _mx_expand_dot(_pair_view(a).load(w_layout), _scale_view(s_bufs.index(s)), A_REGS - 3)
                b = b_bufs.index(s)
                if B_KMAJOR:
                    b = b.permute((1, 0))
                if PROF:
                    c2 = _clock()
                acc = warpgroup_mma(a, b, acc, use_acc=ki > 0, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc, ))
                if PROF:
                    c3 = _clock()
                gl.thread_barrier()  # both warpgroups' step it - 1 is done
                if ROUND_MX:  # (the tile's last step is released after the loop)
                    mbarrier.arrive(a_done.index((it + SA - 1) % SA), pred=ki > 0)
                rows_ok = _issue_loads((it + SB - 1) % SB, lk, lt, l_m, l_n, a_desc, b_desc, a_bufs, b_bufs, b_ready,
                                       M, N, not ROUND_MX, B_KMAJOR, s_desc, s_bufs, LOAD_S, flags, target, K,
                                       ROW_PASS, KC, rows_ok)  # k-step it + SB - 1, into the slot
                #                                                             step it - 1 has left
                lk, lt, l_m, l_n = _next_step(lk, lt, l_m, l_n, M, N, K, BM, BN, BK, GROUP_M)
                it += 1
                if PROF:
                    c4 = _clock()
                    p0 += c1 - c0
                    p1 += c2 - c1
                    p2 += c3 - c2
                    p3 += c4 - c3
                    p4 += c4 - c0
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        gl.thread_barrier()
        if ROUND_MX:
            mbarrier.arrive(a_done.index((it + SA - 1) % SA))
        _store_tile(acc, c_desc, c_smem, off_m, off_n)
    tma.store_wait(0)
    if PROF:
        base = prof + gl.program_id(0) * 16
        gl.store(base, total.to(gl.int64))
        gl.store(base + 1, p0)
        gl.store(base + 2, p1)
        gl.store(base + 3, p2)
        gl.store(base + 4, p3)
        gl.store(base + 5, p4)


@gluon.jit
def _gemm_kernel(a_desc, b_desc, c_desc, s_desc, M, N, K, prof, src, src_scales, dst, flags, target,
                 ROUND_MX: gl.constexpr, IMPL: gl.constexpr, B_KMAJOR: gl.constexpr, STAGES: gl.constexpr,
                 A_STAGES: gl.constexpr, RAW_STAGES: gl.constexpr, GROUP_M: gl.constexpr, ROUND_ROWS: gl.constexpr,
                 ROUND_WARPS: gl.constexpr,
                 ROUND_REGS: gl.constexpr, num_warps: gl.constexpr, A_REGS: gl.constexpr = 0,
                 PROF: gl.constexpr = False, ROW_PASS: gl.constexpr = False, KC: gl.constexpr = 512):
    """C [M, N] = A [M, K] @ B (bf16, fp32 accumulation), persistent (module docstring). Plain: one partition
    (the MMA warps load A and B themselves). ROUND_MX: warp_specialize([MMA warps, ROUND_WARPS rounding warps]).
    A_REGS 4, 5: A is MX (``a_desc`` its uint8 payload, ``s_desc`` its scale bytes; other builds pass a_desc
    there, unused), expanded in registers. ROW_PASS: warp_specialize([MMA warps, ROUND_WARPS row-pass warps]):
    the row pass rounds ``src`` (bf16 A as int32 words) to its MX values into ``dst``, which ``a_desc`` reads, once
    per [ROUND_ROWS, KC] part, counting the parts of each (row block, KC chunk) in ``flags`` (release); the MMA
    warps run the plain mainloop and wait for ``target`` parts before a chunk's first TMA load (module
    docstring, s23). ROW_PASS 2: the pass expands an MX A instead (``src`` its payload as int16 k-pairs,
    ``src_scales`` its public [M, K/32] scale bytes), with the "cvt" arithmetic."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    if B_KMAJOR:
        BN: gl.constexpr = b_desc.block_type.shape[0]
    else:
        BN: gl.constexpr = b_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(b_ready.index(i), count=1)
    if ROUND_MX and not A_REGS:
        a_bufs = gl.allocate_shared_memory(dtype, [A_STAGES, BM, BK], a_desc.layout)
        raw = gl.allocate_shared_memory(dtype, [RAW_STAGES, BM, BK], a_desc.layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
        a_done = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
        raw_ready = gl.allocate_shared_memory(gl.int64, [RAW_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(A_STAGES):
            mbarrier.init(a_ready.index(i), count=1)
            mbarrier.init(a_done.index(i), count=1)
        for i in gl.static_range(RAW_STAGES):
            mbarrier.init(raw_ready.index(i), count=1)
        gl.warp_specialize([
            (_mma_partition, (a_desc, b_desc, c_desc, a_bufs, b_bufs, b_ready, a_ready, a_done, c_smem, M, N, K,
                              ROUND_MX, B_KMAJOR, GROUP_M, num_warps, 0, prof, PROF, a_desc, a_bufs, flags,
                              target, False, KC)),
            (_round_partition, (a_desc, raw, raw_ready, a_bufs, a_ready, a_done, M, N, K, IMPL, ROUND_ROWS,
                                ROUND_WARPS, GROUP_M, BN, prof, PROF)),
        ], [ROUND_WARPS], [ROUND_REGS])
    elif ROW_PASS:
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
        gl.warp_specialize([
            (_mma_partition, (a_desc, b_desc, c_desc, a_bufs, b_bufs, b_ready, b_ready, b_ready, c_smem, M, N, K,
                              False, B_KMAJOR, GROUP_M, num_warps, 0, prof, PROF, a_desc, a_bufs, flags, target,
                              True, KC)),
            (_product_row_pass, (src, src_scales, dst, flags, M, K, ROW_PASS, ROUND_WARPS)),
        ], [ROUND_WARPS], [ROUND_REGS])
    else:
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
        if A_REGS >= 4:  # the MX scale boxes, one per ring slot
            s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
        else:
            s_bufs = a_bufs
        _mma_partition(a_desc, b_desc, c_desc, a_bufs, b_bufs, b_ready, b_ready, b_ready, c_smem, M, N, K, False,
                       B_KMAJOR, GROUP_M, num_warps, A_REGS, prof, PROF, s_desc, s_bufs, flags, target, False, KC)


# ============================================================================================ host side
BM, BN, BK = 128, 256, 64
LLAMA_SHAPES = {  # llama3-70b TP=2 per-rank GEMMs (M tokens, N out, K in)
    **{f"{name}-{m // 1024}k": (m, n, k) for m in (4096, 8192)
       for name, n, k in (("qkv", 5120, 8192), ("fc1", 28672, 8192), ("attn_out", 8192, 4096),
                          ("fc2", 8192, 14336))},
}
# The Gluon builds: name -> (ref: what C is compared with -- the matmul of A ("bf16") or of A's MX values ("mx");
# kw: gemm_launch's keywords). A_REGS 1/2: A rounded in wgmma's register operand by the MMA warps themselves (no
# rounding partition); "copy" builds round nothing: the MX builds' data paths carrying plain A (diagnostics).
BUILDS = {
    "gluon": dict(ref="bf16", kw=dict(round_mx=False)),
    "gluon-mx-packed": dict(ref="mx", kw=dict(round_mx=True, impl="packed")),
    "gluon-mx-kosmos": dict(ref="mx", kw=dict(round_mx=True, impl="kosmos")),
    "gluon-mx-ws-norm": dict(ref="mx", kw=dict(round_mx=True, impl="norm")),
    "gluon-ws-copy": dict(ref="bf16", kw=dict(round_mx=True, impl="copy")),
    "gluon-mx-rs": dict(ref="mx", kw=dict(round_mx=True, A_REGS=2)),
    "gluon-mx-rs1": dict(ref="mx", kw=dict(round_mx=True, A_REGS=1)),
    "gluon-rs-copy": dict(ref="bf16", kw=dict(round_mx=False, A_REGS=3)),
    # A given in MX form (kosmos.quant.quantize_mx's payload + scales, the public layout), expanded in registers
    "gluon-mx-expand": dict(ref="mx", a="mx", kw=dict(round_mx=False, A_REGS=4)),
    "gluon-mx-expand-bits": dict(ref="mx", a="mx", kw=dict(round_mx=False, A_REGS=5)),
    # bf16 A rounded to its MX values once per [16, 512] part by a row-pass partition, the plain mainloop (s23)
    "gluon-mx-rowpass": dict(ref="mx", kw=dict(round_mx=False, ROW_PASS=1)),
    # an MX A (public layout) expanded to bf16 once per [16, 512] part by the row pass, the plain mainloop (s23)
    "gluon-mx-expandpass": dict(ref="mx", a="mx", kw=dict(round_mx=False, ROW_PASS=2)),
}
# Not a build: a row timing quantize_mx(A) (bf16 -> MX, kosmos.quant's kernel) followed by the expand GEMM.
QUANTIZE_PLUS = {"quantize+gluon-mx-expand": "gluon-mx-expand",
                 "quantize+gluon-mx-expandpass": "gluon-mx-expandpass"}
VARIANTS = ("torch", ) + tuple(BUILDS) + tuple(QUANTIZE_PLUS)
DEFAULT_VARIANTS = ("torch", "gluon", "gluon-mx-packed", "gluon-ws-copy", "gluon-mx-ws-norm", "gluon-rs-copy",
                    "gluon-mx-rs", "gluon-mx-expand", "gluon-mx-expand-bits", "quantize+gluon-mx-expand")
# The expand run (module docstring, "gluon-mx-expand"): plain, the register path, the two expansions, the op from bf16
EXPAND_VARIANTS = ("torch", "gluon", "gluon-rs-copy", "gluon-mx-expand", "gluon-mx-expand-bits",
                   "quantize+gluon-mx-expand")
# The row-pass run (module docstring, s23): plain, the op from bf16 with the row pass, the expand op from bf16
ROWPASS_VARIANTS = ("torch", "gluon", "gluon-mx-rowpass", "gluon-mx-expandpass", "quantize+gluon-mx-expandpass")


OVERRIDES: dict = {}  # --config KEY=VALUE,...: applied to every Gluon GEMM build of the run


def config(round_mx: bool, impl: str = "packed", **over) -> dict:
    """Launch parameters of one build. Plain: 8 warps, one partition, 4 stages of A+B (192 KiB) + a 128x64 C piece
    (16 KiB). ROUND_MX: 12 warps (MMA 8 + rounding 4), 4 B stages (128 KiB), 2 rounded-A stages (32 KiB), 3 raw-A
    stages (48 KiB), the C piece (16 KiB): 224 KiB of the 227. maxnreg: registers per thread at launch, 64K /
    threads (ptxas allocates every partition within it: module docstring); ROUND_REGS: the rounding partition's
    setmaxnreg budget, the MMA partition gets the rest. A_REGS (1, 2, 3): the plain build's shape (8 warps, one
    partition, the A+B ring), A through registers (BUILDS); A_REGS 4, 5 (MX A): the same with 4 stages of payload
    (8 KiB) + scale box (256 B) + B (32 KiB) = 161 KiB + the C piece: 177 KiB."""
    cfg = dict(STAGES=4, A_STAGES=2, RAW_STAGES=3, EPI_N=64, GROUP_M=8, ROUND_ROWS=64, ROUND_WARPS=4,
               ROUND_REGS=128 if impl == "kosmos" else 104, num_warps=8, A_REGS=0, ROW_PASS=0, KC=512)
    if over.get("ROW_PASS"):
        cfg["ROUND_ROWS"] = 16  # the row pass's part: [16, KC]
    cfg.update(OVERRIDES)
    cfg.update(over)
    warps = cfg["num_warps"] + (cfg["ROUND_WARPS"] if (round_mx and not cfg["A_REGS"]) or cfg["ROW_PASS"] else 0)
    cfg.setdefault("maxnreg", min(255, 65536 // (32 * warps)) // 8 * 8)
    return cfg


def _nvmma(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


_PROF_DUMMY: dict = {}


def gemm_launch(a, b, c, *, round_mx: bool, impl: str = "packed", b_kmajor: bool = True, num_sms: int = 132,
                prof=None, **over):
    """(kernel, grid, args, kwargs) of C = A @ B: ``a`` bf16 [M, K] (A_REGS 4, 5: an MX A, kosmos.quant's
    (payload float8_e4m3fn [M, K], k-major scales uint8 [K/32, M]): ``mx_a``), ``b`` the weight bf16 [N, K]
    (``b_kmajor``) or [K, N], ``c`` bf16 [M, N]; M, N, K multiples of 128, 256, 64."""
    cfg = config(round_mx, impl, **over)
    mx = cfg["A_REGS"] >= 4 or cfg["ROW_PASS"] == 2
    if mx != isinstance(a, tuple):
        raise ValueError("A_REGS 4, 5 take an MX A (payload, scales); the other builds a bf16 tensor")
    m, k = a[0].shape if mx else a.shape
    n = b.shape[0] if b_kmajor else b.shape[1]
    if m % BM or n % BN or k % (2 * BK if cfg["A_REGS"] else BK):
        raise ValueError(f"M, N, K = {m}, {n}, {k}: the probe needs multiples of {BM}, {BN}, {BK} (A_REGS builds: K "
                         f"of {2 * BK}, their k-loop is unrolled twice)")
    b_block = [BN, BK] if b_kmajor else [BK, BN]
    src = src_scales = dst = flags = _dummy_i32(a[0].device if mx else a.device)
    target = 0
    if cfg["ROW_PASS"]:
        if k % cfg["KC"] or BM % cfg["ROUND_ROWS"]:
            raise ValueError(f"K = {k}: the row pass needs K % {cfg['KC']} == 0")
        rp = _row_pass_state(a, cfg["KC"])
        if (cfg["KC"], cfg["ROUND_ROWS"]) != (KC_PRODUCT, PART_ROWS_PRODUCT):
            raise ValueError(f"the row pass is kosmos.kernels.w1_mx_matmul's: parts [{PART_ROWS_PRODUCT}, "
                             f"{KC_PRODUCT}], not [{cfg['ROUND_ROWS']}, {cfg['KC']}]")
        src, src_scales = (a[0], a[1]) if mx else (a, a)  # the payload and the public scales, or bf16 A
        dst, flags = rp["dst"], rp["flags"]
        target = (rp["epoch"] + 1) * (BM // cfg["ROUND_ROWS"])  # gluon_matmul commits the epoch once launched
        a, mx = dst, False
    if mx:
        a_desc, s_desc = mx_descs(*a)
        a = a[0]
    else:
        a_desc = s_desc = TensorDescriptor.from_tensor(a, [BM, BK], _nvmma([BM, BK]))
    b_desc = TensorDescriptor.from_tensor(b, b_block, _nvmma(b_block))
    c_desc = TensorDescriptor.from_tensor(c, [BM, cfg["EPI_N"]], _nvmma([BM, cfg["EPI_N"]]))
    grid = (min(num_sms, (m // BM) * (n // BN)), )
    if prof is None:  # PROF builds: int64 [grid, 16] per-program cycle sums (profile_shape)
        if a.device not in _PROF_DUMMY:
            _PROF_DUMMY[a.device] = torch.zeros(1, dtype=torch.int64, device=a.device)
        prof = _PROF_DUMMY[a.device]
    kw = dict(PROF=prof.numel() > 1, ROUND_MX=round_mx, IMPL=IMPLS[impl], B_KMAJOR=b_kmajor, STAGES=cfg["STAGES"],
              A_STAGES=cfg["A_STAGES"], RAW_STAGES=cfg["RAW_STAGES"], GROUP_M=cfg["GROUP_M"],
              ROUND_ROWS=cfg["ROUND_ROWS"], ROUND_WARPS=cfg["ROUND_WARPS"], ROUND_REGS=cfg["ROUND_REGS"],
              num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"], A_REGS=cfg["A_REGS"])
    kw.update(ROW_PASS=int(cfg["ROW_PASS"]), KC=cfg["KC"])
    return _gemm_kernel, grid, (a_desc, b_desc, c_desc, s_desc, m, n, k, prof, src, src_scales, dst, flags,
                                target), kw


_SMS: dict = {}
_ROW_PASS: dict = {}  # (device, M, K, KC) -> the row pass's output buffer, its counts and the launches' epoch
_DUMMY_I32: dict = {}


def _dummy_i32(device):
    if device not in _DUMMY_I32:
        _DUMMY_I32[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _DUMMY_I32[device]


def _row_pass_state(a, kc):
    """The ROW_PASS workspace of A's shape: ``dst`` bf16 [M, K] (A's MX values, written by the row pass, read by
    the MMA's TMA), ``flags`` int32 [1 + M / BM * (K / KC + 1)] (w1_mx_matmul's layout: one slot the probe leaves
    unused, then the parts written per chunk and per row block; never reset: launch e waits for e times the
    parts) and ``epoch`` (launches done)."""
    a = a[0] if isinstance(a, tuple) else a
    key = (a.device, a.shape[0], a.shape[1], kc)
    if key not in _ROW_PASS:
        _ROW_PASS[key] = dict(dst=torch.empty(a.shape, dtype=torch.bfloat16, device=a.device), epoch=0,
                              flags=torch.zeros(1 + (a.shape[0] // BM) * (a.shape[1] // kc + 1), dtype=torch.int32,
                                                device=a.device))
    return _ROW_PASS[key]


def _num_sms(device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def gluon_matmul(a, b, *, round_mx=False, impl="packed", b_kmajor=True, out=None, **over):
    """C = A @ B^T (b [N, K]) or A @ B (b [K, N], b_kmajor=False), bf16 out, with A rounded to its MX values in the
    mainloop when ``round_mx``; ``a`` an MX (payload, scales) for the expand builds (A_REGS 4, 5)."""
    n = b.shape[0] if b_kmajor else b.shape[1]
    a0 = a[0] if isinstance(a, tuple) else a
    c = torch.empty(a0.shape[0], n, dtype=torch.bfloat16, device=a0.device) if out is None else out
    kernel, grid, args, kw = gemm_launch(a, b, c, round_mx=round_mx, impl=impl, b_kmajor=b_kmajor,
                                         num_sms=_num_sms(a0.device), **over)
    kernel[grid](*args, **kw)
    if kw["ROW_PASS"]:
        _row_pass_state(a, kw["KC"])["epoch"] += 1
    return c


def round_launch(x, y, impl: str):
    """(kernel, grid, args, kwargs) of the rounding-only kernel y = MX values of x (bf16 [M, K])."""
    d = [TensorDescriptor.from_tensor(t, [BM, BK], _nvmma([BM, BK])) for t in (x, y)]
    return _round_only_kernel, (x.shape[0] // BM, x.shape[1] // BK), tuple(d), dict(IMPL=IMPLS[impl], ROWS=64,
                                                                                     num_warps=4)


def round_dot_launch(x, y, a_regs: int):
    """(kernel, grid, args, kwargs) of the in-register rounding-only kernel (A_REGS 1 or 2)."""
    d = [TensorDescriptor.from_tensor(t, [BM, BK], _nvmma([BM, BK])) for t in (x, y)]
    return _round_only_dot_kernel, (x.shape[0] // BM, x.shape[1] // BK), tuple(d), dict(A_REGS=a_regs,
                                                                                         num_warps=8)


def _u8(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def mx_input(build, q):
    """The MX A a build takes, from kosmos.quant's (payload, scales): mx_a's k-major scales for the register
    expansion (A_REGS 4, 5), the public layout as it is for the expand pass (ROW_PASS 2)."""
    return tuple(q) if BUILDS[build]["kw"].get("ROW_PASS") else mx_a(q)


def mx_a(q):
    """The probe's MX A from kosmos.quant's (payload [M, K], scales [M, K/32]): (payload, scales_t [K/32, M]), the
    scale bytes k-major so that a k-step's box [BK/32, BM] starts at column off_m (16-byte aligned: a tiled TMA
    box must start 16-byte aligned in its inner dimension -- s22c's illegal instruction was the [BM, 16] box of
    the public layout starting at byte 2 * k-step)."""
    payload, scales = q
    return payload, _u8(scales).t().contiguous()


def mx_descs(payload, scales_t):
    """TMA descriptors of the probe's MX A (``mx_a``): the payload bytes [M, K] in [BM, BK] tiles (64-byte rows,
    64-byte swizzle), the k-major scale bytes [K/32, M] in [BK/32, BM] boxes (no swizzle; TMA needs the row
    stride, M bytes, to be a multiple of 16, and the box starts at off_m, a multiple of BM)."""
    p, s = _u8(payload), _u8(scales_t)
    if s.shape != (p.shape[1] // 32, p.shape[0]) or p.shape[0] % 16:
        raise ValueError(f"scales_t {tuple(s.shape)} for payload {tuple(p.shape)}: the MX builds take mx_a's "
                         f"k-major scales [K/32, M] with M % 16 == 0 (TMA's 16-byte row stride)")
    p_desc = TensorDescriptor.from_tensor(p, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.uint8))
    s_desc = TensorDescriptor.from_tensor(s, [BK // 32, BM], gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                                                 element_bitwidth=8, rank=2))
    return p_desc, s_desc


def expand_launch(payload, scales_t, y, expand: str = "cvt"):
    """(kernel, grid, args, kwargs) of the expansion-only kernel y = dequantize_mx(payload, scales) (bf16);
    ``scales_t``: mx_a's k-major scales."""
    p_desc, s_desc = mx_descs(payload, scales_t)
    y_desc = TensorDescriptor.from_tensor(y, [BM, BK], _nvmma([BM, BK]))
    return _expand_only_kernel, (y.shape[0] // BM, y.shape[1] // BK), (p_desc, s_desc, y_desc), dict(
        EXPAND=EXPANDS[expand], num_warps=8)


def gluon_mx_expand(payload, scales, expand="cvt"):
    y = torch.empty(payload.shape, dtype=torch.bfloat16, device=payload.device)
    kernel, grid, args, kw = expand_launch(*mx_a((payload, scales)), y, expand)
    kernel[grid](*args, **kw)
    return y


def gluon_mx_round(x, impl="packed", a_regs=0):
    y = torch.empty_like(x)
    kernel, grid, args, kw = round_dot_launch(x, y, a_regs) if a_regs else round_launch(x, y, impl)
    kernel[grid](*args, **kw)
    return y


# -------------------------------------------------------------------------------------------- checks (GPU)
def _scaled_rows(m, k, gen, exps=(0, -100, -20, 20, 100)):
    """randn bf16 [m, k] on the GPU, row i scaled by 2**exps[i % len(exps)] (2**+-100: the +-64 pre-scaling path
    of the rounding, whose blocks have |X| > 90)."""
    x = torch.randn(m, k, generator=gen, device=DEVICE)
    e = torch.tensor(exps, dtype=torch.float32, device=DEVICE).repeat(m // len(exps) + 1)[:m]
    return (x * torch.exp2(e)[:, None]).to(torch.bfloat16)


def _round_inputs(gen):
    """Inputs of the bitwise rounding check, bf16 [1024, 4096]: random bit patterns (every exponent, subnormals,
    NaN and Inf in ~12% of the blocks), randn rows at 2**{0, +-20, +-100, -120, -126, -133} (subnormal rows, the
    +-64 pre-scaling), and hand-made blocks (zeros, -0, power-of-two and 448 * 2**k amax, E4M3 ties)."""
    m, k = 1024, 4096
    bits = torch.randint(-32768, 32768, (m // 4, k), generator=gen, device=DEVICE, dtype=torch.int32)
    x_bits = bits.to(torch.int16).view(torch.bfloat16)
    x_rows = _scaled_rows(m // 2, k, gen, exps=(0, -100, -20, 20, 100, -120, -126, -133))
    special = torch.randn(m // 4, k, generator=gen, device=DEVICE).to(torch.bfloat16).view(m // 4, k // 32, 32)
    special[0::8] = 0.0
    special[1::8] = -0.0
    special[2::8, :, 0] = 2.0 ** 7                                     # amax a power of two
    special[3::8, :, 0] = 448.0 * 2.0 ** -3                            # amax = 448 * 2**k
    special[4::8] = torch.tensor([1.0625, 1.1875, 17.0, 3 * 2.0 ** -10, 15 * 2.0 ** -10] * 6 + [448.0, -448.0],
                                 device=DEVICE).to(torch.bfloat16)     # ties, subnormal E4M3 values (X = 0)
    special[5::8, :, 1] = float("inf")
    special[6::8, :, 2] = float("nan")
    return torch.cat([x_bits, x_rows, special.view(m // 4, k)])


def check_rounding(impl: str, gen, a_regs: int = 0) -> dict:
    """The rounding-only kernel against kosmos.quant.mx_round(x), i.e. dequantize_mx(*quantize_mx(x)), bitwise
    (NaN-aware: ``nan_payload_diff`` counts elements where both are NaN with different bits -- expected for
    "packed")."""
    x = _round_inputs(gen)
    ref = mx_round(x)
    y = gluon_mx_round(x, impl, a_regs)
    rb, yb = ref.view(torch.int16), y.view(torch.int16)
    both_nan = torch.isnan(ref) & torch.isnan(y)
    bad = (rb != yb) & ~both_nan
    what = f"round-only A_REGS={a_regs}" if a_regs else f"round-only {impl}"
    return {"kind": "check", "what": what, "elements": x.numel(), "mismatches": int(bad.sum()),
            "nan_payload_diff": int(((rb != yb) & both_nan).sum()), "ok": bool(bad.sum() == 0)}


def _expand_inputs(gen):
    """Inputs of the bitwise expansion check, an MX [1024, 2048] (payload float8_e4m3fn, scales uint8): every
    (payload byte, scale byte) pair twice -- 2 x 2048 blocks of 32 distinct bytes under each scale 0..255 (+-0,
    E4M3 subnormals, +-448, NaN bytes; scales 0..9: some results bf16 subnormals, at 0..2 some underflow to +-0;
    127; 247..254: some overflow to +-inf; 255: NaN), the blocks' positions and the bytes' order within them
    shuffled -- and random bytes under random scales in the other 61440 blocks."""
    m, k = 1024, 2048
    nb = m * k // 32
    sys_blocks = 2 * 2048
    byte = torch.randint(0, 256, (nb, 32), generator=gen, device=DEVICE, dtype=torch.int32)
    scale = torch.randint(0, 256, (nb, ), generator=gen, device=DEVICE, dtype=torch.int32)
    b = torch.arange(sys_blocks, device=DEVICE) % 2048
    sys_bytes = (b[:, None] % 8) * 32 + torch.arange(32, device=DEVICE)[None, :]
    shuffle = torch.argsort(torch.rand(sys_blocks, 32, generator=gen, device=DEVICE), dim=1)
    where = torch.randperm(nb, generator=gen, device=DEVICE)[:sys_blocks]
    byte[where] = torch.gather(sys_bytes, 1, shuffle).to(torch.int32)
    scale[where] = (b // 8).to(torch.int32)
    payload = byte.to(torch.uint8).view(m, k).view(torch.float8_e4m3fn)
    return payload, scale.to(torch.uint8).view(m, k // 32)


def check_expand(expand: str, gen) -> dict:
    """The expansion-only kernel against kosmos.quant.dequantize_mx, bitwise (NaN included: ``nan_payload_diff``
    counts elements where both are NaN with different bits, expected 0): the exhaustive pairs of _expand_inputs,
    and quantize_mx of _round_inputs (real blocks: zeros, subnormal rows, NaN / Inf blocks with scale 255)."""
    bad = nan_diff = n = 0
    for payload, scales in (_expand_inputs(gen), quantize_mx(_round_inputs(gen))):
        ref = dequantize_mx(payload, scales)
        y = gluon_mx_expand(payload, scales, expand)
        rb, yb = ref.view(torch.int16), y.view(torch.int16)
        both_nan = torch.isnan(ref) & torch.isnan(y)
        bad += int(((rb != yb) & ~both_nan).sum())
        nan_diff += int(((rb != yb) & both_nan).sum())
        n += y.numel()
    return {"kind": "check", "what": f"expand-only {expand}", "elements": n, "mismatches": bad,
            "nan_payload_diff": nan_diff, "ok": bad == 0 and nan_diff == 0}


def _rel_err(c, ref) -> tuple[float, float]:
    """(whole-matrix relative Frobenius error, worst row's relative error), in fp64 on the GPU."""
    d = (c.double() - ref.double())
    rows = d.norm(dim=1) / ref.double().norm(dim=1).clamp_min(1e-300)
    return float(d.norm() / ref.double().norm()), float(rows.max())


CHECK_SHAPES = ((2048, 5120, 1024), (1024, 2560, 2048))  # 320 tiles (2-3 per program, B [N, K]); 80 (B [K, N])
BF16_TOL = 4e-3  # one bf16 rounding of the output: <= 2**-8 = 0.0039 relative per element (~0.0017 typical)


def check_gemm(m, n, k, *, build, b_kmajor, gen) -> dict:
    """Fresh inputs (rows of A at 2**{0, +-20, +-100}), NaN-poisoned output; against an fp32 torch.matmul of
    A (ref "bf16") or of kosmos.quant's MX values of A (ref "mx"), worst row's relative error <= BF16_TOL. The
    MX-input builds get quantize_mx(A) with A's 32-column blocks also scaled by 2**[-8, 8] at random (exact), so
    that a row's scales differ along K and a scale taken from the wrong block or k-step shows."""
    a = _scaled_rows(m, k, gen)
    if BUILDS[build].get("a") == "mx":
        blk = torch.randint(-8, 9, (k // 32, ), generator=gen, device=DEVICE).float()
        a = (a.float() * torch.exp2(blk).repeat_interleave(32)[None, :]).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=DEVICE) / 64).to(torch.bfloat16)
    b = w if b_kmajor else w.t().contiguous()
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mx = BUILDS[build]["ref"] == "mx"
    if BUILDS[build].get("a") == "mx":  # the op's MX input: the GEMM of dequantize_mx(quantize_mx(A))
        q = quantize_mx(a)
        gluon_matmul(mx_input(build, q), b, b_kmajor=b_kmajor, out=c, **BUILDS[build]["kw"])
        a_ref = dequantize_mx(*q)
    else:
        gluon_matmul(a, b, b_kmajor=b_kmajor, out=c, **BUILDS[build]["kw"])
        a_ref = mx_round(a) if mx else a
    ref = torch.matmul(a_ref.float(), w.float().t())
    err, row_err = _rel_err(c, ref)
    out = {"kind": "check", "what": f"gemm {build} {'B[N,K]' if b_kmajor else 'B[K,N]'}",
           "M": m, "N": n, "K": k, "rel_err": err, "row_rel_err": row_err, "nan": int(torch.isnan(c).sum()),
           "ok": bool(row_err <= BF16_TOL and not torch.isnan(c).any())}
    if mx:  # how far the MX values are from A: a build that rounded nothing would pass this, not the above
        out["rel_err_vs_bf16_ref"] = _rel_err(c, torch.matmul(a.float(), w.float().t()))[0]
    return out


def check_a_regs_sass(build, gen) -> dict:
    """A_REGS builds: the compiled kernel's SASS has no write to the A registers of a wgmma still in flight
    (_a_regs_hazards), at the first check shape's compile."""
    m, n, k = CHECK_SHAPES[0]
    a = _empty_mx(m, k, DEVICE) if BUILDS[build].get("a") == "mx" else torch.zeros(m, k, dtype=torch.bfloat16,
                                                                                    device=DEVICE)
    b = torch.zeros(n, k, dtype=torch.bfloat16, device=DEVICE)
    c = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    kernel, grid, args, kw = gemm_launch(a, b, c, num_sms=_num_sms(b.device), **BUILDS[build]["kw"])
    sass = _sass_text(kernel.warmup(*args, grid=grid, **kw))
    bad = _a_regs_hazards(sass)
    return {"kind": "check", "what": f"sass {build}: no write to an in-flight wgmma's A registers",
            "sass": sass is not None, "hazards": len(bad), "examples": bad[:4], "ok": sass is not None and not bad}


# -------------------------------------------------------------------------------------------- timing (GPU)
def bench_shape(name, m, n, k, variants, gen, iters, warmup) -> list[dict]:
    """Each variant's time (kosmos_bench.timing.time_op: L2 flushed before every call, the host hidden by a spin),
    its ratio to torch.matmul and its relative error against an fp32 reference (the MX reference for the MX
    variants). The MX-input builds take quantize_mx(A), made once outside the timed call; the QUANTIZE_PLUS rows
    time quantize_mx(A) and the build together (the op from bf16)."""
    from kosmos_bench.timing import time_op
    a = (torch.randn(m, k, generator=gen, device=DEVICE)).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=DEVICE) / 64).to(torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    calls = {"torch": lambda: torch.matmul(a, w.t())}
    q = quantize_mx(a) if any(BUILDS.get(v, {}).get("a") == "mx" for v in variants) else None
    for v in variants:
        if v in BUILDS:
            calls[v] = lambda kw=BUILDS[v]["kw"], src=mx_input(v, q) if BUILDS[v].get("a") == "mx" else a: (
                gluon_matmul(src, w, out=c, **kw))
        elif v in QUANTIZE_PLUS:
            calls[v] = lambda kw=BUILDS[QUANTIZE_PLUS[v]]["kw"], x=QUANTIZE_PLUS[v]: gluon_matmul(
                mx_input(x, quantize_mx(a)), w, out=c, **kw)
    ref = torch.matmul(a.float(), w.float().t())
    mx = {v for v in variants if v in QUANTIZE_PLUS or (v in BUILDS and BUILDS[v]["ref"] == "mx")}
    ref_mx = torch.matmul(mx_round(a).float(), w.float().t()) if mx else None
    rows = []
    for v in variants:
        out = calls[v]()
        err = _rel_err(out, ref_mx if v in mx else ref)[0]
        t = time_op(calls[v], iters=iters, warmup=warmup)
        rows.append({"kind": "time", "shape": name, "M": m, "N": n, "K": k, "variant": v, "time_ms": t["time_ms"],
                     "p20_ms": t["p20_ms"], "p80_ms": t["p80_ms"], "tflops": 2 * m * n * k / t["time_ms"] / 1e9,
                     "rel_err": err})
    base = next((r["time_ms"] for r in rows if r["variant"] == "torch"), None)
    for r in rows:
        r["ratio_vs_torch"] = r["time_ms"] / base if base else None
    del a, w, c, ref, ref_mx, q
    return rows


# -------------------------------------------------------------------------------------------- cycle profile (GPU)
PROF_MMA = ("b/a_ready wait", "A_REGS round", "wgmma_wait(1)", "barrier+refill", "k-step")  # "A_REGS round":
# the LDS / LDSM of A and, per build, its rounding (1, 2) or expansion (4, 5)
PROF_ROUND = ("raw wait", "load+refill", "round", "a_done wait", "store+fence+arrive", "k-step")


def profile_shape(name, m, n, k, variants, gen) -> list[dict]:
    """Each Gluon build once more with PROF=True (clock64 around each phase of each k-step, summed per program),
    at one shape: mean cycles per k-step and warp of each phase, in the MMA partition and (ROUND_MX
    warp-specialised builds) the rounding partition. The clock reads cost a few cycles and may move code a little:
    the phases, not the totals, are the point."""
    a = (torch.randn(m, k, generator=gen, device=DEVICE)).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=DEVICE) / 64).to(torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    rows = []
    for v in variants:
        if v not in BUILDS:
            continue
        grid = min(_num_sms(a.device), (m // BM) * (n // BN))
        prof = torch.zeros(grid, 16, dtype=torch.int64, device=DEVICE)
        src = mx_input(v, quantize_mx(a)) if BUILDS[v].get("a") == "mx" else a
        gluon_matmul(src, w, out=c, prof=prof, **BUILDS[v]["kw"])   # compile + warm
        prof.zero_()
        gluon_matmul(src, w, out=c, prof=prof, **BUILDS[v]["kw"])
        torch.cuda.synchronize()
        p = prof.double().sum(0).tolist()
        r = {"kind": "profile", "shape": name, "M": m, "N": n, "K": k, "variant": v,
             "mma": {ph: p[1 + i] / max(p[0], 1) for i, ph in enumerate(PROF_MMA)}}
        if p[8]:
            r["round"] = {ph: p[9 + i] / p[8] for i, ph in enumerate(PROF_ROUND)}
        rows.append(r)
    del a, w, c
    return rows


def print_profile(rows):
    if not rows:
        return
    print(f"\ncycles per k-step and warp (clock64, mean over the k-steps of all programs), {rows[0]['shape']}: MMA "
          f"partition | rounding partition")
    print(f"{'build':<20} " + " ".join(f"{h:>14}" for h in PROF_MMA) + " | " + " ".join(f"{h:>18}" for h in PROF_ROUND))
    for r in rows:
        mma = " ".join(f"{r['mma'][h]:>14.0f}" for h in PROF_MMA)
        rnd = " ".join(f"{r['round'][h]:>18.0f}" for h in PROF_ROUND) if "round" in r else ""
        print(f"{r['variant']:<20} {mma} | {rnd}")


# -------------------------------------------------------------------------------------------- compile only (CPU)
def _ptx_facts(ptx: str, ttgir: str) -> dict:
    """What the PTX / TTGIR say about the mainloop: wgmma count and whether A comes from shared memory (a 64-bit
    descriptor after the accumulator list, not a {4 x b32} register list), TMA loads, setmaxnreg budgets."""
    wg = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)\s+\{[^}]*\},\s*(\S+)", ptx)
    dots = re.findall(r"ttng\.warp_group_dot\s+%\S+,\s*%\S+,.*?:\s*(!ttg\.memdesc|tensor)", ttgir)
    return {"wgmma": len(wg), "wgmma_shapes": sorted({s for s, _ in wg}),
            "wgmma_a_from_smem": bool(wg) and all(not a.startswith("{") for _, a in wg),
            "ttgir_dot_a": sorted(set(dots)),
            "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx)),
            "tma_stores": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)),
            "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))}


def _sass_text(compiled):
    """The cubin's SASS with branch labels (nvdisasm -c, shipped in the Triton wheel), or None where unavailable."""
    import shutil
    import subprocess
    import tempfile
    tool = shutil.which("nvdisasm") or os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                                    "nvdisasm")
    if not os.path.exists(tool) or "cubin" not in compiled.asm:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True).stdout


def _sass_mix(sass) -> dict:
    """SASS opcode counts of the whole kernel."""
    counts = {}
    for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass or ""):
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


# SASS opcode classes (Hopper pipes, roughly): bf16x2 arithmetic (and HSET2, HADD2.F32: f16 -> f32), bf16x2
# min/max, the 16-lane integer ALU (logic, compares, selects, shifts, permutes, the new VIADD), IMAD (FMA pipe),
# conversions (F2FP: packed E4M3 -> f16 and f32 -> bf16; pipe unpublished), the uniform datapath, shared memory.
_SASS_CLASSES = (("fp16x2", ("HMUL2", "HFMA2", "HADD2", "HSET2")), ("hmnmx2", ("HMNMX2", )), ("mma", ("HGMMA", )),
                 ("cvt", ("F2FP", "F2F", "I2F", "F2I")),
                 ("imad", ("IMAD", )), ("fp32", ("FFMA", "FADD", "FMUL", "FMNMX", "FSETP", "FSEL")),
                 ("shfl", ("SHFL", )), ("lds", ("LDS", )), ("sts", ("STS", )),
                 ("sync", ("BAR", "SYNCS", "MEMBAR", "FENCE", "DEPBAR", "WARPGROUP", "WARPSYNC")),
                 ("tma", ("UTMA", )), ("uniform", ("U", "R2UR", "S2UR", "VOTEU")), ("branch", ("BRA", "EXIT")))


def _sass_class(op):
    for name, prefixes in _SASS_CLASSES:
        if op.startswith(prefixes):
            return name
    return "alu"


def _sass_loops(sass) -> list[dict]:
    """The kernel's loops (a backward branch to a label) with the instructions of one trip, by class: blocks a
    forward branch skips that hold an integer division (MUFU.RCP: the persistent loop's tile change, once a tile)
    are left out, as are spin-wait retries (outside the loop body in Triton's code). Innermost loops first."""
    ins, labels = [], {}
    for line in (sass or "").split("\n"):
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)\s*(.*?);", line)
        if m:
            ins.append((m.group(2) or "", m.group(3), m.group(4), m.group(5)))
    loops = []
    for i, (pred, op, mods, args) in enumerate(ins):
        t = re.search(r"\((\.L_x_\d+)\)", args) if op == "BRA" and pred else None  # (an unconditional jump
        if t and t.group(1) in labels and labels[t.group(1)] <= i:                # back is a spin-wait's exit)
            a = labels[t.group(1)]
            skip = set()
            for j in range(a, i):
                pj, oj, _, argj = ins[j]
                tj = re.search(r"\((\.L_x_\d+)\)", argj) if oj == "BRA" and pj else None
                if tj and tj.group(1) in labels and j < labels[tj.group(1)] <= i:
                    blk = range(j + 1, labels[tj.group(1)])
                    if any(ins[q][1] == "MUFU" for q in blk):
                        skip.update(blk)
            classes, ops = {}, {}
            for j in range(a, i + 1):
                if j in skip:
                    continue
                op_j = ins[j][1] + (ins[j][2] if ins[j][1] in ("LDS", "STS", "LDSM", "STSM") else "")
                c = _sass_class(ins[j][1])
                classes[c] = classes.get(c, 0) + 1
                ops[op_j] = ops.get(op_j, 0) + 1
            loops.append({"span": i - a + 1, "n": sum(classes.values()), "classes": classes, "ops": ops})
    return sorted(loops, key=lambda L: L["span"])


def _a_regs_hazards(sass) -> list[str]:
    """The A-in-registers wgmma hazard, checked on the SASS (Triton issue #9433: ptxas does not protect a wgmma's A
    registers once PTX overwrites them, and writing them before the wgmma.wait_group that retires it is undefined):
    walks the innermost loop with HGMMA three times over, tracking the A registers of every committed and not yet
    retired HGMMA group (retired by WARPGROUP.DEPBAR.LE gsb0, n), and lists the instructions that write one of
    them. Empty: no hazard (the A_REGS builds' two alternating register sets)."""
    body = []
    lines = (sass or "").split("\n")
    labels = {}
    ins = []
    for line in lines:
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)\s*(.*?);",
                     line)
        if m:
            ins.append((m.group(3), m.group(4), m.group(5), line.strip()))
    loops = []
    for i, (op, mods, args, _) in enumerate(ins):
        t = re.search(r"\((\.L_x_\d+)\)", args) if op == "BRA" else None
        if t and t.group(1) in labels and labels[t.group(1)] < i:
            a = labels[t.group(1)]
            if any(ins[j][0] == "HGMMA" for j in range(a, i)):
                loops.append((i - a, a, i))
    if not loops:
        return []
    _, a, b = min(loops)
    body = ins[a:b + 1]
    width = {"LDSM": 4, "LDS": 1}
    pending, group, bad = [], set(), []
    for _ in range(3):
        for op, mods, args, text in body:
            if op == "HGMMA":
                regs = re.findall(r"\bR(\d+)\b", args)
                if len(regs) >= 2:                        # acc, A, desc, acc: the A operand is the second
                    group.update(range(int(regs[1]), int(regs[1]) + 4))
                if "gsb0" in args:
                    pending.append(group)
                    group = set()
                continue
            if op == "WARPGROUP" and ".DEPBAR" in mods:
                n = int(args.split(",")[-1], 16) if "0x" in args else int(args.split(",")[-1])
                pending = pending[len(pending) - n:] if n else []
                continue
            m = re.match(r"R(\d+)\b", args)
            if not m or op.startswith(("ST", "SYNCS", "BAR", "RED", "ATOM")):
                continue
            w = width.get(op, 1)
            if op in ("LDS", "LDSM"):
                w = {".128": 4, ".64": 2}.get(mods[-4:] if mods.endswith("128") else mods[-3:], 1) if op == "LDS" \
                    else (4 if mods.endswith(".4") else 2 if mods.endswith(".2") else 1)
            elif ".WIDE" in mods or op in ("CS2R", ):
                w = 2
            dst = set(range(int(m.group(1)), int(m.group(1)) + w))
            if any(dst & g for g in pending) and text not in bad:
                bad.append(text)
    return bad


def _kstep_profile(sass, a_regs) -> dict:
    """Per k-step and per warp: the MMA loop (the innermost loop with HGMMA; A_REGS builds: its trip is two k-steps,
    halved here) and the rounding partition's loop (the innermost loop with LDS and STS, no HGMMA nor STSM)."""
    out = {}
    loops = [L for L in _sass_loops(sass) if L["n"] >= 20]
    mma = next((L for L in loops if L["classes"].get("mma")), None)
    rnd = next((L for L in loops if not L["classes"].get("mma") and L["classes"].get("lds")
                and L["classes"].get("sts") and not L["ops"].get("STSM.16.M88.4")), None)
    for key, L, div in (("mma_loop", mma, 2 if a_regs else 1), ("round_loop", rnd, 1)):
        if L:
            out[key] = {"n": L["n"] / div, **{c: v / div for c, v in sorted(L["classes"].items(), key=lambda kv: -kv[1])},
                        "ops": L["ops"]}
    return out


def _empty_mx(m, k, device):
    """An uninitialised MX A of [m, k] in mx_a's form (payload, k-major scales) (compile-only shapes)."""
    return (torch.empty(m, k, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(k // 32, m, dtype=torch.uint8, device=device))


def compile_only(json_path=None, b_kmajor=True, builds=None) -> list[dict]:
    """Compile every build for sm_90a without a GPU (dev/kernel_resources.py's stand-in driver): registers, spills,
    shared memory (ptxas -v on the PTX), the facts of ``_ptx_facts``, and the SASS of the k-step: instructions per
    k-step and warp of the MMA loop and of the rounding loop (``_kstep_profile``)."""
    from dev.kernel_resources import _use_stand_in_driver
    if not torch.cuda.is_available():
        _use_stand_in_driver()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m, n, k = LLAMA_SHAPES["qkv-4k"]
    a = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    a_mx = _empty_mx(m, k, dev)
    b = torch.empty((n, k) if b_kmajor else (k, n), dtype=torch.bfloat16, device=dev)
    c = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    rows = []
    print(f"triton {triton.__version__}, torch {torch.__version__}, sm_90a, B {'[N, K]' if b_kmajor else '[K, N]'}")
    print(f"{'build':<20} {'regs':>4} {'spill':>5} {'smem KiB':>8}  {'setmaxnreg':<24} {'A smem':>6}  "
          f"{'MMA loop / k-step':<18} {'rounding loop / k-step (warp)'}")
    for name in builds or BUILDS:
        a_in = a
        if BUILDS[name].get("a") == "mx":  # (the expand pass takes the public [M, K/32] scales)
            a_in = (a_mx[0], a_mx[1].t().contiguous()) if BUILDS[name]["kw"].get("ROW_PASS") else a_mx
        kernel, grid, args, kw = gemm_launch(a_in, b, c, b_kmajor=b_kmajor, **BUILDS[name]["kw"])
        rows.append(_compile_row(name, kernel.warmup(*args, grid=grid, **kw), kw))
    x = torch.empty(1024, 4096, dtype=torch.bfloat16, device=dev)
    for impl in ("kosmos", "packed", "norm"):
        kernel, grid, args, kw = round_launch(x, torch.empty_like(x), impl)
        rows.append(_compile_row(f"round-only {impl}", kernel.warmup(*args, grid=grid, **kw), kw))
    for a_regs in (1, 2):
        kernel, grid, args, kw = round_dot_launch(x, torch.empty_like(x), a_regs)
        rows.append(_compile_row(f"round-only A_REGS={a_regs}", kernel.warmup(*args, grid=grid, **kw), kw))
    for expand in EXPANDS:
        kernel, grid, args, kw = expand_launch(*_empty_mx(*x.shape, dev), torch.empty_like(x), expand)
        rows.append(_compile_row(f"expand-only {expand}", kernel.warmup(*args, grid=grid, **kw), kw))
    if json_path:
        with open(json_path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


def _compile_row(name, compiled, kw) -> dict:
    from dev.kernel_resources import _resources
    sass = _sass_text(compiled)
    r = {"kind": "compile", "build": name, "triton": triton.__version__,
         **{k: v for k, v in kw.items() if k.isupper() or k in ("num_warps", "maxnreg")},
         **_resources(compiled), **_ptx_facts(compiled.asm["ptx"], compiled.asm["ttgir"]),
         "sass_ops": _sass_mix(sass), "kstep": _kstep_profile(sass, kw.get("A_REGS", 0)),
         "a_regs_hazards": _a_regs_hazards(sass) if kw.get("A_REGS") else []}
    r["shared_kib"] = round(compiled.metadata.shared / 1024, 1)
    regs = " ".join(f"{d}{v}" for d, v in r["setmaxnreg"])

    def cell(key):
        p = r["kstep"].get(key)
        if not p:
            return "-"
        parts = [f"{p['n']:.0f}"] + [f"{c} {p[c]:.0f}" for c in ("fp16x2", "hmnmx2", "cvt", "alu", "imad", "fp32",
                                                                 "shfl", "lds", "sts", "sync", "uniform") if p.get(c)]
        return parts[0] + " (" + ", ".join(parts[1:]) + ")"
    print(f"{name:<20} {r['regs']:>4} {str(r['spill_bytes']):>5} {r['shared_kib']:>8}  {regs:<24} "
          f"{str(r['wgmma_a_from_smem']):>6}  {cell('mma_loop').split(' (')[0]:<18} {cell('round_loop')}",
          flush=True)
    if kw.get("A_REGS"):
        what = "expansion" if kw["A_REGS"] >= 4 else "rounding"
        print(f"{'':<20} MMA loop with the {what}: {cell('mma_loop')}; A-register hazards in the SASS: "
              f"{len(r['a_regs_hazards'])}", flush=True)
    return r


# -------------------------------------------------------------------------------------------- emulation (CPU)
def _rne_bf16(x):
    """float64 values -> the nearest bf16 values (ties to even; subnormal grid 2**-133; overflow -> +-inf), as
    float64. Signed zeros, infinities and NaN pass through."""
    import numpy as np
    out = np.array(x, dtype=np.float64)
    fin = np.isfinite(out) & (out != 0)
    a = np.abs(out[fin])
    _, e = np.frexp(a)                                   # a = f * 2**e, f in [0.5, 1): floor(log2 a) = e - 1
    q = np.ldexp(1.0, np.maximum(e - 1, -126) - 7)       # the bf16 quantum of a's binade
    r = np.round(a / q) * q                              # a / q exact (a power of two); np.round: ties to even
    out[fin] = np.copysign(np.where(r >= 2.0 ** 128, np.inf, r), out[fin])
    return out


def _sign_exponent(x):
    """The value of bf16 bits ``x & 0xFF80`` (float64 in, float64 out): +-2**floor(log2|x|) for a normal, +-0 for a
    subnormal or zero, +-inf for +-inf, +inf for NaN (the hardware's NaN is 0x7FFF)."""
    import numpy as np
    _, e = np.frexp(np.abs(x))
    p = np.where(np.abs(x) >= 2.0 ** -126, np.ldexp(1.0, e - 1), 0.0)
    p = np.where(np.isinf(x), np.inf, p)
    return np.where(np.isnan(x), np.inf, np.copysign(p, x))


def emulate_packed(verbose=True, scheme="packed") -> dict:
    """The packed rounding's PTX, emulated exactly in float64 on the CPU (each bf16x2 op: its exact result rounded
    once to bf16), against kosmos.quant's torch references (dequantize_mx_ref(*quantize_mx_ref(.))): every bf16
    value v, both signs, under every block exponent X in [-127, 120] with |v| <= 448 * 2**X (blocks of 32: the
    block's amax element, then 31 values), blocks whose amax is just above 448 * 2**X (RCEIL's +1) or tiny, plus
    blocks with NaN / Inf. NaN-aware bitwise equality. No GPU, no Triton. (Why the emulation is exact: module
    docstring.) ``scheme``: "packed" (the +-64 shift constants: _mx_round_words) or "norm" (_norm_consts: the
    constants of the "norm" builds ws-norm, rs, rs1, whose max is max.NaN and whose Cb carries the NaN)."""
    import numpy as np
    from kosmos.quant import dequantize_mx_ref, quantize_mx_ref
    pos = np.arange(0, 0x7F80, dtype=np.int64)                       # every finite non-negative bf16 pattern
    tests, amaxes = [], []
    for x in range(-127, 121):
        amax = ((x + 135) << 7) | 0x60 if x < 120 else 0x7F7F        # 448 * 2**X (X = 120: bf16's largest)
        v = pos[pos <= amax]
        v = np.concatenate([v, v | 0x8000])
        pad = (-len(v)) % 31
        v = np.concatenate([v, np.zeros(pad, dtype=np.int64)]).reshape(-1, 31)
        tests.append(v)
        amaxes.append(np.full((len(v), 1), amax, dtype=np.int64))
    blocks = np.concatenate([np.concatenate(amaxes), np.concatenate(tests)], axis=1)   # [blocks, 32] bf16 bits
    special = np.tile(np.array([0x3F80] * 32, dtype=np.int64), (4, 1))
    special[0, 3], special[1, 5], special[2, 7], special[3, 0] = 0x7F80, 0xFF80, 0x7FC0, 0xFFC1  # +-inf, NaNs
    extra = [np.concatenate([[((x + 135) << 7) | f], (np.arange(31) * 37 + f) % (((x + 135) << 7) | f)])
             for x in range(-134, 120) for f in (0x61, 0x7F)]               # amax above 448 * 2**X: RCEIL's + 1
    extra += [np.concatenate([[a], np.arange(31) % (a + 1)]) for a in range(1, 0x480, 3)]   # tiny blocks
    blocks = np.concatenate([blocks, special, np.array(extra, dtype=np.int64)])
    bits = blocks.astype(np.uint32) << 16
    w = bits.view(np.float32).astype(np.float64)                      # the bf16 values

    # the block constants, as _mx_round_words (packed) / _norm_consts (norm) compute them
    mag = np.where(np.isnan(w), 0x7FFF, (bits >> 16) & 0x7FFF).astype(np.int64)
    if scheme == "packed":
        amax32 = mag.max(axis=1) << 16
        nonfinite = amax32 >= 0x7F800000
        xexp = np.maximum((amax32 >> 23) - 135 + ((amax32 & 0x7FFFFF) > 0x600000), -127)
        shift = np.where(xexp < -90, 64, np.where(xexp > 90, -64, 0))
        s16 = np.where(nonfinite, np.nan, np.ldexp(1.0, shift + 4))[:, None]
        s1 = np.where(nonfinite, np.nan, np.ldexp(1.0, shift))[:, None]
        cb = np.ldexp(1.0, xexp + shift - 2)[:, None]
        sinv = np.ldexp(1.0, -shift)[:, None]
    else:
        amax = mag.max(axis=1)
        p = np.maximum((amax + 0x1F) & 0x7F80, 0x400)                 # 2**(X + 8)'s bits
        as_bf16 = lambda h: (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)[:, None]  # noqa: E731
        s16, s1, sinv = as_bf16(0x8300 - p), as_bf16(0x8100 - p), as_bf16(p - 0x200)
        cb = np.where(amax >= 0x7F80, np.nan, 2.0 ** -6)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        c = _sign_exponent(_rne_bf16(w * s16))                        # mul.rn.bf16x2; and 0xFF80FF80
        c = np.copysign(np.maximum(np.abs(c), cb), c)                 # max(.NaN).xorsign.abs.bf16x2 (cb > 0)
        t = _rne_bf16(w * s1 + c)                                     # fma.rn.bf16x2 (see the docstring)
        t = _rne_bf16(t - c)                                          # sub.rn.bf16x2 (exact)
        r = _rne_bf16(t * sinv)                                       # mul.rn.bf16x2
    r = np.where(np.signbit(w), -np.abs(r), r)                        # lop3: OR the sign bit of the input
    got = (r.astype(np.float32).view(np.uint32) >> 16).astype(np.int64)

    x_t = torch.from_numpy(blocks.astype(np.int16)).view(torch.bfloat16)
    ref = dequantize_mx_ref(*quantize_mx_ref(x_t)).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    ref_nan = (ref & 0x7FFF) > 0x7F80
    got_nan = (got & 0x7FFF) > 0x7F80
    bad = (got != ref) & ~(ref_nan & got_nan)
    out = {"kind": "check", "what": f"{scheme} rounding, float64 emulation vs kosmos.quant references",
           "elements": int(blocks.size), "blocks": int(len(blocks)), "mismatches": int(bad.sum()),
           "nan_payload_diff": int(((got != ref) & ref_nan & got_nan).sum()), "ok": bool(bad.sum() == 0)}
    if verbose and bad.any():
        i = np.argwhere(bad)[:8]
        out["examples"] = [{"block_amax": hex(int(blocks[a, 0])), "x": hex(int(blocks[a, b])),
                            "ref": hex(int(ref[a, b])), "got": hex(int(got[a, b]))} for a, b in i]
    return out


def emulate_expand(expand="cvt", verbose=True) -> dict:
    """The MX expansion's PTX (_EXPAND_CVT or _EXPAND_BITS), emulated exactly on the CPU, against kosmos.quant's
    dequantize_mx_ref: every payload byte under every scale byte (65536 elements). Each instruction is emulated as
    its exact result rounded once: "cvt" -- E4M3 -> f16 -> f32 exact, fp32 multiply by 2**(S - 127) (numpy's float64
    -> float32 cast: round to nearest even, subnormals, overflow to inf), f32 -> bf16 to nearest even (_rne_bf16),
    NaN -> 0x7FFF (the hardware's canonical NaN), then the signed 16-bit min with 0x7FC0; "bits" -- the prmt / shl /
    and bit pattern, two bf16 multiplies each rounded once (_rne_bf16), the |a| > T select. What the GPU check
    adds: that the hardware does exactly this (no flush of fp32 / bf16 subnormals, one rounding per multiply, the
    canonical NaN's bits). Bitwise, NaN bits included."""
    import numpy as np
    from kosmos.quant import dequantize_mx_ref
    byte = np.tile(np.arange(256, dtype=np.int64), (256, 1))             # [scale, byte]
    sc = np.tile(np.arange(256, dtype=np.int64)[:, None], (1, 256))
    as_f = lambda bits16: (np.asarray(bits16, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)  # noqa
    with np.errstate(invalid="ignore", over="ignore"):
        if expand == "cvt":
            from kosmos.quant import e4m3_value_ref
            v = e4m3_value_ref(torch.from_numpy(byte.astype(np.uint8))).numpy()          # exact, NaN for S.1111.111
            mult = np.where(sc == 255, np.nan, np.ldexp(1.0, sc - 127))                   # mx_scale_f32's value
            f32 = (v * mult).astype(np.float32).astype(np.float64)                        # mul.rn.f32
            r = _rne_bf16(f32)                                                            # cvt.rn.bf16x2.f32
            bits = (r.astype(np.float32).view(np.uint32) >> 16).astype(np.int64)
            bits = np.where(np.isnan(r), 0x7FFF, bits)
            s16 = np.where(bits >= 0x8000, bits - 0x10000, bits)                          # min.s16x2 with 0x7FC0
            got = np.minimum(s16, 0x7FC0) & 0xFFFF
        else:
            a = as_f(((byte & 0x7F) << 4) | ((byte & 0x80) << 8))                         # prmt, shl, and
            m1 = np.ldexp(1.0, np.minimum(sc - 7, 127))
            m2 = np.ldexp(1.0, np.maximum(sc - 134, 0))
            r = _rne_bf16(_rne_bf16(a * m1) * m2)                                         # two mul.rn.bf16x2
            thr = np.where(sc == 255, -1.0, 448.0 * 2.0 ** -120)
            bits = (r.astype(np.float32).view(np.uint32) >> 16).astype(np.int64)
            got = np.where(np.abs(a) > thr, 0x7FC0, bits)                                 # abs, set.gt, lop3
    payload = torch.from_numpy(byte.astype(np.uint8)).view(torch.float8_e4m3fn)
    scales = torch.from_numpy(np.arange(256, dtype=np.uint8)[:, None].repeat(8, axis=1))
    ref = dequantize_mx_ref(payload, scales).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    # NaN: dequantize_mx (the kernel) writes kosmos.quant._BF16_QNAN, whatever torch's NaN bits in the reference are
    ref = np.where((ref & 0x7FFF) > 0x7F80, _BF16_QNAN.value, ref)
    bad = got != ref
    out = {"kind": "check", "what": f"{expand} expansion, emulation vs kosmos.quant.dequantize_mx_ref",
           "elements": int(bad.size), "mismatches": int(bad.sum()), "ok": not bad.any(),
           "nan_results": int(((ref & 0x7FFF) > 0x7F80).sum()), "zero_results": int(((ref & 0x7FFF) == 0).sum()),
           "inf_results": int(((ref & 0x7FFF) == 0x7F80).sum()),
           "subnormal_results": int((((ref & 0x7F80) == 0) & ((ref & 0x7F) != 0)).sum())}
    if verbose and bad.any():
        out["examples"] = [{"scale": int(i), "byte": hex(int(j)), "ref": hex(int(ref[i, j])),
                            "got": hex(int(got[i, j]))} for i, j in np.argwhere(bad)[:8]]
    return out


# -------------------------------------------------------------------------------------------- CLI
def _parse_shapes(text):
    out = []
    for item in text.split(","):
        if item in LLAMA_SHAPES:
            out.append((item, *LLAMA_SHAPES[item]))
        elif re.fullmatch(r"\d+x\d+x\d+", item):
            out.append((item, *map(int, item.split("x"))))
        else:
            raise SystemExit(f"unknown shape {item!r}: one of {', '.join(LLAMA_SHAPES)} or MxNxK")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a (no GPU needed) and report "
                    "registers / spills / shared memory / wgmma operands, then stop")
    ap.add_argument("--shapes", default=",".join(LLAMA_SHAPES), help="comma-separated: " + ", ".join(LLAMA_SHAPES)
                    + " or MxNxK")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS)
                    + "; or 'expand' for " + ",".join(EXPAND_VARIANTS) + "; or 'rowpass' for "
                    + ",".join(ROWPASS_VARIANTS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--skip-checks", action="store_true", help="timing only (the checks take ~10 s)")
    ap.add_argument("--json", default=None, help="write one JSON object per line here")
    ap.add_argument("--config", default="", help="KEY=VALUE,... overriding config()'s launch parameters of every "
                    "Gluon GEMM build, e.g. A_STAGES=3,RAW_STAGES=2 or ROUND_REGS=112 (shared memory must stay <= "
                    "227 KiB: --compile-only says)")
    ap.add_argument("--emulate", action="store_true", help="check the packed rounding's arithmetic on the CPU "
                    "(float64 emulation against kosmos.quant's references, every bf16 value under every scale) and "
                    "the two MX expansions' (every payload byte under every scale byte), then stop")
    ap.add_argument("--profile", default="fc1-8k", help="after the timings, each Gluon build once more with clock64 "
                    "around its phases at this shape (one of the shapes' names or MxNxK; 'none': skip)")
    ap.add_argument("--b-kn", action="store_true", help="--compile-only: B as [K, N] instead of the weight [N, K]")
    args = ap.parse_args(argv)
    args.variants_given = any(a.startswith("--variants") for a in (argv if argv is not None else sys.argv[1:]))
    if args.variants == "expand":
        args.variants = ",".join(EXPAND_VARIANTS)
    elif args.variants == "rowpass":
        args.variants = ",".join(ROWPASS_VARIANTS)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: Gluon has no interpreter path here")
    for item in filter(None, args.config.split(",")):
        key, _, val = item.partition("=")
        OVERRIDES[key.strip()] = int(val)
    if args.emulate:
        rs = [emulate_packed(scheme=sc) for sc in ("packed", "norm")] + [emulate_expand(e) for e in EXPANDS]
        for r in rs:
            print(json.dumps(r))
        return 0 if all(r["ok"] for r in rs) else 1
    if args.compile_only:
        compile_only(args.json, b_kmajor=not args.b_kn,
                     builds=[v for v in args.variants.split(",") if v in BUILDS] if args.variants_given else None)
        return 0
    if not torch.cuda.is_available():
        ap.error("no GPU: use --compile-only here")
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}")
    shapes = _parse_shapes(args.shapes)
    rows = [{"kind": "env", "triton": triton.__version__, "torch": torch.__version__,
             "device": torch.cuda.get_device_name(), "variants": variants,
             "configs": {v: config(**BUILDS[v]["kw"]) for v in variants if v in BUILDS}}]
    out = open(args.json, "w") if args.json else None

    def emit(r):
        rows.append(r)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()

    emit(rows[0])
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    failed = 0
    if not args.skip_checks:
        checks = []
        built = list(dict.fromkeys([v for v in variants if v in BUILDS]
                                   + [QUANTIZE_PLUS[v] for v in variants if v in QUANTIZE_PLUS]))
        for v in built:  # the expansion each MX-input build runs, bitwise against dequantize_mx first
            if BUILDS[v].get("a") == "mx":  # (the expand pass runs the "cvt" arithmetic)
                checks.append(lambda x=v: check_expand(next((e for e, i in EXPANDS.items()
                                                             if i == BUILDS[x]["kw"].get("A_REGS", 4) - 3), "cvt"),
                                                       gen))
        rounders = []  # the rounding code each timed build runs, checked bitwise on its own first
        for v in built:
            if BUILDS[v]["ref"] != "mx" or BUILDS[v].get("a") == "mx":
                continue
            kw = BUILDS[v]["kw"]
            key = ("dot", kw["A_REGS"]) if kw.get("A_REGS") else ("ws", kw.get("impl", "packed"))
            if key not in rounders:
                rounders.append(key)
        for kind, x in rounders:
            checks.append(lambda kind=kind, x=x: check_rounding(x if kind == "ws" else "norm", gen,
                                                                a_regs=x if kind == "dot" else 0))
        for v in built:
            if BUILDS[v]["kw"].get("A_REGS"):
                checks.append(lambda v=v: check_a_regs_sass(v, gen))
        for v in built:  # B as the weight [N, K] on the first shape, as [K, N] on the second
            for (m, n, k), b_kmajor in zip(CHECK_SHAPES, (True, False)):
                checks.append(lambda m=m, n=n, k=k, v=v, bk=b_kmajor: check_gemm(m, n, k, build=v, b_kmajor=bk,
                                                                                 gen=gen))
        for chk in checks:
            r = chk()
            emit(r)
            failed += not r["ok"]
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                           if k != "kind"), flush=True)
    for name, m, n, k in shapes:
        for r in bench_shape(name, m, n, k, variants, gen, args.iters, args.warmup):
            emit(r)
        torch.cuda.empty_cache()
    prof_rows = []
    if args.profile != "none":
        (pname, pm, pn, pk), = _parse_shapes(args.profile)
        prof_rows = profile_shape(pname, pm, pn, pk, variants, gen)
        for r in prof_rows:
            emit(r)
    if out:
        out.close()
    if failed:
        print(f"{failed} CHECK(S) FAILED: the times below are of wrong kernels")
    by = {}
    for r in rows:
        if r["kind"] == "time":
            by.setdefault(r["shape"], {})[r["variant"]] = r
    print(f"\n{'shape':<12} {'M':>5} {'N':>6} {'K':>6}  " + "  ".join(f"{v:<25}" for v in variants))
    for name, m, n, k in shapes:
        cells = []
        for v in variants:
            r = by[name][v]
            ratio = f"{r['ratio_vs_torch']:.3f}x" if r["ratio_vs_torch"] else "-"
            cells.append(f"{r['time_ms']:7.3f} {ratio:>6} {r['rel_err']:.1e}".ljust(25))
        print(f"{name:<12} {m:>5} {n:>6} {k:>6}  " + "  ".join(cells))
    print("(each: median ms, ratio to torch.matmul, relative error against the fp32 matmul of A -- of A's MX values "
          "for the mx variants)")
    if "gluon" in variants:
        others = [v for v in variants if v not in ("torch", "gluon")]
        print(f"\nratio to the plain Gluon build (the cost of the MX data path itself)\n{'shape':<12} "
              + " ".join(f"{v:>17}" for v in others))
        for name, m, n, k in shapes:
            base = by[name]["gluon"]["time_ms"]
            print(f"{name:<12} " + " ".join(f"{by[name][v]['time_ms'] / base:>16.3f}x" for v in others))
    print_profile(prof_rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
