"""Fixed cost per call, one GPU (a developer's device script):

    PYTHONPATH=. python -m dev.fixed_cost
    PYTHONPATH=. python -m dev.fixed_cost --plans   # host us per eager call, fast launch on / off
    PYTHONPATH=. python -m dev.fixed_cost --parts   # host ns of each piece an eager call's hit path runs
    PYTHONPATH=. python -m dev.fixed_cost --profile # cProfile of the calls still over 30 us (MX TP, MoE)

A fork of kosmos.core.device.exit_program and kosmos.core.schedule.claim (as of 82006a1, both then in
kosmos/device.py), inlined in _one_tile: CLAIM is the claim's relaxed atomic on head 1 plus a table load; EXIT
is exit_program's exit counter (head 2) and its reset of the 4 heads by the last program out, without the done
signal to peers (and without the device-epoch advance exit_program has since).

``--plans``: host time per eager call (kosmos_bench.timing.host_enqueue_us, as `kosmos bench tp --host-calls`
measures it: median of 200 back-to-back calls, time.perf_counter around each call, no synchronisation inside the
loop) of all_gather_matmul, matmul_reduce_scatter (bf16 and MXFP8) and the MoE layer
at W=1 on a small shape, with the launch plans' fast path on and off (kosmos.launch_plan.set_fast_launch), and
the plan-cache hit rate and launch counters of each run. Issue 13's bar: <= 30 us per call.

Times, with the bench's own timing (kosmos_bench.timing.time_op), an empty 132-program Triton launch, one
device-side descriptor per program, and torch.matmul / kosmos's two TP ops at W=1 on a one-tile shape and on
a 4096x2048x4096 GEMM; then lists the GPU work one kosmos call enqueues (torch profiler) and where its host
time goes (cProfile). The gap between a one-tile kosmos call and the empty launch is what every call pays
besides its tiles. Session 4 found a
device-to-host copy of the error record after every launch this way (~5 us per call; removed).
"""
import torch
import triton
import triton.language as tl

import kosmos
from kosmos.core import runtime
from kosmos_bench import timing


@triton.jit
def _empty(x_ptr):
    pass


@triton.jit
def _one_desc(x_ptr, N: tl.constexpr):
    d = tl.make_tensor_descriptor(x_ptr, shape=[N, N], strides=[N, 1], block_shape=[64, 64])
    if tl.program_id(0) == 100000:  # never true: the descriptor is built, nothing is stored
        d.store([0, 0], tl.zeros([64, 64], tl.bfloat16))


@triton.jit
def _one_tile(a_desc, b_desc, c_desc, heads_ptr, table_ptr, GRID: tl.constexpr, CLAIM: tl.constexpr,
              EXIT: tl.constexpr):
    """Program p: C[p*128:+128, :256] = A[p*128:+128, :64] @ B[:64, :256] -- one K step, the least a TMA GEMM
    tile can do -- optionally behind a queue claim + table load, and followed by kosmos's exit protocol."""
    pid = tl.program_id(0)
    row = pid * 128
    if CLAIM:
        t = tl.atomic_add(heads_ptr + 1, 1, sem="relaxed", scope="gpu")
        row = tl.load(table_ptr + t) * 128
    acc = tl.dot(a_desc.load([row, 0]), b_desc.load([0, 0]))
    c_desc.store([row, 0], acc.to(tl.bfloat16))
    if EXIT:
        n_out = tl.atomic_add(heads_ptr + 2, 1, sem="acq_rel", scope="gpu")
        if n_out == GRID - 1:
            for h in tl.static_range(4):
                tl.store(heads_ptr + h, 0)


@triton.jit
def _one_tile_device_desc(a_ptr, b_ptr, c_ptr, heads_ptr, table_ptr, M, GRID: tl.constexpr,
                          CLAIM: tl.constexpr, EXIT: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, 64], strides=[64, 1], block_shape=[128, 64])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[64, 256], strides=[256, 1], block_shape=[64, 256])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, 256], strides=[256, 1], block_shape=[128, 256])
    _one_tile(a_desc, b_desc, c_desc, heads_ptr, table_ptr, GRID, CLAIM, EXIT)


