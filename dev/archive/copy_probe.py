"""How fast do 1..P Triton programs copy bytes device to device? (a developer's single-GPU probe)

    PYTHONPATH=. python -m dev.archive.copy_probe --out DIR [--quick] [--mib 256]

The communication tasks of the fused kernels copy rows on a few programs (CTAs) while the others run GEMM
tiles, so what matters is the bandwidth ONE program gets with a given copy method and how it scales with the
number of programs. Each method is a @triton.jit kernel launched on a grid of P programs; program p copies
the p-th contiguous, equal share of a flat bf16 buffer, src -> dst:

  copy_flat-B  kosmos.kernels.common.copy_flat (what the fused kernels' comm tasks run), BLOCK per step
  tma-RxC-sS   the buffer viewed as a [N/C, C] matrix, device-side tensor descriptors, one [R, C] block per
               iteration (load -> store) over the program's rows, launched with num_stages=S

P in {1, 4, 8, 16, 32, 132} (--quick: {1, 8, 32}). The buffer is --mib MiB (far above the L2), except for P=1,
which copies --mib/8 MiB so that one program does not take long; sizes are trimmed so that every share is a
whole number of 128x256 blocks (the exact bytes are in each record). Per (method, P): one launch into a
NaN-poisoned dst, checked with torch.equal; 2 warm-up launches; the median of 10 launches timed with CUDA
events. GB/s counts bytes read + bytes written. A method that fails to compile or run is recorded as failed
(one-line error) and skipped at the remaining P; a wrong copy is recorded with ok=false. Appends an env
record and one record per measurement to DIR/copy-probe.jsonl; prints a GB/s table (total, per program) last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from kosmos.gemm.tiles import copy_flat

UNIT = 128 * 256  # share granule (elements): a multiple of every BLOCK and R * C below
PROGRAMS, QUICK_PROGRAMS = (1, 4, 8, 16, 32, 132), (1, 8, 32)


@triton.jit
def flat_copy(src_ptr, dst_ptr, share, BLOCK: tl.constexpr):
    """The fused kernels' own copy primitive (kosmos.kernels.common.copy_flat) on this program's share."""
    base = tl.program_id(0).to(tl.int64) * share
    copy_flat(src_ptr + base, dst_ptr + base, share, BLOCK)


@triton.jit
def tma_copy(src_ptr, dst_ptr, rows_total, rows_share, R: tl.constexpr, C: tl.constexpr):
    src = tl.make_tensor_descriptor(src_ptr, shape=[rows_total, C], strides=[C, 1], block_shape=[R, C])
    dst = tl.make_tensor_descriptor(dst_ptr, shape=[rows_total, C], strides=[C, 1], block_shape=[R, C])
    row0 = tl.program_id(0) * rows_share
    for r in range(row0, row0 + rows_share, R):
        dst.store([r, 0], src.load([r, 0]))


def methods():
    """Session 4 measured on one H200 (GB/s per program at P=8): copy_flat (int64 indices, as now) 33 / 55 /
    82 at 4096 / 8192 / 16384 elements per step; with advancing pointers and int32 offsets 33 / 57 / 87 / 96
    at 4096 ... 32768 (not kept: more registers in the fused kernel); two 8192 blocks in flight per step 85;
    TMA [R, 256] blocks 30 / 45 / 62 at R = 32 / 64 / 128 (num_stages 3 slower than 1). Kept: the primitive
    itself and the best TMA block."""
    out = [dict(method=f"copy_flat-{b}", block=b) for b in (4096, 8192, 16384, 32768)]
    out += [dict(method="tma-128x256-s1", R=128, C=256, stages=1)]
    return out


def launch(m, src, dst, P):
    n = src.numel()
    if "R" in m:
        rows = n // m["C"]
        tma_copy[(P,)](src, dst, rows, rows // P, R=m["R"], C=m["C"], num_warps=8, num_stages=m["stages"])
    else:
        flat_copy[(P,)](src, dst, n // P, BLOCK=m["block"], num_warps=8)


def buffer_elems(P, mib):
    """P equal shares of whole UNITs, --mib MiB in all (--mib/8 for one program), at least one UNIT each."""
    total = (mib if P > 1 else mib / 8) * 2**20 / 2
    return P * max(1, int(total) // P // UNIT) * UNIT


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def median_us(fn, device, warmup, reps):
    for _ in range(warmup):
        fn()
    sync(device)
    if device != "cuda":  # interpreter smoke: wall clock, meaningless as bandwidth
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def one_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


def measure(m, P, src, dst, broken, args):
    rec = dict(method=m["method"], block=m.get("block"), R=m.get("R"), C=m.get("C"), stages=m.get("stages"),
               programs=P, bytes=src.numel() * src.element_size(), time_us=None, gbps=None,
               gbps_per_program=None, ok=False, error=None)
    if m["method"] in broken:
        rec["error"] = "skipped (failed earlier): " + broken[m["method"]]
        return rec
    try:
        dst.fill_(float("nan"))
        launch(m, src, dst, P)  # the first launch compiles
        sync(args.device)
        rec["ok"] = bool(torch.equal(dst, src))
        if not rec["ok"]:
            rec["error"] = "dst != src after one launch"
        t = median_us(lambda: launch(m, src, dst, P), args.device, args.warmup, args.reps)
    except Exception as e:  # compile error, out of resources, launch failure: record it and go on
        rec["ok"], rec["error"] = False, one_line(e)
        broken[m["method"]] = rec["error"]
        return rec
    gbps = 2 * rec["bytes"] / (t * 1e-6) / 1e9
    rec.update(time_us=round(t, 2), gbps=round(gbps, 2), gbps_per_program=round(gbps / P, 3))
    return rec


def print_table(results, names, programs, mib):
    def cell(rec, key, fmt):
        if rec is None or rec["gbps"] is None:
            return "fail"
        return format(rec[key], fmt) + ("" if rec["ok"] else "!")
    for title, key, fmt in (("GB/s (read + write)", "gbps", ".0f"), ("GB/s per program", "gbps_per_program", ".1f")):
        print(f"\n{title}; P=1 copies {mib / 8:g} MiB, other P {mib:g} MiB ('!' = wrong copy, fail = error)")
        print(f"{'method':<16}" + "".join(f"{'P=' + str(p):>9}" for p in programs))
        for name in names:
            print(f"{name:<16}" + "".join(f"{cell(results.get((name, p)), key, fmt):>9}" for p in programs))


def main(argv=None):
    ap = argparse.ArgumentParser(description="Single-GPU copy bandwidth of 1..P Triton programs per copy method.")
    ap.add_argument("--out", required=True, help="folder for copy-probe.jsonl (appended)")
    ap.add_argument("--quick", action="store_true", help="only P in {1, 8, 32}")
    ap.add_argument("--mib", type=float, default=256, help="buffer MiB (P=1 copies a eighth of it)")
    ap.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=10, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)  # cpu: smoke
    args = ap.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu runs the kernels under the interpreter: set TRITON_INTERPRET=1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA GPU is visible")
    dev = args.device
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    programs = QUICK_PROGRAMS if args.quick else PROGRAMS
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "copy-probe.jsonl")
    cuda = dev == "cuda"
    env = dict(record="env", gpu=torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)",
               sm_count=torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
               torch=torch.__version__, triton=triton.__version__, programs=list(programs), mib=args.mib,
               p1_mib=args.mib / 8, warmup=args.warmup, reps=args.reps, dtype="bfloat16")
    print(json.dumps(env), flush=True)
    results, broken, t0 = {}, {}, time.time()
    with open(path, "a") as f:
        f.write(json.dumps(env) + "\n")
        for P in programs:
            src = torch.empty(buffer_elems(P, args.mib), dtype=torch.bfloat16, device=dev).normal_()
            dst = torch.empty_like(src)
            for m in methods():
                rec = measure(m, P, src, dst, broken, args)
                results[(m["method"], P)] = rec
                f.write(json.dumps(rec) + "\n")
                f.flush()
                gbps = "fail" if rec["gbps"] is None else f"{rec['gbps']:.1f}"
                print(f"P={P:<4} {m['method']:<16} {gbps:>8} GB/s  ok={rec['ok']}"
                      + (f"  {rec['error']}" if rec["error"] else ""), flush=True)
            del src, dst
    print(f"\n{len(results)} measurements in {time.time() - t0:.0f} s -> {path}")
    print_table(results, [m["method"] for m in methods()], programs, args.mib)


if __name__ == "__main__":
    main()
