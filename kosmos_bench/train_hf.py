"""``kosmos bench train --hf MODEL``: a real HuggingFace transformers model, trained with its own MoE experts and
again with its sparse MoE blocks on KOSMOS (``kosmos.integrations.transformers.patch``), from the same seed and
data: step time, tokens/s, peak memory and every step's loss, which must agree with the unpatched model's.

The model: ``transformers.AutoModelForCausalLM.from_config`` of the family's config with the real sizes of a
``kosmos.models.MOE_MODELS`` entry that has an ``hf_family`` (hidden, expert FFN, experts, top-k, routing) and
``kosmos.models.HF_CONFIGS`` (attention, shared experts), ``layers`` decoder layers (default 2), every one a sparse
MoE layer (DeepSeek-V3's first_k_dense_replace 0, Qwen's decoder_sparse_step 1), a vocabulary of ``vocab``
(default 32768: the embedding and LM head are not what is measured) and random initialisation (transformers'
own, from ``seed``; no download). ``experts`` overrides the expert count: deepseek-v3 defaults to 64 of its 256
(DEFAULT_EXPERTS: two layers of 256 experts of 7168 x 2048 are 22.5 B parameters, 180 GiB with AdamW), kept
divisible by its 8 groups. bf16 parameters, SDPA attention, the model in training mode.

Implementations:
  hf       the baseline: the model as transformers builds it (its default experts implementation, recorded in
           ``extra.hf_experts_implementation``: grouped_mm on transformers 5.17 with CUDA)
  kosmos   the same model after ``patch(model)``: every sparse MoE block's router + experts in one KOSMOS launch
           forward and one backward, on the model's own parameters (shared experts and attention unchanged)
  kosmos-experts  the same model with transformers' experts implementation "kosmos"
           (``register_experts`` + ``model.set_experts_implementation``): the model's own router in torch, the
           experts (dispatch, expert GEMMs, combine) in one KOSMOS launch with that routing given
           (``kosmos.nn.moe_experts``) -- the path of families whose router KOSMOS does not run
Both are built from the same seed on the device; the rows record a checksum of the initial parameters
(``extra.init_checksum``) and a row whose model starts from other weights than the baseline's fails.

Data (fixed, synthetic): step i's tokens ~ uniform over the vocabulary [batch, seq] (a generator seeded
(seed, i) on the device) and the labels a fixed random permutation of the current token (the next-token label of
position p is perm[token p]: transformers' loss shifts the labels by one), so the loss falls from ln(vocab) as
the model learns the map through its layers. The loss is transformers' own (``labels=``: cross-entropy over fp32
logits). AdamW as the proxies' (kosmos_bench/train.py: ADAMW, lr ``adamw_lr(hidden)``), its moments in the
parameters' dtype (torch's default). Steps, timing (CUDA events around forward + backward + AdamW step +
zero_grad), agreement (every step's loss within ``loss_rtol`` = 2e-2 of the baseline's) and rows: as
kosmos_bench/train.py's (``train_rows``); ``kind`` "moe", ``world`` 1, ``extra``: hf_family, vocab,
hf_experts_implementation (kosmos-experts: "kosmos"), init_checksum, transformers (its version), and for kosmos
patched_blocks.

An implementation that cannot run here is "unavailable" with the reason: transformers missing or older than
kosmos.integrations.transformers needs, no CUDA device (the kernels), or an estimated footprint (parameters,
gradients and AdamW moments: 8 bytes a parameter, plus the logits) above the GPU's memory.
Tests: tests/test_bench_train_hf.py (CPU: tiny configs with the reference layer standing in for the kernels)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from kosmos.models import HF_CONFIGS, MOE_MODELS

from .train import ADAMW, StepClock, TrainSettings, Unavailable, _sync, adamw_lr, train_rows

HF_IMPLS = ("hf", "kosmos", "kosmos-experts")
HF_BASELINE = "hf"
DEFAULT_VOCAB = 32768
DEFAULT_EXPERTS = {"deepseek-v3": 64}
DEFAULT_LAYERS, DEFAULT_SEQ = 2, 4096
# a transformers family name (as `patch` knows them, - or _) -> the MOE_MODELS entry `--hf FAMILY` trains
FAMILY_MODELS = {"qwen3_moe": "qwen3-30b-a3b", "mixtral": "mixtral-8x7b", "deepseek_v3": "deepseek-v3",
                 "qwen2_moe": "qwen2-57b"}


def hf_models() -> list[str]:
    """The MOE_MODELS entries `--hf` can build (an hf_family and an HF_CONFIGS entry)."""
    return [n for n, m in MOE_MODELS.items() if m.hf_family and n in HF_CONFIGS]


def resolve_model(name: str) -> str:
    """``--hf``'s value -> a model of ``hf_models()``: a model name, or a family name (qwen3_moe, qwen3-moe, ...)
    for its FAMILY_MODELS entry; ValueError in one line otherwise."""
    if name in hf_models():
        return name
    family = name.replace("-", "_").lower()
    if family in FAMILY_MODELS:
        return FAMILY_MODELS[family]
    raise ValueError(f"--hf {name!r}: give a family ({', '.join(FAMILY_MODELS)}) or a model "
                     f"({', '.join(hf_models())})")


@dataclass(frozen=True)
class HFTrainShape:
    model: str
    layers: int = DEFAULT_LAYERS
    seq: int = DEFAULT_SEQ
    batch: int = 1
    experts: int | None = None  # None: DEFAULT_EXPERTS or the model's
    vocab: int = DEFAULT_VOCAB

    @property
    def spec(self):
        return MOE_MODELS[self.model]

    @property
    def family(self) -> str:
        return self.spec.hf_family

    @property
    def n_experts(self) -> int:
        return self.experts or DEFAULT_EXPERTS.get(self.model, self.spec.experts)


def hf_shape(model: str, *, layers: int = DEFAULT_LAYERS, seq: int = DEFAULT_SEQ, batch: int = 1,
             experts: int | None = None, vocab: int = DEFAULT_VOCAB) -> HFTrainShape:
    """The checked shape of `--hf MODEL` (ValueError in one line naming the option)."""
    shape = HFTrainShape(resolve_model(model), layers, seq, batch, experts, vocab)
    spec, e = shape.spec, shape.n_experts
    if e < spec.top_k:
        raise ValueError(f"--experts {e}: {shape.model} chooses top-{spec.top_k}, so it needs at least {spec.top_k}")
    if spec.routing == "sigmoid-grouped":
        per_group = e // spec.n_group if e % spec.n_group == 0 else 0
        if per_group < 2 or spec.topk_group * per_group < spec.top_k:
            raise ValueError(f"--experts {e}: {shape.model} routes over {spec.n_group} groups (top-{spec.topk_group} "
                             f"groups, top-{spec.top_k} experts): give a multiple of {spec.n_group} of at least "
                             f"{spec.n_group * max(2, -(-spec.top_k // spec.topk_group))}")
    return shape


def config_kwargs(shape: HFTrainShape) -> dict:
    """The transformers config keyword arguments of ``shape`` (module docstring): the family's names for the MoE
    fields of MOE_MODELS, HF_CONFIGS' attention and shared-expert fields, every layer sparse."""
    m, e = shape.spec, shape.n_experts
    kw = dict(hidden_size=m.hidden, num_hidden_layers=shape.layers, vocab_size=shape.vocab, hidden_act="silu",
              max_position_embeddings=max(shape.seq, 4096), num_experts_per_tok=m.top_k, tie_word_embeddings=False,
              **HF_CONFIGS[shape.model])
    if m.hf_family == "mixtral":
        kw.update(intermediate_size=m.expert_ffn, num_local_experts=e, router_jitter_noise=0.0)
    elif m.hf_family in ("qwen3_moe", "qwen2_moe"):
        kw.update(moe_intermediate_size=m.expert_ffn, num_experts=e, norm_topk_prob=m.renormalize,
                  decoder_sparse_step=1, mlp_only_layers=[])
    elif m.hf_family == "deepseek_v3":
        kw.update(moe_intermediate_size=m.expert_ffn, n_routed_experts=e, n_group=m.n_group,
                  topk_group=m.topk_group, routed_scaling_factor=m.routed_scaling, norm_topk_prob=m.renormalize,
                  first_k_dense_replace=0, rope_scaling=None)
    else:  # pragma: no cover - hf_models() holds only the families above
        raise ValueError(f"no transformers config mapping for family {m.hf_family!r}")
    return kw


