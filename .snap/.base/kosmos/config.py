"""The ops' tuning knobs as explicit, validated configs (nothing in KOSMOS reads a knob from the environment).

Each fused op takes ``config=`` (``None`` = the defaults below). A config is a frozen dataclass checked on
construction: a bad field raises ``ValueError`` naming it. Tile shapes are not knobs: they follow from the
shape (``planning.tile_config``). The bench takes ``--config key=value`` and records the config of every row.

    kosmos.all_gather_matmul(a, b, config=kosmos.AllGatherMatmulConfig(push_chunks="auto"))
    kosmos.matmul_reduce_scatter(a, b, config=kosmos.MatmulReduceScatterConfig(push_partials=True))
    kosmos.moe_forward(..., config=kosmos.MoEForwardConfig(copy_cols=256))

Why each knob exists and what it measured is in the op's docstring; the defaults are the measured best where a
measurement exists (the two-GPU A/Bs of ``push_chunks`` and ``push_partials`` are still to run: NOTES.md).
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
               (2x H200, EP=2, session 3, `dev.moe_probe`).
    half_tail  an expert's last m-tile of at most BM/2 rows runs as a BM/2-row tile (half the MACs): -8.4% on
               deepseek-v3 4k uniform (2x H200, EP=2, session 3). False: every m-tile is full height.
    """
    copy_cols: int = 512
    half_tail: bool = True

    def __post_init__(self):
        _power_of_two("copy_cols", self.copy_cols, 16)
        if not isinstance(self.half_tail, bool):
            raise ValueError(f"half_tail={self.half_tail!r} must be true or false")


CONFIG_TYPES = {"all_gather_matmul": AllGatherMatmulConfig, "matmul_reduce_scatter": MatmulReduceScatterConfig,
                "moe_forward": MoEForwardConfig}


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
