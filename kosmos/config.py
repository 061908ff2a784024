"""The ops' tuning knobs as explicit, validated configs (nothing in KOSMOS reads a knob from the environment).

Each fused op takes ``config=`` (``None`` = the defaults below). A config is a frozen dataclass checked on
construction: a bad field raises ``ValueError`` naming it. Tile shapes are not knobs: they follow from the
shape (``planning.tile_config``). The bench takes ``--config key=value`` and records the config of every row.

    kosmos.all_gather_matmul(a, b, config=kosmos.AllGatherMatmulConfig(push_chunks="auto"))
    kosmos.matmul_reduce_scatter(a, b, config=kosmos.MatmulReduceScatterConfig(push_partials=True))
    kosmos.moe_forward(..., config=kosmos.MoEForwardConfig(copy_cols=256))
    kosmos.ops.moe_backward.moe_backward(..., config=kosmos.MoEBackwardConfig(one_launch=False))

Each field's doc says what it does and, briefly, why its default; the full why, the measurements and which
defaults still wait for a two-GPU A/B (``push_chunks``, ``push_partials``) are in docs/design/<op>.md. Tests:
tests/test_runtime.py (bad fields, ``config_from_strings`` and back).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union


def _power_of_two(name: str, value, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of two >= {lo}")


@dataclass(frozen=True)
class AllGatherMatmulConfig:
    """Knobs of ``all_gather_matmul``.

    push_chunks  chunks of BM rows per push task: an integer >= 1, or ``"auto"`` (about 16 push tasks per rank
                 in all, however long the shard). Fewer, larger push tasks take NVLink's bandwidth from fewer
                 SMs. Default 1 (one chunk per task).
    copy_block   elements per step of a row copy (a power of two >= 256). 16384 moves 2.5x more per program
                 than 4096 (one H200) and keeps the kernel spill-free.
    """
    push_chunks: Union[int, str] = 1
    copy_block: int = 16384

    def __post_init__(self):
        pc = self.push_chunks
        if not (pc == "auto" or (isinstance(pc, int) and not isinstance(pc, bool) and pc >= 1)):
            raise ValueError(f"push_chunks={pc!r} must be an integer >= 1 or 'auto'")
        _power_of_two("copy_block", self.copy_block, 256)


@dataclass(frozen=True)
class MatmulReduceScatterConfig:
    """Knobs of ``matmul_reduce_scatter``.

    push_partials  False (default): each partial tile is stored in this rank's staging and its owner pulls the W
                   partials over NVLink. True: the partial is pushed into the owner's staging from the GEMM
                   epilogue and the owner reduces from local memory (no latency-bound pulls).
    """
    push_partials: bool = False

    def __post_init__(self):
        if not isinstance(self.push_partials, bool):
            raise ValueError(f"push_partials={self.push_partials!r} must be true or false")


@dataclass(frozen=True)
class MoEForwardConfig:
    """Knobs of ``moe_forward`` (and ``expert_gemms``).

    copy_cols  columns per copy step of the data movers (dispatch, permute, fold), a power of two >= 16.
               512 against 256: -3.8% at qwen3 16k, -2.3..+0.3% per suite point; 128 was 2-4% slower than 256
               (2x H200, EP=2, `dev.moe_probe`).
    half_tail  an expert's last m-tile of at most BM/2 rows runs as a BM/2-row tile (half the MACs): -8.4% on
               deepseek-v3 4k uniform (2x H200, EP=2). False: every m-tile is full height.
    """
    copy_cols: int = 512
    half_tail: bool = True

    def __post_init__(self):
        _power_of_two("copy_cols", self.copy_cols, 16)
        if not isinstance(self.half_tail, bool):
            raise ValueError(f"half_tail={self.half_tail!r} must be true or false")


@dataclass(frozen=True)
class MoEBackwardConfig:
    """Switches of ``moe_backward`` (kosmos.ops.moe_backward): which path runs, and the one launch's scheduling
    options. The defaults are the measured best; each alternative stays bitwise-tested and is named in
    docs/design/moe_backward.md with its measurement.

    one_launch            EP = 1: the whole backward in one persistent launch on the padded rows (True), or the
                          separate kernels (False). ``moe_backward(one_launch=...)`` overrides it per call.
    one_launch_ep         EP > 1 on CUDA: the exchanges in the one launch too (True), or the separate kernels with
                          NCCL all-to-alls between them (False).
    padded_rows           the expert rows in the padded layout, each expert's rows starting at a multiple of 64
                          (True; needed by the one launch), or packed (False). ``padded=`` overrides it per call.
    router_in_launch      the router backward as stages of the one launch (True), or torch ops after it (False).
                          ``router_in_launch=`` overrides it per call.
    swiglu_on_completion  the one launch's SwiGLU pass of an m-tile run by the program that finishes its last
                          dgrad2 tile (True), or queued after every dgrad2 tile (False).
    wgrad1_sync           the one launch's programs rendezvous (bounded, no error) before the GEMM1 weight
                          gradient, so that they share its panels in L2 (True).
    wgrad_dynamic         the last ``wgrad_dynamic_16ths``/16 of each weight-gradient loop's tiles claimed in runs of
                          this many tiles, an integer >= 0 (0: every tile statically owned).
    wgrad_dynamic_16ths   that share, an integer 0..16.
    dgrad1_lean           the one launch's GEMM1 dgrad at EP = 1 without per-task synchronisation once every SwiGLU
                          pass is seen done (True), or with a wait and release per task (False).
    swiglu_stages         the one launch's SwiGLU pass software-pipelined over this many stages, an integer >= 1.
    wgrad_kernel          the separate weight-gradient kernel: "persistent" (two programs per SM) or "tiles" (one
                          program per output tile); both give the same bits.
    dgrad2_fused          the separate path's GEMM2 dgrad with the SwiGLU backward in its epilogue (True), or the
                          GEMM then a SwiGLU pass (False).
    dgrad2_split          the fused epilogue on the two halves of the tile one after the other (True).
    dgrad2_emits_h        h = silu(g) u stored by the dgrad2 kernels (True), or by a pass of its own (False).
    swiglu_h_torch        h by torch's formula instead of a kernel (False; the fallback if a kernel's h differs).
    router_gemms          the router backward's GEMMs: "tensor-cores" (bf16 products, fp32 accumulation) or "fp32".
    """
    one_launch: bool = True
    one_launch_ep: bool = True
    padded_rows: bool = True
    router_in_launch: bool = True
    swiglu_on_completion: bool = True
    wgrad1_sync: bool = True
    wgrad_dynamic: int = 8
    wgrad_dynamic_16ths: int = 1
    dgrad1_lean: bool = True
    swiglu_stages: int = 3
    wgrad_kernel: str = "persistent"
    dgrad2_fused: bool = False
    dgrad2_split: bool = True
    dgrad2_emits_h: bool = True
    swiglu_h_torch: bool = False
    router_gemms: str = "tensor-cores"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in (bool, "bool") and not isinstance(value, bool):
                raise ValueError(f"{f.name}={value!r} must be true or false")
        _int_in("wgrad_dynamic", self.wgrad_dynamic, 0, None)
        _int_in("wgrad_dynamic_16ths", self.wgrad_dynamic_16ths, 0, 16)
        _int_in("swiglu_stages", self.swiglu_stages, 1, None)
        _choice("wgrad_kernel", self.wgrad_kernel, ("persistent", "tiles"))
        _choice("router_gemms", self.router_gemms, ("tensor-cores", "fp32"))


def _int_in(name: str, value, lo: int, hi) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name}={value!r} must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose from {', '.join(map(repr, choices))}")


CONFIG_TYPES = {"all_gather_matmul": AllGatherMatmulConfig, "matmul_reduce_scatter": MatmulReduceScatterConfig,
                "moe_forward": MoEForwardConfig, "moe_backward": MoEBackwardConfig}


_DEFAULTS: dict = {}


def default_config(cls):
    """The one default instance of ``cls`` (configs are frozen: built once, not on every call)."""
    config = _DEFAULTS.get(cls)
    if config is None:
        config = _DEFAULTS[cls] = cls()
    return config


def check_config(cls, config):
    """``config`` if it is a ``cls`` (the default instance for None); a one-line ValueError otherwise. The public
    ops call it once; what they hand on (launch, planning) is already checked."""
    if config is None:
        return default_config(cls)
    if not isinstance(config, cls):
        raise ValueError(f"config must be a kosmos.{cls.__name__}, got {type(config).__name__}")
    return config


def _parse_value(cls, name: str, text: str):
    default = getattr(cls(), name)
    t = text.strip()
    if isinstance(default, bool):
        low = t.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={text!r} must be true or false")
    if isinstance(default, int):
        if t.lower() == "auto" and name == "push_chunks":
            return "auto"
        try:
            return int(t)
        except ValueError:
            raise ValueError(f"{name}={text!r} must be an integer") from None
    return t


def config_from_strings(cls, pairs: dict):
    """A ``cls`` from ``{"field": "text"}`` (the bench's ``--config field=value``): values parsed by the field's
    type, unknown fields rejected with the list of known ones."""
    known = [f.name for f in dataclasses.fields(cls)]
    kw = {}
    for name, text in pairs.items():
        if name not in known:
            raise ValueError(f"unknown {cls.__name__} field {name!r}; known: {', '.join(known)}")
        kw[name] = _parse_value(cls, name, str(text))
    return cls(**kw)


def config_dict(config) -> dict:
    """The config as a plain dict (every field, defaults included): what a result row records."""
    return dataclasses.asdict(config)