CONFIG_CLASSES = {"mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig",
                  "deepseek_v3": "DeepseekV3Config"}


def hf_config(shape: HFTrainShape, overrides: dict | None = None):
    """The transformers config of ``shape`` (``overrides``: keys replaced after, e.g. tiny sizes in tests)."""
    from kosmos.integrations.transformers import require_transformers
    tf = require_transformers()
    cfg = getattr(tf, CONFIG_CLASSES[shape.family])(**{**config_kwargs(shape), **(overrides or {})})
    cfg._attn_implementation = "sdpa"
    return cfg


def parameter_count(cfg) -> int:
    """Parameters of the model of ``cfg`` (built on the meta device: no memory, no initialisation)."""
    import transformers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def footprint_bytes(cfg, shape: HFTrainShape) -> int:
    """A lower bound on one training step's memory: bf16 parameters, gradients and AdamW's two moments (8 bytes a
    parameter) plus the fp32 logits and their gradient."""
    return 8 * parameter_count(cfg) + 8 * shape.batch * shape.seq * shape.vocab


def kosmos_problem(device) -> str | None:
    """Why the kosmos implementation cannot run on ``device`` (None: it can)."""
    return None if torch.device(device).type == "cuda" else "the KOSMOS MoE kernels need a CUDA device"


