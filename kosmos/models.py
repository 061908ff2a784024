"""Named model shapes, in one place. Suites and the CLI refer to models by these names.

Dense models give the four tensor-parallel GEMMs of a transformer layer (TP+SP, weights sharded over W):
  qkv       AllGather+GEMM   m=tokens, k=hidden,              n=(heads + 2*kv_heads)*head_dim / W
  fc1       AllGather+GEMM   m=tokens, k=hidden,              n=(2 if gated else 1)*ffn / W
  attn_out  GEMM+RS          m=tokens, k=heads*head_dim / W,  n=hidden
  fc2       GEMM+RS          m=tokens, k=ffn / W,             n=hidden
MoE models carry their published router/expert configs (used by the MoE benchmark) and the transformers family
whose sparse block they are (``hf_family``: the module under transformers.models; the bench's hf-* baselines build
that family's router and experts, kosmos.integrations.transformers.FAMILIES).

Custom points (``kosmos bench tp --shape``, ``kosmos bench moe --hidden ...``) are built here too, checked up front:
``custom_tp_gemm`` and ``custom_moe_model`` (model name CUSTOM; a bad value raises CustomShapeError naming it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .ops.moe_forward import MAX_EXPERTS, MAX_TOPK
from .reference.moe import ROUTINGS


@dataclass(frozen=True)
class DenseModel:
    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    gated: bool = True


@dataclass(frozen=True)
class TPGemm:
    model: str
    layer: str
    op: str  # "ag_gemm" | "gemm_rs"
    seq: int
    m: int
    n: int
    k: int


@dataclass(frozen=True)
class MoEModel:
    name: str
    hidden: int
    expert_ffn: int
    experts: int
    top_k: int
    routing: str  # "softmax" | "sigmoid-grouped"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    hf_family: str | None = None  # None (a custom model): qwen3_moe for softmax routing, deepseek_v3 for sigmoid-grouped


DENSE_MODELS = {m.name: m for m in [
    DenseModel("llama3-8b", hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128),
    DenseModel("llama3-70b", hidden=8192, ffn=28672, heads=64, kv_heads=8, head_dim=128),
    DenseModel("llama3-405b", hidden=16384, ffn=53248, heads=128, kv_heads=8, head_dim=128),
    DenseModel("gpt3-175b", hidden=12288, ffn=49152, heads=96, kv_heads=96, head_dim=128, gated=False),
]}

MOE_MODELS = {m.name: m for m in [
    MoEModel("deepseek-v3", hidden=7168, expert_ffn=2048, experts=256, top_k=8, routing="sigmoid-grouped",
             renormalize=True, n_group=8, topk_group=4, routed_scaling=2.5, hf_family="deepseek_v3"),
    MoEModel("qwen3-235b", hidden=4096, expert_ffn=1536, experts=128, top_k=8, routing="softmax",
             renormalize=True, hf_family="qwen3_moe"),
    MoEModel("mixtral-8x7b", hidden=4096, expert_ffn=14336, experts=8, top_k=2, routing="softmax",
             renormalize=True, hf_family="mixtral"),
    MoEModel("qwen2-57b", hidden=3584, expert_ffn=2560, experts=64, top_k=8, routing="softmax",
             renormalize=False, hf_family="qwen2_moe"),
    # Qwen3-30B-A3B: hidden_size 2048, moe_intermediate_size 768, num_experts 128, num_experts_per_tok 8,
    # norm_topk_prob true, no shared expert
    MoEModel("qwen3-30b-a3b", hidden=2048, expert_ffn=768, experts=128, top_k=8, routing="softmax",
             renormalize=True, hf_family="qwen3_moe"),
]}

# The rest of a MOE_MODELS entry's transformers config (attention, the dense MLP of non-MoE layers, shared
# experts), from each model's published config.json: `kosmos bench train --hf` builds the model from these
# (kosmos_bench/train_hf.py maps the MoE fields above onto each family's config keys).
HF_CONFIGS = {
    "deepseek-v3": dict(num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432,
                        n_shared_experts=1, rms_norm_eps=1e-6),
    "qwen3-235b": dict(num_attention_heads=64, num_key_value_heads=4, head_dim=128, intermediate_size=12288,
                       rms_norm_eps=1e-6),
    "mixtral-8x7b": dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5),
    "qwen2-57b": dict(num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                      shared_expert_intermediate_size=20480, rms_norm_eps=1e-6),
    "qwen3-30b-a3b": dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          rms_norm_eps=1e-6),
}

TP_LAYERS = ("qkv", "fc1", "attn_out", "fc2")


class UnknownModelError(ValueError):
    pass


def dense_model(name: str) -> DenseModel:
    try:
        return DENSE_MODELS[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known dense models: {', '.join(DENSE_MODELS)}") from None


def tp_gemms(name: str, seq: int, tp: int, layers=TP_LAYERS) -> list[TPGemm]:
    """The TP GEMMs of one layer of ``name`` at ``seq`` tokens over ``tp`` ranks."""
    m = dense_model(name)
    q_out = m.heads * m.head_dim
    qkv_out = (m.heads + 2 * m.kv_heads) * m.head_dim
    fc1_out = (2 if m.gated else 1) * m.ffn
    if seq % tp:
        raise ValueError(f"seq={seq} must divide by tp={tp} (sequence parallelism splits the tokens)")
    for what, v in (("qkv width", qkv_out), ("ffn width", fc1_out), ("attention width", q_out), ("ffn", m.ffn)):
        if v % tp:
            raise ValueError(f"{name}: {what} {v} does not divide by tp={tp}")
    table = {
        "qkv": TPGemm(name, "qkv", "ag_gemm", seq, seq, qkv_out // tp, m.hidden),
        "fc1": TPGemm(name, "fc1", "ag_gemm", seq, seq, fc1_out // tp, m.hidden),
        "attn_out": TPGemm(name, "attn_out", "gemm_rs", seq, seq, m.hidden, q_out // tp),
        "fc2": TPGemm(name, "fc2", "gemm_rs", seq, seq, m.hidden, m.ffn // tp),
    }
    unknown = [l for l in layers if l not in table]
    if unknown:
        raise ValueError(f"unknown layer(s) {unknown}; choose from {list(TP_LAYERS)}")
    return [table[l] for l in layers]


# --------------------------------------------------------------------------- custom points

CUSTOM = "custom"  # the model (and, for TP, the layer) name of a custom point's rows
TP_OPS = ("ag_gemm", "gemm_rs")
TMA_MULTIPLE = 8  # bf16 rows of 16 bytes: what TMA needs of every GEMM's inner dimensions


class CustomShapeError(ValueError):
    """A bad custom point; ``field`` names the value (TP: shape, op, world; MoE: hidden, ffn, experts, top_k,
    routing, renormalize, n_group, topk_group, routed_scaling, ep) so that a command line can name its option."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _positive_int(field: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise CustomShapeError(field, f"{field}={v!r} must be a positive integer")
    return v


