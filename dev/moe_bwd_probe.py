"""Where does the MoE backward's time go? (issue 15; a developer probe, not product code.)

    PYTHONPATH=. python -m dev.moe_bwd_probe --json $OUT/moe-bwd-probe.jsonl          # on the device (one H200)
        [--model qwen3-235b] [--tokens 4096] [--routing uniform] [--experts-scale 1] [--iters 20] [--warmup 5]
        [--decision kosmos|route] [--no-profile] [--max-seconds 130] [--seed 0] [--wgrad-kernel persistent|tiles]
        [--wgrad-tiles 128,128,64,8,3] [--one-launch]
    TRITON_INTERPRET=1 PYTHONPATH=. python -m dev.moe_bwd_probe --cpu-smoke [--model deepseek-v3]  # CPU, no timing
    PYTHONPATH=. python -m dev.moe_bwd_probe --table FILE.jsonl                  # re-print a finished run's table

Issue 15's bar: the kosmos MoE backward (``kosmos.kernels.moe_backward.moe_backward_w1``) >= 1.3x faster than the
nccl-a2a baseline's autograd backward at EP=1, and its expert GEMMs >= 80% of torch._grouped_mm's TFLOP/s. On one
H200 at qwen3-235b, 4096 tokens, the backward took 1.6x nccl-a2a's in session 9
(results/h200x1/history/s9-moe-bwd-ep1-d76938f.jsonl: 15.4 vs 9.7 ms, uniform); in session 11, 8.27 vs 9.70 ms
(results/h200x1/s11/d). This probe splits the backward into the stages ``moe_backward`` runs at W=1 and times
each one alone.

One EP=1 point, built by the MoE bench's own builders (kosmos_bench/moe.py: ``make_router_inputs``,
``make_expert_weights``, ``MoEInputs``, the output gradient dy drawn as ``run_case`` draws it; seed 0, rank 0 by
default): fresh random bf16 inputs, the model's shapes from kosmos/models.py (``--experts-scale S`` divides the
expert count by S, keeping H, F, top-k and the groups: deepseek-v3's 256 experts at 4096 tokens ran the bench's
bwd out of memory, and in this probe the weight gradients of a stage and of the whole call (bf16: 21 GiB each at
S = 1) are alive at once for the bitwise check -- use --experts-scale 2 or 4 there).
The routing decision is the kosmos forward's (``moe_forward(return_routing=True)``, the bench's bwd setup;
``--decision route``: moe_reference.route, no forward kernel to compile).

Measured, each with ``kosmos_bench.timing.time_op`` (CUDA events, L2 flushed before every call, ~2 ms of GPU spin
hiding the host's enqueue, median of --iters; p20/p80 and the host's enqueue time ``host_ms`` too):

* every stage of ``moe_backward`` at W=1, in its order, as its own timed region, on the previous stages' outputs
  (``make_stages``: the same calls and torch lines as moe_backward, so the stages' outputs composed are its gradients
  -- checked bitwise in every run against one moe_backward_w1 call on the same decision, row ``summary`` field
  ``bitwise_equal``, and by tests/test_moe_bwd_probe.py):
    sort             the pairs sorted by expert, counts per expert                      torch
    permute          x_rows, dy_rows, w_pair gathered in expert order                    torch
    gemm1_recompute  [g | u] = x_rows @ W13[e] (the forward's GEMM1 again)               torch._grouped_mm
                     -- timed always; with the forward's g | u (decision "kosmos": moe_forward save_gu, as
                     the bench and kosmos.nn.MoE at EP=1) moe_backward does not run it (not in the stage sum)
    gu_saved         [g | u] the backward uses: the forward's, gathered into its order   torch
                     (``rel_err_vs_recompute``), or the recompute's (decision "route")
    dgrad2_swiglu    z = dy_rows W2^T, SwiGLU backward, gate grads (+ one partial-sum),  kosmos Triton
                     and h = silu(g) u -> bf16 from its epilogue (moe_backward.dgrad2_emits_h(); the stage
                     row's ``h_bitwise_swiglu_h``: that h against swiglu_h's, bit for bit)
    h_recompute      h = silu(g) u -> bf16 (for wgrad2; one pass, torch's sigmoid formula)  kosmos Triton
                     -- nothing (a ~0 ms row) when dgrad2 emitted h
    do_rows          w * dy[tok] -> bf16 (for wgrad2; one pass, no fp32 temporary)        kosmos Triton
    wgrad2           dW2[e] = h^T do, bf16 out (the parameters' dtype; fp32 accumulation) kosmos Triton
    wgrad1           dW13[e] = x_rows^T [dg | du], bf16 out                              kosmos Triton
    dgrad1           dx_rows = [dg | du] W13^T                                           kosmos Triton
    unpermute_dx     dx_rows gathered per token, fp32 slot-order sum (one launch)        kosmos Triton
    router_logits    gate grads to pair order, logits recomputed (bf16 tensor cores, fp32 acc), weights  torch
    router_bwd       dq, dlogits, dWr = dl^T x, dx_r = dl Wr (hi + lo bf16 GEMMs, fp32 acc) torch
    dx_sum           dx = dx_e + dx_r -> bf16                                            torch
  and, for every expert-GEMM stage, the same GEMM on the same row counts through torch._grouped_mm (bf16 in,
  fp32 accumulation; the weight gradients as torch's autograd computes them, ``_grouped_mm(a.t(), b, offs)``
  over the rows, out in fp32 when this torch's _grouped_mm takes out_dtype=float32, else bf16: the env row's
  ``wgrad_ref_out_dtype`` says which), its TFLOP/s, the ratio kosmos/torch of TFLOP/s (= torch time / kosmos
  time) and the relative Frobenius error between the two outputs (dgrad2: none, kosmos's output is after the
  SwiGLU backward). FLOPs are the GEMM's 2*M*N*K alone (dgrad2's epilogue not counted);
* the whole ``moe_backward_w1`` call as the bench times it (a ``timing.Split``: the kosmos forward untimed, the
  backward timed), and the sum of the stages against it;
* the nccl-a2a baseline's backward as the bench times it (``kosmos_bench.moe.a2a_backward``: autograd through
  moe_forward_a2a(fp32=False), the forward untimed, torch.autograd.grad timed);
* with the profiler (``--no-profile`` skips it): one call of each stage and of both whole backwards under
  torch.profiler -- the number of device launches, the sum of their device times (``kernel_ms``, L2 warm) and the
  heaviest kernels by name, so that nccl-a2a's backward is split into its GEMMs and the rest as well.

Output: JSONL to --json (an ``env`` row from kosmos_bench.environment, then ``stage`` rows in order, ``total`` rows
for kosmos and nccl-a2a, a ``summary`` row), and a table printed last. ``--max-seconds`` (default 130) starts no
new measurement past that many seconds since start-up (what is done is kept; skipped rows say so).

Runtime on one H200 (estimate, default point; not yet run on a GPU): start-up and inputs ~15-20 s; the kosmos
forward's compile (for the decision and the bench-style whole call; ``--decision route`` skips it) ~20-40 s; the
three backward kernels' compiles ~10 s; timing: 2 whole calls (kosmos 15 ms + its 3 ms forward, nccl-a2a 10 + 5
ms), 13 stages and 5 torch references, each time_op 25 calls plus ~3 ms of flush/spin per call: ~5 s; the
profiler (15 single calls, the first one starting kineto) ~5-10 s. In all ~60-90 s; peak memory ~40 GiB (the
bench's bwd point: 38 GiB). The --max-seconds guard (130; 0: none) stops starting new measurements, so a slow
compile costs the last stages' timings (their outputs are still computed) rather than the whole run.

CPU (``--cpu-smoke``, TRITON_INTERPRET=1 set before Python starts): a tiny stand-in of the model's routing kind
(softmax or sigmoid-grouped), every stage, reference, whole call and baseline called once, nothing timed (rows'
time_ms null) -- a check of the flow and of the bitwise composition (tests/test_moe_bwd_probe.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dev.rows import Rows
from kosmos.config import MoEBackwardConfig, config_dict
from kosmos.ops.moe_backward import api as bwd_api
from kosmos.ops.moe_backward import layout as bwd_layout
from kosmos.ops.moe_backward import multi_launch as bwd_multi
from kosmos.ops.moe_backward import rows as bwd_rows
from kosmos.ops.moe_backward import tiles as bwd_tiles

START = time.monotonic()  # reset by main(): deadlines count from the run, not from the import
GRAD_NAMES = ("dx", "d_router", "dw13", "dw2")  # moe_backward_w1's outputs, in its order
BAR_SPEEDUP = 1.3   # issue 15: nccl-a2a backward time / kosmos backward time >= 1.3
BAR_GEMM = 0.8      # issue 15: each kosmos expert GEMM >= 80% of torch._grouped_mm's TFLOP/s
# tiny stand-ins for --cpu-smoke, one per routing kind (interpreter tiles are 16 wide)
SMOKE_MODELS = {
    "softmax": dict(hidden=32, expert_ffn=32, experts=8, top_k=2, n_group=1, topk_group=1),
    "sigmoid-grouped": dict(hidden=32, expert_ffn=32, experts=8, top_k=3, n_group=4, topk_group=2),
}
SMOKE_TOKENS = 32
GEMM_KERNEL_HINTS = ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "grouped", "_expert_wgrad_",
                     "_dgrad2_swiglu_kernel", "_dgrad1_kernel", "matmul")


# ----------------------------------------------------------------------------------------------- the point
@dataclass
class Point:
    """One EP=1 point: the bench's inputs (``inp``: a kosmos_bench.moe.MoEInputs), the routing decision the
    kosmos backward runs on, and how it was made."""
    inp: object
    weights: torch.Tensor
    experts: torch.Tensor
    decision: str
    config: object
    redrawn: int
    saved: object = None  # the forward's g | u (moe_forward.SavedGateUp) when the decision is the kosmos forward's


def point_model(name: str, experts_scale: int = 1, smoke: bool = False):
    """The MoEModel of ``name`` (kosmos/models.py), its experts divided by ``experts_scale``; ``smoke``: the tiny
    stand-in of its routing kind (SMOKE_MODELS) instead."""
    from kosmos_bench import moe as bm
    m = bm.moe_model(name)
    if smoke:
        return dataclasses.replace(m, name=f"{m.name}-tiny", **SMOKE_MODELS[m.routing])
    if experts_scale != 1:
        e = m.experts // experts_scale
        if experts_scale < 1 or m.experts % experts_scale or e % m.n_group or \
                m.top_k > m.topk_group * (e // m.n_group) or e < m.top_k:
            raise ValueError(f"--experts-scale {experts_scale}: {m.name}'s {m.experts} experts (n_group "
                             f"{m.n_group}, topk_group {m.topk_group}, top-k {m.top_k}) do not shrink to "
                             f"{m.experts / experts_scale:g}")
        m = dataclasses.replace(m, name=f"{m.name}/e{e}", experts=e)
    return m


def build_point(m, tokens: int, routing: str, *, seed: int = 0, device="cpu", decision: str = "route",
                config=None, bwd_config: MoEBackwardConfig | None = None) -> Point:
    """The bench's inputs for (m, tokens, routing) at rank 0 of W=1 (kosmos_bench.moe.run_case's builders) and the
    routing decision: "kosmos" = the bench's bwd setup (kosmos forward, return_routing=True; CUDA), "route" =
    moe_reference.route (what nccl-a2a's layer routes with)."""
    from kosmos.reference.moe import route
    from kosmos_bench import moe as bm
    device = torch.device(device)
    rank, world = 0, 1
    x, wr, bias, redrawn = bm.make_router_inputs(m, tokens, routing, rank, seed, device)
    w13, w2 = bm.make_expert_weights(m, world, rank, seed, device)
    # the output gradient exactly as run_case draws it (bwd direction)
    dy = torch.randn(tokens, m.hidden, generator=bm._gen(device, 1_000_003 * seed + 613 * rank + 11), device=device,
                     dtype=torch.bfloat16)
    inp = bm.MoEInputs(m, x, wr, bias, w13, w2, "bf16", direction=bm.BWD, dy=dy,
                       bwd_config=bwd_config or MoEBackwardConfig())
    if config is None:
        config = bm.MoESettings(direction=bm.BWD, seed=seed).config("moe_fwd")
    saved = None
    if decision == "kosmos":
        weights, experts, saved = bm._kosmos_backward(inp, {}, config).setup()
    elif decision == "route":
        weights, experts = route(x, wr, m.top_k, **inp.route_kw())
    else:
        raise ValueError(f"decision {decision!r}: 'kosmos' or 'route'")
    return Point(inp, weights, experts, decision, config, redrawn, saved)


def whole_backward(pt: Point):
    """kosmos's whole backward as the bench times it: a timing.Split whose setup makes the decision (decision
    "kosmos": the bench's own ``_kosmos_backward``, the forward untimed) and whose run is moe_backward_w1."""
    from kosmos.ops.moe_backward.api import moe_backward_w1
    from kosmos_bench import moe as bm
    from kosmos_bench import timing
    if pt.decision == "kosmos":
        return bm._kosmos_backward(pt.inp, {}, pt.config)
    inp = pt.inp

    def backward(state):
        weights, experts, saved = state
        return (*moe_backward_w1(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy, weights, experts,
                                 saved_gu=saved, **inp.backward_kw()), experts)
    return timing.Split(lambda: (pt.weights, pt.experts, None), backward)


# ----------------------------------------------------------------------------------------------- the stages
@dataclass(frozen=True)
class Gemm:
    """An expert GEMM stage's torch reference: ``ref(state, offs)`` -> the same GEMM through torch._grouped_mm;
    ``flops(R, H, F)``; ``out``: the stage output compared with the reference's (None: not comparable)."""
    flops: Callable
    ref: Callable
    desc: str
    out: str | None
    alt: Callable | None = None  # tried when ``ref`` raises (the weight gradients: a contiguous transposed copy)
    alt_desc: str | None = None
    row_operands: tuple = ()  # the state's row tensors ``ref`` reads: packed (untimed) when the stages are padded
    rows_out: bool = False    # ``out`` has a row per expert row (padded like the stages' rows)


@dataclass(frozen=True)
class Stage:
    name: str
    impl: str                 # what runs it: "torch", "torch._grouped_mm", "kosmos triton (+ torch glue)"
    what: str
    needs: tuple              # state keys read
    fn: Callable              # state -> {new keys}
    gemm: Gemm | None = None


def _wgrad_ref(a, b, offs, out_dtype, copy: bool = False):
    """dW[e] = a[rows of e]^T b[rows of e] as torch's autograd of _grouped_mm computes the weight gradient
    (_grouped_mm_mat2_backward: mat_a transposed -- a column-major view --, the groups along K); ``copy``: the
    transposed a made contiguous first (the copy is part of what is timed)."""
    at = a.t().contiguous() if copy else a.t()
    if out_dtype == torch.bfloat16:
        return torch._grouped_mm(at, b, offs=offs)
    return torch._grouped_mm(at, b, offs=offs, out_dtype=out_dtype)


def wgrad_ref_dtype(device) -> tuple[torch.dtype, str | None]:
    """float32 when this torch's _grouped_mm gives a 2d x 2d (weight-gradient) product in fp32, else bfloat16;
    and why not."""
    a = torch.zeros(32, 16, dtype=torch.bfloat16, device=device)
    offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
    try:
        out = torch._grouped_mm(a.t(), a, offs=offs, out_dtype=torch.float32)
        if out.dtype == torch.float32:
            return torch.float32, None
        return torch.bfloat16, f"out_dtype=float32 gave {out.dtype}"
    except Exception as e:  # noqa: BLE001
        return torch.bfloat16, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"


def make_stages(pt: Point, wgrad_dtype=torch.bfloat16, wgrad_tiles=None) -> list[Stage]:
    """moe_backward's W=1 path (kosmos/kernels/moe_backward.py), split at its stage boundaries: the same calls
    and the same torch lines, in its order. Each stage reads the state (the point's tensors and the earlier
    stages' outputs) and returns its new tensors."""
    from kosmos.reference import moe as mr
    inp = pt.inp
    x, router_weight, w13, w2, dy = inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy
    kw = inp.backward_kw()
    routing, renormalize, routed_scaling = kw["routing"], kw["renormalize"], kw["routed_scaling"]
    config = inp.bwd_config
    n_tok = x.shape[0]
    n_exp = router_weight.shape[0]
    k = pt.experts.shape[1]
    f = w2.shape[1]
    wdt = bwd_api._wgrad_dtype(w13, None)  # moe_backward's default: the parameters' dtype
    padded = rows_padded(pt)  # moe_backward's row layout (its rule)
    hid = x.shape[1]
    flat_tiles = [bwd_tiles.wgrad_flat_tiles(wdt, ka, kb) for ka, kb in ((f, hid), (hid, 2 * f))]
    dy_b = dy.to(torch.bfloat16)

    def sort(s):
        experts = s["experts"].long()
        flat = experts.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        out = {"experts_l": experts, "order": order, "tok": order // k, "counts": bwd_layout.expert_counts(flat, n_exp)}
        if padded:  # the padded layout's bookkeeping (index tensors only), as moe_backward does it
            pad_offs, row_of, real_of, end = bwd_layout.padded_layout(out["counts"], order.shape[0])
            valid, real = real_of >= 0, real_of.clamp(min=0)
            out.update(pad_offs=pad_offs, row_of=row_of, valid=valid, real=real, end=end,
                       src_idx=torch.where(valid, out["tok"][real], -1))
        return out

    def permute(s):
        tok, order = s["tok"], s["order"]
        w_pair = s["weights"].reshape(-1).float()[order].contiguous()
        if padded:  # do = w * dy from the same read of dy's rows (the do_rows stage then has nothing to do)
            w_pair = torch.where(s["valid"], w_pair[s["real"]], 0.0)
            dy_rows, do = bwd_rows.gather_rows_and_scaled(dy_b, s["src_idx"], w_pair, s["end"])
            return {"x_rows": bwd_rows.gather_rows(x, s["src_idx"], s["end"]), "dy_rows": dy_rows, "do_rows": do,
                    "w_pair": w_pair}
        return {"x_rows": x[tok].contiguous(), "dy_rows": dy_b[tok].contiguous(), "w_pair": w_pair}

    def gemm1(s):  # timed either way: what keeping g | u saves (or costs, when the decision is route's)
        return {"gu_recomputed": bwd_api._expert_gemm1(s["x_rows"], w13, s["counts"], s.get("pad_offs"))}

    def gu_saved(s):  # moe_backward's g | u: the forward's, gathered into the backward's order, or the recompute
        if pt.saved is None:
            return {"gu": s["gu_recomputed"]}
        if padded:
            idx = pt.saved.backward_order_index(s["counts"], s["order"].shape[0])
            return {"gu": bwd_rows.gather_rows(pt.saved.gu, torch.where(s["valid"], idx[s["real"]], -1), s["end"])}
        return {"gu": pt.saved.in_backward_order(s["counts"], s["x_rows"].shape[0])}

    emits_h = bwd_rows.dgrad2_emits_h(config) or padded  # moe_backward's choice: h from dgrad2's epilogue, or swiglu_h's pass

    def dgrad2(s):
        if emits_h:
            dgu, dw_rows, h = bwd_multi.expert_dgrad2_swiglu(s["dy_rows"], s["gu"], w2, s["w_pair"], s["counts"],
                                                      emit_h=True, fused=False if padded else None,
                                                      offs=s.get("pad_offs"), valid=s.get("valid"), config=config)
            return {"dgu": dgu, "dw_rows": dw_rows, "h": h}
        dgu, dw_rows = bwd_multi.expert_dgrad2_swiglu(s["dy_rows"], s["gu"], w2, s["w_pair"], s["counts"],
                                                      config=config)
        return {"dgu": dgu, "dw_rows": dw_rows}

    def h_recompute(s):  # nothing left to do when dgrad2 emitted h (the row stays: a ~0 ms stage)
        return {} if emits_h else {"h": bwd_rows.swiglu_h(s["gu"], f, config)}

    def do_rows(s):
        if padded:  # gathered with dy_rows in permute
            return {}
        return {"do_rows": bwd_rows.do_rows_of(dy, s["tok"], s["dy_rows"], s["w_pair"], 1)}

    def wgrad2(s):
        if padded:
            return {"dw2": bwd_multi.expert_weight_grads_padded(s["h"], s["do_rows"], s["counts"], s["pad_offs"],
                                                         out_dtype=wdt, tiles=flat_tiles[0])}
        return {"dw2": bwd_multi.expert_weight_grads(s["h"], s["do_rows"], s["counts"], out_dtype=wdt,
                                                     tiles=wgrad_tiles or bwd_multi.wgrad2_tiles(s["h"], s["counts"]),
                                                     config=config)}

    def wgrad1(s):
        if padded:
            return {"dw13": bwd_multi.expert_weight_grads_padded(s["x_rows"], s["dgu"], s["counts"], s["pad_offs"],
                                                          out_dtype=wdt, tiles=flat_tiles[1])}
        return {"dw13": bwd_multi.expert_weight_grads(s["x_rows"], s["dgu"], s["counts"], out_dtype=wdt,
                                                      tiles=wgrad_tiles, config=config)}

    def dgrad1(s):
        return {"dx_rows": bwd_multi.expert_dgrad1(s["dgu"], w13, s["counts"], offs=s.get("pad_offs"))}

    def unpermute(s):
        return {"dx_e": bwd_rows.unpermute_sum(s["dx_rows"], s["order"], k, row_of=s.get("row_of"))}

    def router_logits(s):
        dw_rows = s["dw_rows"] if not padded else s["dw_rows"][s["row_of"]]
        dweights = torch.empty_like(dw_rows)
        dweights[s["order"]] = dw_rows
        logits = bwd_api.bf16_mm_fp32(x, router_weight.t(), config)
        w_re, full, denom = mr.routing_weights_ref(logits, s["experts_l"], routing, renormalize=renormalize,
                                                   routed_scaling=routed_scaling)
        return {"dweights": dweights, "w_re": w_re, "full": full, "denom": denom}

    def router_bwd(s):
        dq = mr.router_weights_backward_ref(s["dweights"].view(n_tok, k), s["w_re"], s["denom"],
                                            routed_scaling=routed_scaling)
        dlogits = mr.router_logits_backward_ref(dq, s["full"], s["experts_l"], routing)
        d_router, dx_r = bwd_api.router_gemm_backward(dlogits, x, router_weight, config)
        return {"d_router": d_router, "dx_r": dx_r}

    def dx_sum(s):
        return {"dx": (s["dx_e"] + s["dx_r"]).to(torch.bfloat16)}

    # FLOPs from (R rows, H, F); the references on the same rows and counts (offs: inclusive cumsum, int32)
    w2t, w13t = w2.transpose(1, 2), w13.transpose(1, 2)
    gm = lambda a, b, o: torch._grouped_mm(a, b, offs=o)  # noqa: E731
    wd = "fp32" if wgrad_dtype == torch.float32 else "bf16"
    return [
        Stage("sort", "torch", "pairs sorted by expert (stable), counts per expert", ("experts",), sort),
        Stage("permute", "kosmos triton" if padded else "torch",
              "x_rows, dy_rows, w_pair gathered in expert order" + (" (padded layout)" if padded else ""),
              ("tok", "order", "weights", "src_idx", "valid", "real", "end"), permute),
        Stage("gemm1_recompute", "torch._grouped_mm", "[g|u] = x_rows @ W13[e] (forward GEMM1 again)",
              ("x_rows", "counts", "pad_offs"), gemm1,
              Gemm(lambda r, h, ff: 2 * r * h * 2 * ff, lambda s, o: gm(s["x_rows"], w13, o),
                   "_grouped_mm(x_rows, W13) bf16 out", "gu_recomputed", row_operands=("x_rows",),
                   rows_out=True)),
        Stage("gu_saved", "torch gather" if pt.saved is not None else "-",
              "[g|u]: the forward's (moe_forward save_gu) in the backward's order; without it, the recompute",
              ("gu_recomputed", "counts", "x_rows", "order", "real", "end"), gu_saved),
        Stage("dgrad2_swiglu", "kosmos triton (+ torch glue)",
              "z = dy_rows W2^T; SwiGLU bwd -> [dg|du] bf16; gate grads (F-tile partials summed in one launch)",
              ("dy_rows", "gu", "w_pair", "counts", "pad_offs", "valid"), dgrad2,
              Gemm(lambda r, h, ff: 2 * r * h * ff, lambda s, o: gm(s["dy_rows"], w2t, o),
                   "_grouped_mm(dy_rows, W2^T) bf16 out (no epilogue)", None, row_operands=("dy_rows",))),
        Stage("h_recompute", "none (h from dgrad2's epilogue)" if emits_h else "kosmos triton",
              "h = silu(g) * u from [g|u] -> bf16: " + ("emitted by dgrad2_swiglu, nothing here" if emits_h
                                                         else "one pass"), ("gu",), h_recompute),
        Stage("do_rows", "none (gathered with dy_rows in permute)" if padded else "kosmos triton",
              "do = w_pair * dy[tok] -> bf16 (one pass)" + (": nothing here" if padded else ""),
              ("w_pair", "dy_rows", "tok", "src_idx"), do_rows),
        Stage("wgrad2", "kosmos triton", "dW2[e] = h^T do, bf16 out (TMA, fp32 accumulation)",
              ("h", "do_rows", "counts", "pad_offs"), wgrad2,
              Gemm(lambda r, h, ff: 2 * r * ff * h,
                   lambda s, o: _wgrad_ref(s["h"], s["do_rows"], o, wgrad_dtype),
                   f"_grouped_mm(h.t(), do, offs) {wd} out (torch autograd's wgrad)", "dw2",
                   lambda s, o: _wgrad_ref(s["h"], s["do_rows"], o, wgrad_dtype, copy=True),
                   "_grouped_mm(h.t().contiguous(), do, offs), the copy included", ("h", "do_rows"))),
        Stage("wgrad1", "kosmos triton", "dW13[e] = x_rows^T [dg|du], bf16 out (TMA, fp32 accumulation)",
              ("x_rows", "dgu", "counts", "pad_offs"), wgrad1,
              Gemm(lambda r, h, ff: 2 * r * h * 2 * ff,
                   lambda s, o: _wgrad_ref(s["x_rows"], s["dgu"], o, wgrad_dtype),
                   f"_grouped_mm(x_rows.t(), dgu, offs) {wd} out (torch autograd's wgrad)", "dw13",
                   lambda s, o: _wgrad_ref(s["x_rows"], s["dgu"], o, wgrad_dtype, copy=True),
                   "_grouped_mm(x_rows.t().contiguous(), dgu, offs), the copy included", ("x_rows", "dgu"))),
        Stage("dgrad1", "kosmos triton", "dx_rows = [dg|du] W13^T, bf16 out", ("dgu", "counts", "pad_offs"), dgrad1,
              Gemm(lambda r, h, ff: 2 * r * 2 * ff * h, lambda s, o: gm(s["dgu"], w13t, o),
                   "_grouped_mm(dgu, W13^T) bf16 out", "dx_rows", row_operands=("dgu",), rows_out=True)),
        Stage("unpermute_dx", "kosmos triton", "dx_rows gathered per token (inverse order), fp32 slot-order sum",
              ("dx_rows", "order", "row_of"), unpermute),
        Stage("router_logits", "torch",
              "gate grads to pair order; logits x Wr^T (bf16 tensor cores, fp32 acc); routing weights",
              ("dw_rows", "order", "experts_l", "row_of"), router_logits),
        Stage("router_bwd", "torch", "dq, dlogits; dWr = dl^T x, dx_r = dl Wr (hi + lo bf16 GEMMs)",
              ("dweights", "w_re", "denom", "full", "experts_l"), router_bwd),
        Stage("dx_sum", "torch", "dx = dx_e + dx_r -> bf16", ("dx_e", "dx_r"), dx_sum),
    ]


STAGE_NAMES = ("sort", "permute", "gemm1_recompute", "gu_saved", "dgrad2_swiglu", "h_recompute", "do_rows",
               "wgrad2", "wgrad1", "dgrad1", "unpermute_dx", "router_logits", "router_bwd", "dx_sum")
GEMM_STAGES = ("gemm1_recompute", "dgrad2_swiglu", "wgrad2", "wgrad1", "dgrad1")


def rows_padded(pt: Point) -> bool:
    """Whether moe_backward runs this point's expert rows in the padded layout (its own rule)."""
    return bool(pt.inp.bwd_config.padded_rows and bwd_tiles._triton_runs(pt.inp.x) and pt.inp.x.shape[1] % 8 == 0
                and pt.inp.w2.shape[1] % 8 == 0)


def initial_state(pt: Point) -> dict:
    return {"weights": pt.weights, "experts": pt.experts}


def compose(pt: Point, stages=None) -> tuple:
    """Every stage once, in order: (dx, d_router, dw13, dw2) -- moe_backward_w1's gradients (bitwise)."""
    s = initial_state(pt)
    for st in stages or make_stages(pt):
        s.update(st.fn(s))
    return tuple(s[n] for n in GRAD_NAMES)


# ----------------------------------------------------------------------------------------------- measuring
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64, in slices along dim 0 (no fp32 copy of a whole [E, H, 2F] gradient)."""
    num = den = 0.0
    step = max(1, (1 << 26) // max(1, a[0].numel())) if a.dim() and a.shape[0] else 1
    for i in range(0, a.shape[0], step):
        x, y = a[i:i + step].double(), b[i:i + step].double()
        num += float((x - y).pow(2).sum())
        den += float(y.pow(2).sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def kernel_profile(call, device) -> dict:
    """One ``call()`` under torch.profiler (CUDA): device launches, their summed device time (L2 warm) and the
    heaviest kernels by name (``gemm_kernel_ms``: the kernels whose name looks like a GEMM's)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    by = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot, cnt = by.get(e.name, (0.0, 0))
            by[e.name] = (tot + e.time_range.elapsed_us(), cnt + 1)
    if not by:
        return {"profile_error": "no CUDA events in the profile"}
    top = sorted(by.items(), key=lambda kv: -kv[1][0])
    gemm = sum(t for name, (t, _) in by.items() if any(h in name.lower() for h in GEMM_KERNEL_HINTS))
    return {"launches": sum(c for _, c in by.values()), "kernel_ms": sum(t for t, _ in by.values()) / 1e3,
            "gemm_kernel_ms": gemm / 1e3,
            "kernels": [{"name": name[:120], "ms": t / 1e3, "count": c} for name, (t, c) in top[:10]]}


class Probe:
    def __init__(self, args):
        self.args = args
        self.smoke = args.cpu_smoke
        self.rows = Rows(args.json)
        self.emit = self.rows.emit

    def left(self) -> bool:
        m = self.args.max_seconds
        return not m or time.monotonic() - START < m

    def timed(self, fn, smoke_call: bool = True) -> dict:
        """time_op's figures for ``fn`` (a callable or a timing.Split); in the smoke one untimed call (none without
        ``smoke_call``: a stage already called once for its outputs)."""
        if self.smoke:
            if smoke_call:
                fn()
            return {"time_ms": None, "p20_ms": None, "p80_ms": None, "host_ms": None, "samples": 0}
        from kosmos_bench import timing
        return timing.time_op(fn, iters=self.args.iters, warmup=self.args.warmup)

    def profile(self, call, device) -> dict:
        if self.args.no_profile or self.smoke or not self.left():
            return {}
        try:
            return kernel_profile(call, device)
        except Exception as e:  # noqa: BLE001 -- the profiler is a nice-to-have
            return {"profile_error": f"{type(e).__name__}: {str(e).strip()[:200]}"}


def _release(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _timing_fields(t: dict, prefix: str = "") -> dict:
    return {f"{prefix}{k}": t.get(k) for k in ("time_ms", "p20_ms", "p80_ms", "host_ms")}


def run(args) -> list[dict]:
    from kosmos_bench import moe as bm
    from kosmos_bench.environment import environment
    smoke = args.cpu_smoke
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--cpu-smoke needs TRITON_INTERPRET=1 in the environment before Python starts")
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --cpu-smoke (under TRITON_INTERPRET=1) for the CPU flow check")
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    if not smoke:
        from kosmos.core import runtime
        from kosmos_bench import timing
        torch.backends.cuda.matmul.allow_tf32 = False  # as run_case: the fp32 router GEMMs in full fp32
        runtime.ensure_triton_allocator()
        timing.flush_l2(torch.cuda.current_device())
    decision = "route" if smoke else args.decision
    cfg = args.bwd_config  # main's: the flags as a kosmos.MoEBackwardConfig
    m = point_model(args.model, args.experts_scale, smoke=smoke)
    tokens = args.tokens or (SMOKE_TOKENS if smoke else 4096)
    probe = Probe(args)
    wdt, wdt_why = wgrad_ref_dtype(device)
    t0 = time.monotonic()
    decision_error = None
    try:
        pt = build_point(m, tokens, args.routing, seed=args.seed, device=device, decision=decision,
                         bwd_config=args.bwd_config)
    except Exception as e:  # noqa: BLE001 -- the kosmos forward only supplies the decision: go on without it
        if decision != "kosmos":
            raise
        decision_error = f"{type(e).__name__}: {str(e).strip()[:300]}"
        print(f"the kosmos forward failed ({decision_error}); the decision is moe_reference.route's", flush=True)
        decision = "route"
        pt = build_point(m, tokens, args.routing, seed=args.seed, device=device, decision=decision,
                         bwd_config=args.bwd_config)
    if not smoke:
        torch.cuda.synchronize()
    build_s = time.monotonic() - t0
    counts = torch.bincount(pt.experts.reshape(-1).long(), minlength=m.experts)
    n_rows = int(counts.sum())
    env = environment(argv=["python", "-m", "dev.moe_bwd_probe"] + list(args.argv), bench="moe", suite={
        "probe": "moe_bwd_probe", "model": args.model, "tokens": tokens, "routing": args.routing,
        "experts_scale": args.experts_scale, "seed": args.seed, "iters": args.iters, "warmup": args.warmup,
        "decision": decision, "profile": not args.no_profile, "max_seconds": args.max_seconds, "cpu_smoke": smoke})
    env.update(probe="moe_bwd_probe", cpu_smoke=smoke, model=m.name, model_fields=dataclasses.asdict(m),
               tokens=tokens, routing=args.routing, ep=1, rows=n_rows, rows_per_expert_min=int(counts.min()),
               rows_per_expert_max=int(counts.max()), redrawn_tokens=pt.redrawn, decision=decision,
               decision_error=decision_error,
               wgrad_ref_out_dtype=str(wdt).replace("torch.", ""), wgrad_ref_fp32_unavailable=wdt_why,
               bwd_config=config_dict(cfg), wgrad_kernel=cfg.wgrad_kernel, dgrad2_tiles=list(bwd_multi.DGRAD2_TILES),
               dgrad2_emits_h=bwd_rows.dgrad2_emits_h(cfg), dgrad2_fused=cfg.dgrad2_fused, rows_padded=rows_padded(pt),
               one_launch=cfg.one_launch and rows_padded(pt),  # the whole call's expert part (the stages: launches)
               wgrad_flat_tiles=[list(bwd_tiles.wgrad_flat_tiles(bwd_api._wgrad_dtype(pt.inp.w13, None), ka, kb))
                                 for ka, kb in ((m.expert_ffn, m.hidden), (m.hidden, 2 * m.expert_ffn))],
               wgrad_tiles=list(args.wgrad_tiles or (bwd_multi.WGRAD_PERSISTENT_TILES if cfg.wgrad_kernel == "persistent"
                                                     else bwd_multi.WGRAD_TILES)),
               build_s=round(build_s, 1))
    probe.emit(env)
    print(f"moe bwd probe: {m.name} tokens={tokens} {args.routing} EP=1 rows={n_rows} (per expert "
          f"{int(counts.min())}..{int(counts.max())}), decision={decision}, "
          f"{'cpu smoke (nothing timed)' if smoke else f'iters {args.iters} warmup {args.warmup}'}; "
          f"wgrad reference out {env['wgrad_ref_out_dtype']}; "
          f"wgrad kernel {'flat' if env['rows_padded'] else cfg.wgrad_kernel}; inputs {build_s:.0f} s",
          flush=True)

    def base(kind, **kv):
        return {"type": kind, "model": m.name, "tokens": tokens, "routing": args.routing, "ep": 1, **kv}

    # 1. nccl-a2a's backward as the bench times it (first: cheap, no kosmos compile)
    totals = {}
    a2a = bm.a2a_backward(pt.inp)
    row = base("total", impl="nccl-a2a", what="torch.autograd.grad through moe_forward_a2a(fp32=False) "
                                               "(kosmos_bench.moe.a2a_backward; forward untimed)")
    if probe.left():
        try:
            row.update(_timing_fields(probe.timed(a2a)), status="ok")
            state = a2a.setup()
            row.update(probe.profile(lambda: a2a.run(state), device))
            del state
        except Exception as e:  # noqa: BLE001
            row.update(status="failed", reason=f"{type(e).__name__}: {str(e).strip()[:300]}")
    else:
        row.update(status="skipped", reason="deadline")
    del a2a
    totals["nccl-a2a"] = row
    probe.emit(row)
    _print_progress(row)

    _release(device)

    # 2. kosmos's whole backward as the bench times it; then one call on the stages' decision, kept for the
    # bitwise check (after the timing: the weight gradients are the largest tensors here)
    whole = whole_backward(pt)
    row = base("total", impl="kosmos", what="moe_backward_w1 (bench Split: the decision's forward untimed)")
    if probe.left():
        try:
            row.update(_timing_fields(probe.timed(whole)), status="ok")
            state = whole.setup()
            row.update(probe.profile(lambda: whole.run(state), device))
            del state
        except Exception as e:  # noqa: BLE001 -- e.g. out of memory: the stages may still run
            row.update(status="failed", reason=f"{type(e).__name__}: {str(e).strip()[:300]}")
    else:
        row.update(status="skipped", reason="deadline")
    _release(device)
    try:
        want = dict(zip(GRAD_NAMES, whole.run((pt.weights, pt.experts, pt.saved))[:len(GRAD_NAMES)]))
    except Exception as e:  # noqa: BLE001 -- no bitwise check then (the summary's bitwise_equal stays empty)
        want = {}
        row["reason"] = (row.get("reason") or "") + f"; the check's call failed: {type(e).__name__}: {str(e)[:200]}"
        _release(device)
    del whole
    totals["kosmos"] = row
    probe.emit(row)
    _print_progress(row)

    # 3. the stages, in moe_backward's order, each on the previous stages' outputs
    stages = make_stages(pt, wdt, args.wgrad_tiles)
    assert tuple(st.name for st in stages) == STAGE_NAMES
    last_use = {}
    for i, st in enumerate(stages):
        for key in st.needs:
            last_use[key] = i
    s = initial_state(pt)
    keep_all = smoke  # on the GPU each tensor goes once its last stage has run
    offs = torch.cumsum(counts.to(device=device, dtype=torch.int32), 0, dtype=torch.int32)
    equal = {}
    h, ff = m.hidden, m.expert_ffn
    for i, st in enumerate(stages):
        row = base("stage", index=i, stage=st.name, impl=st.impl, what=st.what, status="ok", reason=None,
                   time_ms=None)
        try:
            new = st.fn(s)  # untimed: the outputs the next stages read (and the compile)
            if not smoke:
                torch.cuda.synchronize()
            if probe.left():
                row.update(_timing_fields(probe.timed(lambda: st.fn(s), smoke_call=False)))
            else:
                row.update(status="skipped", reason="deadline (the outputs were still computed)")
            row.update(probe.profile(lambda: st.fn(s), device))
            if st.name == "gu_saved" and pt.saved is not None:  # the forward's g | u against torch's recompute
                row["rel_err_vs_recompute"] = rel_err(new["gu"], s["gu_recomputed"])
            if st.name == "dgrad2_swiglu" and "h" in new:  # dgrad2's h against the pass it replaces, bitwise
                from kosmos.ops.moe_backward.rows import swiglu_h
                row["h_bitwise_swiglu_h"] = bool(torch.equal(new["h"], swiglu_h(s["gu"], ff)))
            if st.gemm is not None:
                g = st.gemm
                flops = g.flops(n_rows, h, ff)
                row.update(flops=flops, ref=g.desc)
                t = row.get("time_ms")
                row["tflops"] = flops / (t * 1e-3) / 1e12 if t else None
                ref = g.ref
                rs = s  # the reference's state: the row operands packed (an untimed copy) when the rows are padded
                if "row_of" in s and g.row_operands:
                    rs = dict(s, **{key: s[key][s["row_of"]] for key in g.row_operands})
                try:
                    try:
                        ref_out = ref(rs, offs)
                    except Exception as e:  # noqa: BLE001 -- e.g. a layout this torch's kernel refuses
                        if g.alt is None:
                            raise
                        row["ref_note"] = (f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}; timed "
                                           f"instead: {g.alt_desc}")
                        ref = g.alt
                        ref_out = ref(rs, offs)
                    row["ref_out_dtype"] = str(ref_out.dtype).replace("torch.", "")
                    if g.out is not None:
                        mine = new[g.out][s["row_of"]] if g.rows_out and "row_of" in s else new[g.out]
                        row["rel_err_vs_ref"] = rel_err(mine, ref_out)
                        del mine
                    del ref_out
                    rt = probe.timed(lambda: ref(rs, offs)) if probe.left() else None
                    if rt:
                        row.update(_timing_fields(rt, "ref_"))
                        if rt["time_ms"]:
                            row["ref_tflops"] = flops / (rt["time_ms"] * 1e-3) / 1e12
                            row["ratio_tflops"] = rt["time_ms"] / t if t else None
                    row["ref_status"] = "ok"
                except Exception as e:  # noqa: BLE001 -- a reference torch cannot run is a finding, not a crash
                    row.update(ref_status="failed", ref_reason=f"{type(e).__name__}: {str(e).strip()[:300]}")
            s.update(new)
            del new
        except Exception as e:  # noqa: BLE001
            row.update(status="failed", reason=f"{type(e).__name__}: {str(e).strip()[:300]}")
            probe.emit(row)
            _print_progress(row)
            break
        # the gradients: bitwise against the whole call's, then (GPU) both dropped -- the weight gradients
        # of deepseek-v3 are 22 GiB each way (bf16)
        for name in GRAD_NAMES:
            if name in s and name in want:
                equal[name] = bool(torch.equal(s[name], want[name]))
                if not keep_all:
                    del want[name], s[name]
        if not keep_all:  # every tensor past its last reader
            for key in [k for k, last in last_use.items() if last == i and k in s]:
                del s[key]
        probe.emit(row)
        _print_progress(row)

    # 4. the summary
    st_rows = [r for r in probe.rows if r["type"] == "stage"]
    times = [r.get("time_ms") for r in st_rows]
    full = len(st_rows) == len(STAGE_NAMES) and all(t is not None for t in times)
    # with the forward's g | u, moe_backward runs no recompute: its stage row is what keeping g | u saves
    in_whole = [r for r in st_rows if not (pt.saved is not None and r["stage"] == "gemm1_recompute")]
    sum_ms = sum(r["time_ms"] for r in in_whole) if full else None
    k_ms, a_ms = totals["kosmos"].get("time_ms"), totals["nccl-a2a"].get("time_ms")
    at_torch = None
    if full and all(r.get("ref_time_ms") for r in st_rows if r["stage"] in GEMM_STAGES):
        at_torch = sum(r["ref_time_ms"] if r["stage"] in GEMM_STAGES else r["time_ms"] for r in in_whole)
    ratios = {r["stage"]: r.get("ratio_tflops") for r in st_rows if r["stage"] in GEMM_STAGES}
    kosmos_gemm = {k: v for k, v in ratios.items() if k != "gemm1_recompute"}
    summary = base("summary", sum_stages_ms=sum_ms, kosmos_ms=k_ms, nccl_a2a_ms=a_ms,
                   sum_over_whole=(sum_ms / k_ms) if sum_ms and k_ms else None,
                   kosmos_over_a2a=(k_ms / a_ms) if k_ms and a_ms else None,
                   speedup_vs_a2a=(a_ms / k_ms) if k_ms and a_ms else None, bar_speedup=BAR_SPEEDUP,
                   gemm_ratio_tflops=ratios,
                   gemm_ratio_min=min(kosmos_gemm.values()) if kosmos_gemm and all(kosmos_gemm.values()) else None,
                   bar_gemm_ratio=BAR_GEMM, sum_stages_at_torch_gemms_ms=at_torch,
                   sum_stages_at_torch_gemms_without_gemm1_ms=(
                       at_torch - (0.0 if pt.saved is not None else
                                   next(r["ref_time_ms"] for r in st_rows if r["stage"] == "gemm1_recompute")))
                   if at_torch else None, gu_saved=pt.saved is not None,
                   bitwise_equal=equal, composed_equals_moe_backward_w1=len(equal) == len(GRAD_NAMES) and
                   all(equal.values()),
                   h_bitwise_swiglu_h=next((r.get("h_bitwise_swiglu_h") for r in st_rows
                                            if r["stage"] == "dgrad2_swiglu"), None),
                   elapsed_s=round(time.monotonic() - START, 1))
    probe.emit(summary)
    probe.rows.close()
    return probe.rows


def _fmt(v, spec=".3f", none="-"):
    return none if v is None else format(v, spec)


def _print_progress(r):
    if r["type"] == "stage":
        print(f"  stage {r['index']:>2} {r['stage']:<16} {r['status']:<7} {_fmt(r.get('time_ms'), '.4f')} ms"
              + (f"  {_fmt(r.get('tflops'), '.0f')} TF/s vs torch {_fmt(r.get('ref_tflops'), '.0f')}"
                 if r.get("flops") else "") + (f"  {r['reason']}" if r.get("reason") else ""), flush=True)
    else:
        print(f"  total {r['impl']:<9} {r['status']:<7} {_fmt(r.get('time_ms'), '.4f')} ms"
              + (f"  {r['reason']}" if r.get("reason") else ""), flush=True)


def table(rows) -> str:
    env = next((r for r in rows if r.get("type") == "env"), {})
    st = [r for r in rows if r.get("type") == "stage"]
    tot = {r["impl"]: r for r in rows if r.get("type") == "total"}
    summ = next((r for r in rows if r.get("type") == "summary"), {})
    whole = tot.get("kosmos", {}).get("time_ms")
    lines = [f"== moe backward stages: {env.get('model')} tokens={env.get('tokens')} {env.get('routing')} EP=1, "
             f"rows {env.get('rows')}, wgrad reference out {env.get('wgrad_ref_out_dtype')}, wgrad kernel "
             + (f"flat (padded rows) {env.get('wgrad_flat_tiles')}" if env.get("rows_padded") else
                f"{env.get('wgrad_kernel', 'tiles')} {env.get('wgrad_tiles', '')}")
             + ("; the whole call's expert part in ONE launch (the stages: the launches it replaces)"
                if env.get("one_launch") else "")
             + (" (cpu smoke: nothing timed)" if env.get("cpu_smoke") else ""),
             f"  {'stage':<16} {'time_ms':>8} {'share':>6} {'TFLOP/s':>8} {'torch_ms':>8} {'torch TF/s':>10} "
             f"{'kosmos/torch':>12} {'err_vs_torch':>12} {'launches':>8} {'kernel_ms':>9} {'host_ms':>8}  status"]
    for r in st:
        share = r["time_ms"] / whole if r.get("time_ms") and whole else None
        lines.append(f"  {r['stage']:<16} {_fmt(r.get('time_ms'), '.4f'):>8} {_fmt(share, '.1%'):>6} "
                     f"{_fmt(r.get('tflops'), '.0f'):>8} {_fmt(r.get('ref_time_ms'), '.4f'):>8} "
                     f"{_fmt(r.get('ref_tflops'), '.0f'):>10} {_fmt(r.get('ratio_tflops'), '.3f'):>12} "
                     f"{_fmt(r.get('rel_err_vs_ref', r.get('rel_err_vs_recompute')), '.1e'):>12} "
                     f"{_fmt(r.get('launches'), 'd'):>8} "
                     f"{_fmt(r.get('kernel_ms'), '.4f'):>9} "
                     f"{_fmt(r.get('host_ms'), '.3f'):>8}  {r['status']}"
                     + (f" ({r['reason']})" if r.get("reason") else "")
                     + (f" ref {r['ref_status']}: {r.get('ref_reason')}" if r.get("ref_status") == "failed" else ""))
    lines.append(f"  {'sum of stages':<16} {_fmt(summ.get('sum_stages_ms'), '.4f'):>8} "
                 f"{_fmt(summ.get('sum_over_whole'), '.1%'):>6}  (of the whole call)")
    for impl in ("kosmos", "nccl-a2a"):
        r = tot.get(impl, {})
        lines.append(f"  {impl + ' whole':<16} {_fmt(r.get('time_ms'), '.4f'):>8} {'':>6} {'':>8} {'':>8} {'':>10} "
                     f"{'':>12} {'':>12} {_fmt(r.get('launches'), 'd'):>8} {_fmt(r.get('kernel_ms'), '.4f'):>9} "
                     f"{_fmt(r.get('host_ms'), '.3f'):>8}  {r.get('status', 'missing')}"
                     + (f" ({r['reason']})" if r.get("reason") else "")
                     + (f" gemm kernels {_fmt(r.get('gemm_kernel_ms'), '.4f')} ms" if r.get("gemm_kernel_ms")
                        is not None else ""))
    lines.append(f"  kosmos / nccl-a2a time {_fmt(summ.get('kosmos_over_a2a'), '.3f')} (bar: nccl-a2a / kosmos >= "
                 f"{BAR_SPEEDUP}, now {_fmt(summ.get('speedup_vs_a2a'), '.3f')}); kosmos GEMMs / torch TFLOP/s min "
                 f"{_fmt(summ.get('gemm_ratio_min'), '.3f')} (bar {BAR_GEMM}); stages with torch's GEMM times "
                 f"{_fmt(summ.get('sum_stages_at_torch_gemms_ms'), '.4f')} ms, and without the GEMM1 recompute "
                 f"{_fmt(summ.get('sum_stages_at_torch_gemms_without_gemm1_ms'), '.4f')} ms")
    lines.append(f"  stages composed == moe_backward_w1 (bitwise): {summ.get('composed_equals_moe_backward_w1')} "
                 f"{summ.get('bitwise_equal')}; dgrad2's h == swiglu_h (bitwise): "
                 f"{summ.get('h_bitwise_swiglu_h', 'n/a')}")
    for impl in ("kosmos", "nccl-a2a"):
        ks = tot.get(impl, {}).get("kernels") or []
        if ks:
            lines.append(f"  {impl} heaviest kernels (one profiled call):")
            lines += [f"    {k['ms']:8.4f} ms x{k['count']:<4} {k['name'][:90]}" for k in ks[:8]]
    return "\n".join(lines)


def main(argv=None) -> int:
    global START
    START = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-235b", help="a kosmos.models.MOE_MODELS name")
    ap.add_argument("--tokens", type=int, default=None, help=f"default 4096 ({SMOKE_TOKENS} in --cpu-smoke)")
    ap.add_argument("--routing", default="uniform", help="uniform | zipf:S (the bench's)")
    ap.add_argument("--experts-scale", type=int, default=1, help="divide the model's experts by this (memory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--decision", choices=("kosmos", "route"), default="kosmos",
                    help="the routing decision: the kosmos forward's (the bench's) or moe_reference.route's")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler launch counts")
    ap.add_argument("--json", default=None, help="write the JSONL rows here (one per line as each is done)")
    ap.add_argument("--max-seconds", type=float, default=130.0, help="start no new measurement past this many "
                    "seconds after start-up (0: no limit)")
    ap.add_argument("--wgrad-kernel", choices=("persistent", "tiles"), default=None,
                    help="the weight-gradient kernel of moe_backward (whole call and stages alike; default: "
                         "MoEBackwardConfig.wgrad_kernel): the persistent grid or one program per tile")
    ap.add_argument("--wgrad-tiles", default=None, metavar="BI,BJ,BR,WARPS,STAGES",
                    help="the packed rows' wgrad kernel's GPU tiles in the stages (the whole call keeps moe_backward's; "
                         "default: multi_launch.WGRAD_PERSISTENT_TILES / WGRAD_TILES, "
                         "128,128,64,8,3), e.g. 128,256,64,8,2")
    ap.add_argument("--dgrad2", choices=("fused", "unfused"), default=None,
                    help="GEMM2's data gradient with the SwiGLU backward in its epilogue, or the GEMM (bf16 z) and "
                         "a pass after it (default: MoEBackwardConfig.dgrad2_fused)")
    ap.add_argument("--rows", choices=("padded", "packed"), default=None,
                    help="moe_backward's expert-row layout (whole call and stages alike; default: MoEBackwardConfig.padded_rows): "
                         "padded per expert for the flat wgrad loop, or packed for the persistent wgrad kernel")
    ap.add_argument("--one-launch", action="store_true",
                    help="the whole call with moe_backward's expert part in one launch (MoEBackwardConfig.one_launch; the "
                         "stages stay the multi-launch ones: the summary's bitwise check and sum_over_whole are "
                         "then the one launch against the launches it replaces; the router backward stays the "
                         "torch ops after it: router_in_launch=False for the run)")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes, nothing timed")
    ap.add_argument("--table", default=None, metavar="JSONL", help="only print the table of a finished run")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0
    if args.cpu_smoke:  # nothing timed, so no deadline either (START is the module's import: in a test session
        args.iters, args.warmup, args.max_seconds = 1, 0, 0  # it can be minutes before this call)
    if args.wgrad_tiles:
        t = tuple(int(v) for v in args.wgrad_tiles.split(","))
        if len(t) != 5:
            raise SystemExit(f"--wgrad-tiles {args.wgrad_tiles}: five integers BI,BJ,BR,WARPS,STAGES")
        args.wgrad_tiles = t
    # moe_backward's switches for this run (kosmos.MoEBackwardConfig; the defaults where no flag says otherwise);
    # with the expert part in one launch, the router backward after it, as the stages' torch ops, so that the
    # summary's bitwise check holds
    kw = {}
    if args.wgrad_kernel:
        kw["wgrad_kernel"] = args.wgrad_kernel
    if args.dgrad2:
        kw["dgrad2_fused"] = args.dgrad2 == "fused"
    if args.rows:
        kw["padded_rows"] = args.rows == "padded"
    if args.one_launch:
        kw["one_launch"] = True
    if kw.get("one_launch", MoEBackwardConfig().one_launch):
        kw["router_in_launch"] = False
    args.bwd_config = MoEBackwardConfig(**kw)
    rows = run(args)
    print(table(rows), flush=True)
    stages = [r for r in rows if r["type"] == "stage"]
    return 0 if stages and all(r["status"] in ("ok", "skipped") for r in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
