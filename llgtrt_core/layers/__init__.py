"""The model's per-layer ops besides the matmuls, one op per file: a plain torch version (the CPU
path and the reference) and, in the `*_triton.py` sibling, a fused Triton kernel for CUDA.
`ops.py` groups each implementation into a `LayerOps` set and picks one for a device."""
