"""GEMM building blocks shared by the ops: TMA mainloop and epilogue pieces (tiles), the W = 1 static GEMM
(w1_static) and the W = 1 Gluon MXFP8 GEMM (w1_mx). Design: docs/design/gemm.md."""