def parse_shape(text: str) -> tuple[int, int, int]:
    """'MxNxK' (e.g. '8192x1024x8192') -> (M, N, K); CustomShapeError otherwise."""
    parts = str(text).strip().lower().split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise CustomShapeError("shape", "not MxNxK (three positive integers, e.g. 8192x1024x8192)")
    m, n, k = (int(p) for p in parts)
    for field, v in (("M", m), ("N", n), ("K", k)):
        if v <= 0:
            raise CustomShapeError("shape", f"{field}={v} must be positive")
    return m, n, k


def custom_tp_gemm(op: str, m: int, n: int, k: int, world: int) -> TPGemm:
    """A custom TP GEMM of ``op`` over ``world`` ranks, dimensions as in a result row (SCHEMA.md): ag_gemm
    C[M, N] = allgather(A[M/W, K]) @ B[K, N] (M the gathered rows, N already per rank); gemm_rs C_shard[M/W, N] =
    RS(A[M, K] @ B[K, N]) (K already per rank). Model and layer are CUSTOM, seq = M."""
    if op not in TP_OPS:
        raise CustomShapeError("op", f"op {op!r}: a custom shape is an {' or a '.join(TP_OPS)}")
    for field, v in (("M", m), ("N", n), ("K", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise CustomShapeError("shape", f"{field}={v!r} must be a positive integer")
    _positive_int("world", world)
    if m % world:
        rows = "gathered rows: each rank holds M/W" if op == "ag_gemm" else "rows: each rank gets M/W of the sum"
        raise CustomShapeError("shape", f"M={m} must divide by the world size {world} ({rows})")
    for field, v in (("N", n), ("K", k)):
        if v % TMA_MULTIPLE:
            raise CustomShapeError("shape", f"{field}={v} must be a multiple of {TMA_MULTIPLE} (rows of 16 bytes "
                                            f"are needed by TMA)")
    return TPGemm(CUSTOM, CUSTOM, op, m, m, n, k)


def custom_moe_model(hidden: int, ffn: int, experts: int, top_k: int, routing: str = "softmax", *,
                     renormalize: bool = True, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
                     ep: int | None = None) -> MoEModel:
    """A custom MoE model (name CUSTOM) with every check ``kosmos.moe_forward`` makes of its shapes and router,
    and, given ``ep``, that its experts split evenly over the EP ranks."""
    for field, v in (("hidden", hidden), ("ffn", ffn), ("experts", experts), ("top_k", top_k),
                     ("n_group", n_group), ("topk_group", topk_group)):
        _positive_int(field, v)
    for field, v in (("hidden", hidden), ("ffn", ffn)):
        if v % TMA_MULTIPLE:
            raise CustomShapeError(field, f"{field}={v} must be a multiple of {TMA_MULTIPLE} (rows of 16 bytes are "
                                          f"needed by TMA)")
    if experts > MAX_EXPERTS:
        raise CustomShapeError("experts", f"experts={experts} > {MAX_EXPERTS}: the router keeps a token block's "
                                          f"logits in one tile")
    if ep is not None:
        _positive_int("ep", ep)
        if experts % ep:
            raise CustomShapeError("experts", f"{experts} experts do not split evenly over EP={ep} ranks")
    if top_k > experts:
        raise CustomShapeError("top_k", f"top_k={top_k} must be at most the {experts} experts")
    if top_k > MAX_TOPK:
        raise CustomShapeError("top_k", f"top_k={top_k} > {MAX_TOPK}: the kernel's limit")
    if routing not in ROUTINGS:
        raise CustomShapeError("routing", f"unknown routing kind {routing!r}; choose from {', '.join(ROUTINGS)}")
    if not isinstance(renormalize, bool):
        raise CustomShapeError("renormalize", f"renormalize={renormalize!r} must be true or false")
    if isinstance(routed_scaling, bool) or not isinstance(routed_scaling, (int, float)) \
            or not math.isfinite(routed_scaling) or routed_scaling <= 0:
        raise CustomShapeError("routed_scaling", f"routed_scaling={routed_scaling!r} must be a finite number > 0")
    if routing == "softmax":
        for field, v in (("n_group", n_group), ("topk_group", topk_group)):
            if v != 1:
                raise CustomShapeError(field, f"{field}={v}: groups belong to routing kind 'sigmoid-grouped'")
    else:
        if experts % n_group:
            raise CustomShapeError("n_group", f"{experts} experts do not split into n_group={n_group} groups")
        if topk_group > n_group:
            raise CustomShapeError("topk_group", f"topk_group={topk_group} must be at most n_group={n_group}")
        if top_k > topk_group * (experts // n_group):
            raise CustomShapeError("top_k", f"top_k={top_k} exceeds the {topk_group * (experts // n_group)} "
                                            f"experts of the topk_group={topk_group} groups kept")
    return MoEModel(CUSTOM, hidden=hidden, expert_ffn=ffn, experts=experts, top_k=top_k, routing=routing,
                    renormalize=renormalize, n_group=n_group, topk_group=topk_group,
                    routed_scaling=float(routed_scaling))