@triton.jit
def _one_tile_host_desc(a_desc, b_desc, c_desc, heads_ptr, table_ptr, GRID: tl.constexpr, CLAIM: tl.constexpr,
                        EXIT: tl.constexpr):
    _one_tile(a_desc, b_desc, c_desc, heads_ptr, table_ptr, GRID, CLAIM, EXIT)


def _tile_probes(timed):
    """Where a kosmos call's fixed cost goes: one 128x64x256 TMA tile per program, 132 programs, with device-
    or host-built descriptors, a queue claim + table load in front, kosmos's exit counter behind."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    grid = 132
    bf = dict(device="cuda", dtype=torch.bfloat16)
    a, b, c = torch.randn(grid * 128, 64, **bf), torch.randn(64, 256, **bf), torch.empty(grid * 128, 256, **bf)
    heads = torch.zeros(4, device="cuda", dtype=torch.int32)
    table = torch.arange(grid, device="cuda", dtype=torch.int32)
    ad, bd = TensorDescriptor.from_tensor(a, [128, 64]), TensorDescriptor.from_tensor(b, [64, 256])
    cd = TensorDescriptor.from_tensor(c, [128, 256])
    for claim, ex in [(False, False), (False, True), (True, True)]:
        tag = ("claim+" if claim else "") + ("exit" if ex else "bare")
        timed(f"132 one-K-step tiles, device descriptors, {tag}", lambda: _one_tile_device_desc[(grid,)](
            a, b, c, heads, table, grid * 128, GRID=grid, CLAIM=claim, EXIT=ex, num_warps=8))
        timed(f"132 one-K-step tiles, host descriptors, {tag}", lambda: _one_tile_host_desc[(grid,)](
            ad, bd, cd, heads, table, GRID=grid, CLAIM=claim, EXIT=ex, num_warps=8))


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    runtime.ensure_triton_allocator()
    x = torch.zeros(4096, device="cuda", dtype=torch.bfloat16)
    xb = torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16)
    rows = []

    def timed(name, fn):
        r = timing.time_op(fn, iters=50, warmup=10)
        rows.append((name, r["time_ms"] * 1e3, r["host_ms"] * 1e3))

    timed("empty triton kernel, 132 programs", lambda: _empty[(132,)](x))
    timed("one device descriptor per program, 132", lambda: _one_desc[(132,)](xb, N=256))
    _tile_probes(timed)
    for (m, k, n) in [(128, 64, 256), (4096, 2048, 4096)]:
        a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
        timed(f"torch.matmul {m}x{k}x{n}", lambda: a @ b)
        timed(f"kosmos.all_gather_matmul {m}x{k}x{n}", lambda: kosmos.all_gather_matmul(a, b)[1])
        timed(f"kosmos.matmul_reduce_scatter {m}x{k}x{n}", lambda: kosmos.matmul_reduce_scatter(a, b))
    from torch.profiler import ProfilerActivity, profile
    kosmos.matmul_reduce_scatter(a, b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            kosmos.matmul_reduce_scatter(a, b)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    _host_profile(lambda: kosmos.matmul_reduce_scatter(a, b))
    print(f"{'what':<50} {'gpu us':>8} {'host us':>8}")
    for name, g, h in rows:
        print(f"{name:<50} {g:8.1f} {h:8.1f}")


def _host_profile(call, n=200, sort=("cumulative",), limit=15):
    """Where a call's host time goes: cProfile over n calls (the GPU is kept busy by the calls themselves;
    host time per call = the profile's total / n), the 15 costliest functions by cumulative time."""
    import cProfile
    import pstats
    import time
    call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    print(f"host time per call, unprofiled: {host_us:.1f} us (enqueue only; n={n})")
    for key in sort:
        pstats.Stats(prof).sort_stats(key).print_stats(limit)