def build_model(shape: HFTrainShape, impl: str, device, seed: int, overrides: dict | None = None):
    """(model, extra) of implementation ``impl``: the model built from ``seed`` on ``device`` in bf16, training
    mode; kosmos: patched (a block it refuses fails the implementation). Unavailable: module docstring."""
    try:
        cfg = hf_config(shape, overrides)
    except ImportError as e:
        raise Unavailable(str(e)) from None
    import transformers
    device = torch.device(device)
    if impl != HF_BASELINE and (why := kosmos_problem(device)):
        raise Unavailable(why)
    if device.type == "cuda":
        need, have = footprint_bytes(cfg, shape), torch.cuda.get_device_properties(device).total_memory
        if need > have:
            raise Unavailable(f"needs more than {need / 2**30:.0f} GiB (parameters, gradients, AdamW moments, "
                              f"logits); this GPU has {have / 2**30:.0f} GiB: try --layers 1 or --experts")
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.train()
    extra = dict(hf_family=shape.family, vocab=shape.vocab, transformers=transformers.__version__,
                 hf_experts_implementation=getattr(model.config, "_experts_implementation", None),
                 init_checksum=init_checksum(model))
    if impl == "kosmos":
        from kosmos.integrations.transformers import patch
        patched = patch(model, strict=True)
        extra["patched_blocks"] = len(patched.blocks)
    elif impl == "kosmos-experts":
        from kosmos.integrations.transformers import experts_refusal, moe_blocks, register_experts
        refused = {name: why for name, block in moe_blocks(model) if (why := experts_refusal(block.experts))}
        if refused:
            raise RuntimeError("the experts implementation 'kosmos' refuses " +
                               "; ".join(f"{n}: {why}" for n, why in refused.items()))
        model.set_experts_implementation(register_experts())
        extra["hf_experts_implementation"] = model.config._experts_implementation
    return model, extra


