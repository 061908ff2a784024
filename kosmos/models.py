"""Named model shapes, in one place. Suites and the CLI refer to models by these names.

Dense models give the four tensor-parallel GEMMs of a transformer layer (TP+SP, weights sharded over W):
  qkv       AllGather+GEMM   m=tokens, k=hidden,              n=(heads + 2*kv_heads)*head_dim / W
  fc1       AllGather+GEMM   m=tokens, k=hidden,              n=(2 if gated else 1)*ffn / W
  attn_out  GEMM+RS          m=tokens, k=heads*head_dim / W,  n=hidden
  fc2       GEMM+RS          m=tokens, k=ffn / W,             n=hidden
MoE models carry their published router/expert configs (used by the MoE benchmark).
"""
from __future__ import annotations

from dataclasses import dataclass


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


DENSE_MODELS = {m.name: m for m in [
    DenseModel("llama3-8b", hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128),
    DenseModel("llama3-70b", hidden=8192, ffn=28672, heads=64, kv_heads=8, head_dim=128),
    DenseModel("llama3-405b", hidden=16384, ffn=53248, heads=128, kv_heads=8, head_dim=128),
    DenseModel("gpt3-175b", hidden=12288, ffn=49152, heads=96, kv_heads=96, head_dim=128, gated=False),
]}

MOE_MODELS = {m.name: m for m in [
    MoEModel("deepseek-v3", hidden=7168, expert_ffn=2048, experts=256, top_k=8, routing="sigmoid-grouped",
             renormalize=True, n_group=8, topk_group=4, routed_scaling=2.5),
    MoEModel("qwen3-235b", hidden=4096, expert_ffn=1536, experts=128, top_k=8, routing="softmax",
             renormalize=True),
    MoEModel("mixtral-8x7b", hidden=4096, expert_ffn=14336, experts=8, top_k=2, routing="softmax",
             renormalize=True),
    MoEModel("qwen2-57b", hidden=3584, expert_ffn=2560, experts=64, top_k=8, routing="softmax",
             renormalize=False),
]}

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