def profile_slow_calls():
    """cProfile (by own time and by cumulative time) of the eager calls still over issue 13's 30 us at W=1:
    the MX TP ops and the MoE layer (bf16, MXFP8), on the --plans shapes."""
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from kosmos import quant
    a, b, a_mx, x, router, w13, w2, w13_mx, w2_mx, k = _small_inputs()
    for name, call in [("all_gather_matmul mxfp8", lambda: kosmos.all_gather_matmul(a_mx, b)),
                       ("quantize_mx 128x256", lambda: quant.quantize_mx(a)),
                       ("moe_forward bf16", lambda: kosmos.moe_forward(x, router, w13, w2, top_k=k)),
                       ("moe_forward mxfp8", lambda: kosmos.moe_forward(x, router, w13_mx, w2_mx, top_k=k,
                                                                        precision="mxfp8"))]:
        print(f"==== {name}")
        _host_profile(call, sort=("tottime", "cumulative"), limit=22)
    kosmos.check_errors()


def _small_inputs():
    """The --plans / --profile shapes: a [128, 256] @ [256, 256] TP GEMM (bf16, a's MX form) and a T=128, H=256,
    F=256, E=8, k=2 MoE layer, with the experts' MX values made once, as a caller caches them (sessions 10-15
    made them inside the timed call: the mxfp8 MoE rows' 580-890 us were mostly that)."""
    from kosmos import quant
    dev = "cuda"
    a = torch.randn(128, 256, device=dev).to(torch.bfloat16)
    b = torch.randn(256, 256, device=dev).to(torch.bfloat16)
    t_, h, f, e, k = 128, 256, 256, 8, 2
    x = torch.randn(t_, h, device=dev).to(torch.bfloat16)
    router = torch.randn(e, h, device=dev).to(torch.bfloat16)
    w13 = (torch.randn(e, h, 2 * f, device=dev) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(e, f, h, device=dev) * 0.05).to(torch.bfloat16)
    return (a, b, quant.quantize_mx(a), x, router, w13, w2, quant.mx_values(w13, dim=1),
            quant.mx_values(w2, dim=1), k)


def plans(fast_only: bool = False):
    """Host us per eager call with the launch plans, fast launch on and off (module docstring); ``fast_only``:
    on only (``--fast-only``, for tree-against-tree A/Bs)."""
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import triton
    from kosmos import quant
    from kosmos.core import launch_plan
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b, a_mx, x, router, w13, w2, w13_mx, w2_mx, k = _small_inputs()
    cases = [
        ("all_gather_matmul 128x256x256", lambda: kosmos.all_gather_matmul(a, b)),
        ("matmul_reduce_scatter 128x256x256", lambda: kosmos.matmul_reduce_scatter(a, b)),
        ("all_gather_matmul mxfp8", lambda: kosmos.all_gather_matmul(a_mx, b)),
        ("matmul_reduce_scatter mxfp8", lambda: kosmos.matmul_reduce_scatter(a_mx, b)),
        ("moe_forward T128 H256 F256 E8 k2", lambda: kosmos.moe_forward(x, router, w13, w2, top_k=k)),
        ("moe_forward mxfp8", lambda: kosmos.moe_forward(x, router, w13_mx, w2_mx, top_k=k, precision="mxfp8")),
        ("quantize_mx 128x256", lambda: quant.quantize_mx(a)),  # cached launches since 2026-12-02 (quant._launch)
        ("torch.matmul 128x256x256", lambda: a @ b),
    ]
    print(f"triton {triton.__version__}, fast launch supported: {launch_plan.fast_launch_supported()}")
    print(f"{'what':<36} {'fast':>5} {'host us':>8} {'hit rate':>8} {'fast/normal launches':>21} {'off':>4}")
    import statistics
    rounds = 3 if fast_only else 1  # --fast-only: every case in turn, three times (the host's speed drifts)
    seen = {}
    for fast in ((True,) if fast_only else (True, False)):
        launch_plan.set_fast_launch(fast)
        for _ in range(rounds):
            for name, call in cases:
                launch_plan.reset_plan_stats()
                us = timing.host_enqueue_us(call)["host_us"]  # the bench's measurement (issue 13's bar)
                seen.setdefault((name, fast), []).append(us)
                s = launch_plan.plan_stats()
                print(f"{name:<36} {str(fast):>5} {us:8.1f} {s['hit_rate']:8.3f} "
                      f"{s['fast_launches']:>10}/{s['normal_launches']:<10} {s['fast_disabled']:>4} "
                      f"direct {s.get('direct_built', 0)}")
    if rounds > 1:
        print(f"median of {rounds} rounds (host us per call; each round the median of 200 calls):")
        for (name, fast), us in seen.items():
            print(f"  {name:<36} {statistics.median(us):8.1f}   rounds {' '.join(f'{u:.1f}' for u in us)}")
    launch_plan.set_fast_launch(True)
    kosmos.check_errors()
    print("DirectLaunch refused:", getattr(launch_plan, "DIRECT_REFUSED", "n/a"))
    for ws in runtime._WORKSPACES.values():  # which plans launch through DirectLaunch (launch_plan.py)
        for plan in ws._plans.values():
            fast = plan.launch.fast
            direct = getattr(fast, "direct", [None])[0] if fast is not None else None
            print(f"plan of {plan.launch.kernel.__name__}: state {plan.launch.state}, direct launch "
                  f"{'yes' if direct is not None else 'no'}")
    for kl in quant._PLANS.values():  # quantize_mx / dequantize_mx's cached launches (quant._launch)
        direct = getattr(kl.fast, "direct", [None])[0] if kl.fast is not None else None
        print(f"quant launch {kl.kernel.__name__} grid {kl.grid}: state {kl.state}, direct launch "
              f"{'yes' if direct is not None else 'no'}{', ' + kl.reason if kl.reason else ''}")
    if not fast_only:
        _host_profile(lambda: kosmos.matmul_reduce_scatter(a, b))


