"""trtbuild's own GPU kernels (Triton), their launch-configuration lists and the PDL wait they share.

Each kernel module imports Triton at the top, so only CUDA builds import them; `fusions` and
`matmul_configs` are plain Python that any machine reads.
"""