def init_checksum(model) -> float:
    """The sum over parameters of each one's fp64 sum: equal for models built from the same weights."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in model.parameters()))


def step_batch(shape: HFTrainShape, step: int, seed: int, device):
    """(input ids, labels) [batch, seq] of step ``step`` (module docstring: labels[:, p + 1] = perm[ids[:, p]])."""
    g = torch.Generator(device=device).manual_seed(seed * 7919 + 1 + step)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g, device=device)
    perm = torch.randperm(shape.vocab, generator=torch.Generator(device=device).manual_seed(seed * 7919 + 104729),
                          device=device)
    labels = torch.full_like(ids, -100)
    labels[:, 1:] = perm[ids[:, :-1]]
    return ids, labels


def train_losses_hf(model, shape: HFTrainShape, st: TrainSettings, device):
    """Run ``st.warmup + st.steps`` steps; (losses of the timed steps, their times in ms)."""
    opt = torch.optim.AdamW(model.parameters(), **{**ADAMW, "lr": adamw_lr(model.config.hidden_size)})
    losses, times = [], []
    for i in range(st.warmup + st.steps):
        ids, labels = step_batch(shape, i, st.seed, device)
        _sync(device)
        clock = StepClock(device)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ms = clock.stop()
        if i >= st.warmup:
            losses.append(loss.item())
            times.append(ms)
    return losses, times


def identity_hf(shape: HFTrainShape) -> dict:
    m = shape.spec
    return {"type": "result", "bench": "train", "model": shape.model, "kind": "moe", "layers": shape.layers,
            "seq": shape.seq, "batch": shape.batch, "hidden": m.hidden, "ffn": m.expert_ffn, "heads":
            HF_CONFIGS[shape.model]["num_attention_heads"], "kv_heads": HF_CONFIGS[shape.model]["num_key_value_heads"],
            "head_dim": HF_CONFIGS[shape.model].get("head_dim"), "experts": shape.n_experts, "top_k": m.top_k,
            "scale": None, "world": 1, "dtype": "bf16"}


def run_train_hf(shape: HFTrainShape, st: TrainSettings, device="cpu", *, on_row=None,
                 overrides: dict | None = None) -> list[dict]:
    """A row per implementation of ``st.impls`` (default HF_IMPLS; the baseline hf first): train_rows's rows."""
    extras, base = {}, {}

    def attempt(name):
        model, extra = build_model(shape, name, device, st.seed, overrides)
        extras[name] = extra
        if name != HF_BASELINE and "checksum" in base and extra["init_checksum"] != base["checksum"]:
            raise RuntimeError(f"started from other weights than {HF_BASELINE}'s (parameter checksum "
                               f"{extra['init_checksum']!r} vs {base['checksum']!r})")
        if name == HF_BASELINE:
            base["checksum"] = extra["init_checksum"]
        try:
            return train_losses_hf(model, shape, st, device)
        finally:
            del model

    def row_out(row):
        row["extra"].update(extras.get(row["impl"], {}))
        if on_row:
            on_row(row)

    identity = identity_hf(shape)
    if overrides:
        identity["extra"] = {"config_overrides": dict(overrides)}
    return train_rows(st.impls or HF_IMPLS, HF_BASELINE, attempt, identity, shape.seq * shape.batch, st, device,
                      on_row=row_out)


def train_hf_rank(rank: int, world: int, shape_kw: dict, st_kw: dict, out: str, argv, cpu: bool = False):
    """`kosmos bench train --hf` in one process (launcher.spawn with world 1): the env line, then every row."""
    from .environment import environment
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    shape = hf_shape(**shape_kw)
    st = TrainSettings(**st_kw)
    env = environment(argv=argv, bench="train")
    with open(out, "a") as f:
        f.write(json.dumps(env) + "\n")
        f.flush()

        def write(row):
            f.write(json.dumps({**row, "run_id": env["run_id"]}) + "\n")
            f.flush()
        run_train_hf(shape, st, device, on_row=write)
