"""The kernel modules' import paths of KOSMOS 0.1.0, kept for one release (kosmos/_moved.py); the ops now live in
kosmos/ops/, the GEMM pieces in kosmos/gemm/."""
