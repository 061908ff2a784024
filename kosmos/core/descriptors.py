"""Host-built TMA descriptors: the ops build them on the host and pass them as launch parameters.

``tma_descriptor(t, block)`` is Triton's ``TensorDescriptor`` of a 2-D row-major tensor, validated once per layout
and copied after that; ``host_descriptors`` the A / B / C triple of a TP GEMM. ``GluonDescriptor`` is Gluon's
Hopper descriptor class (None where this Triton has no Gluon); ``DESCRIPTOR_TYPES`` the classes a launch plan
(core/launch_plan.py) rebinds per call. Design: docs/design/core.md ("Host TMA descriptors"). Tests:
tests/test_runtime.py (a template copy equals a fresh descriptor)."""
from __future__ import annotations

from triton.tools.tensor_descriptor import TensorDescriptor

try:  # Gluon (Triton >= 3.5); gemm/w1_mx.py's kernel takes its descriptors
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except Exception:  # noqa: BLE001 -- any import failure: no Gluon descriptors (gemm/w1_mx.py says why)
    GluonDescriptor = None

DESCRIPTOR_TYPES = (TensorDescriptor,) + ((GluonDescriptor,) if GluonDescriptor is not None else ())

_DESCRIPTOR_TEMPLATES: dict = {}


def tma_descriptor(t, block_shape):
    """A host-built TMA descriptor of the 2-D row-major tensor ``t`` with tiles of ``block_shape``.

    Triton validates a new ``TensorDescriptor`` in Python (microseconds each, three or four per call);
    the fields depend only on the layout and the base, so each layout is validated once and later
    calls copy that template and set ``base``. ``t`` itself passed the op's checks (16-byte aligned) or is
    a fresh allocation. The template keeps no tensor alive."""
    key = (tuple(t.shape), tuple(t.stride()), t.dtype, tuple(block_shape))
    tmpl = _DESCRIPTOR_TEMPLATES.get(key)
    if tmpl is None:
        tmpl = TensorDescriptor.from_tensor(t, list(block_shape))  # validated here, once per layout
        tmpl.base = None
        if len(_DESCRIPTOR_TEMPLATES) > 4096:  # many one-off shapes: start over rather than grow
            _DESCRIPTOR_TEMPLATES.clear()
        _DESCRIPTOR_TEMPLATES[key] = tmpl
    desc = object.__new__(type(tmpl))
    desc.__dict__.update(tmpl.__dict__)
    desc.base = t
    return desc


def host_descriptors(a, b_store, b_kmajor: bool, c, cfg):
    """TMA descriptors of A [rows, K] (tiles [BM, BK]), B ([K, N] tiles [BK, BN], or [N, K] tiles [BN, BK] when
    k-major) and C [rows, N] (half-width [BM, BN/2] store tiles), built on the host: they reach the kernel as
    launch parameters (device-built ones would cost every program time at the start of a call)."""
    b_block = [cfg.BN, cfg.BK] if b_kmajor else [cfg.BK, cfg.BN]
    return (tma_descriptor(a, [cfg.BM, cfg.BK]), tma_descriptor(b_store, b_block),
            tma_descriptor(c, [cfg.BM, cfg.BN // 2]))