def _median_ns(fn, n=2000):
    """Host ns of one call of ``fn``: timing.host_enqueue_us's median over ``n`` calls after 0.05 s of warm calls
    (session 15's --parts tables were taken after 20 warm calls)."""
    return timing.host_enqueue_us(fn, calls=n, warm_s=0.05)["host_us"] * 1e3


def parts():
    """Host ns of each piece a hit (an eager call that finds its plan) runs, one at a time, on this machine's
    host: what the <= 30 us budget (issue 13) can be spent on. Also prints Triton's launcher source (the fast
    path's convention is version-specific: kosmos/launch_plan.py)."""
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import inspect
    import triton
    from triton.runtime.driver import driver
    from triton.tools.tensor_descriptor import TensorDescriptor
    from kosmos.core import launch_plan
    import triton.backends.nvidia.driver as nvd
    print(f"triton {triton.__version__} torch {torch.__version__}")
    try:
        print(inspect.getsource(nvd.CudaLauncher))
        print(inspect.getsource(nvd.make_tensordesc_arg))
        print(inspect.getsource(nvd.wrap_handle_tensordesc))
        src = inspect.getsource(nvd.make_launcher)
        print("\n".join(ln for ln in src.splitlines() if "ParseTuple" in ln or "format" in ln.lower()))
    except (OSError, TypeError, AttributeError) as e:
        print("source not available:", e)
    runtime.ensure_triton_allocator()
    dev = torch.device("cuda", 0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    a, b = torch.randn(128, 256, **bf), torch.randn(256, 256, **bf)
    x = torch.zeros(4096, **bf)
    ev = torch.cuda.Event()
    pinned = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    ws = runtime.get_workspace(None, dev)
    rows = []

    def piece(name, fn):
        try:
            ns = _median_ns(fn)
        except Exception as e:  # noqa: BLE001 -- a probe that does not fit this Triton: say so, go on
            print(f"{name}: {type(e).__name__}: {e}")
            return
        rows.append((name, ns))
        print(f"  {name:<64} {ns:9.0f} ns", flush=True)

    piece("torch.empty(128, 256) bf16 cuda", lambda: torch.empty((128, 256), **bf))
    piece("torch.empty(128, 256) bf16 cuda, shape tuple + dtype + device", lambda: torch.empty(
        (128, 256), dtype=torch.bfloat16, device=dev))
    piece("torch.cuda.is_available()", torch.cuda.is_available)
    piece("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
    piece("runtime.capturing()", runtime.capturing)
    piece("Event.record()", ev.record)
    piece("Event.query()", ev.query)
    piece("int(pinned[0])", lambda: int(pinned[0]))
    piece("runtime.ensure_triton_allocator()", runtime.ensure_triton_allocator)
    piece("driver.active.get_current_device()", driver.active.get_current_device)
    piece("driver.active.get_current_stream(0)", lambda: driver.active.get_current_stream(0))
    piece("torch.cuda.current_device()", torch.cuda.current_device)
    piece("runtime.World.of(None, None)", lambda: runtime.World.of(None, None))
    piece("runtime.get_workspace(None, dev)", lambda: runtime.get_workspace(None, dev))
    piece("launch_plan.input_key(a)", lambda: launch_plan.input_key(a))
    piece("launch_plan.hooks_active()", launch_plan.hooks_active)
    piece("ws.before_launch()", ws.before_launch)
    piece("ws.after_launch()", ws.after_launch)
    piece("b.t()", b.t)
    # Triton launches: the normal path, the compiled launcher (the plans' fast path), with 0 and 3 descriptors
    k0 = _empty[(132,)](x)
    piece("empty kernel, kernel[grid](x)", lambda: _empty[(132,)](x))
    stream = driver.active.get_current_stream(0)
    piece("empty kernel, compiled.run", lambda: k0.run(132, 1, 1, stream, k0.function, k0.packed_metadata,
                                                        None, None, None, x))
    c = torch.empty(132 * 128, 256, **bf)
    aa, heads = torch.randn(132 * 128, 64, **bf), torch.zeros(4, device=dev, dtype=torch.int32)
    table = torch.arange(132, device=dev, dtype=torch.int32)
    ad, bd_ = TensorDescriptor.from_tensor(aa, [128, 64]), TensorDescriptor.from_tensor(b[:64], [64, 256])
    cd = TensorDescriptor.from_tensor(c, [128, 256])
    kw = dict(GRID=132, CLAIM=False, EXIT=False)
    k3 = _one_tile_host_desc[(132,)](ad, bd_, cd, heads, table, **kw, num_warps=8)
    piece("3-descriptor kernel, kernel[grid](...)", lambda: _one_tile_host_desc[(132,)](
        ad, bd_, cd, heads, table, **kw, num_warps=8))
    tail = (132, False, False)
    piece("3-descriptor kernel, compiled.run", lambda: k3.run(132, 1, 1, stream, k3.function, k3.packed_metadata,
                                                               None, None, None, ad, bd_, cd, heads, table, *tail))
    tmpl = launch_plan.descriptor_template(aa, [128, 64])
    piece("launch_plan.descriptor(template, t)", lambda: launch_plan.descriptor(tmpl, aa))
    meta = getattr(k3.metadata, "tensordesc_meta", None)
    if meta:
        nargs = len(inspect.signature(nvd.make_tensordesc_arg).parameters)
        piece("make_tensordesc_arg (CUtensorMap encode)", lambda: nvd.make_tensordesc_arg(ad, meta[0],
                                                                                        *([None] * (nargs - 2))))
    launch = k3.run.launch
    cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in launch.__closure__ or ()))) \
        if hasattr(launch, "__code__") else {}
    print("launcher closure:", {k: type(v).__name__ for k, v in cells.items()})
    if "launcher" in cells:
        raw = cells["launcher"]
        piece("3-descriptor kernel, the launcher's own launch (wrapper: descriptor expansion)", lambda: launch(
            132, 1, 1, stream, k3.function, False, False, None, None, k3.packed_metadata, None, None, None,
            ad, bd_, cd, heads, table, *tail))
        print("raw launcher:", raw)
    cases = [("kosmos.all_gather_matmul 128x256x256 (hit)", lambda: kosmos.all_gather_matmul(a, b)),
             ("kosmos.matmul_reduce_scatter 128x256x256 (hit)", lambda: kosmos.matmul_reduce_scatter(a, b)),
             ("torch.matmul 128x256x256", lambda: a @ b)]
    for name, fn in cases:
        piece(name, fn)
    kosmos.check_errors()
    print(f"{'piece':<64} {'host ns':>9}")
    for name, ns in rows:
        print(f"{name:<64} {ns:9.0f}")


if __name__ == "__main__":
    import sys
    if "--parts" in sys.argv[1:]:
        parts()
    elif "--profile" in sys.argv[1:]:
        profile_slow_calls()
    else:
        plans("--fast-only" in sys.argv[1:]) if "--plans" in sys.argv[1:] else main()
