"""Test-session setup.

Without a GPU the Triton kernels run under the CPU interpreter. ``TRITON_INTERPRET`` is read when triton and
kosmos.device are imported, so it is set here, at conftest import time, before any test module imports them.
On a machine with CUDA it is left alone, so the GPU tests run real kernels (and the interpreter tests skip).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
