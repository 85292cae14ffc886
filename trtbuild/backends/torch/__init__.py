"""The PyTorch AOTInductor backend: `backend` builds and loads; `export`, `inductor`, `compile_workers`
and `graph_cache` make and keep the compiled graphs; `decode_kernels` and `prefill_attention` choose the
kernels by timing; `runtime` runs an entry with `decode_graphs` and `prefill_graphs`; `weights_reader`
and `weights_preload` read the weights; `pdl` and `cxx` deal with the CUDA driver and the C++ runtime."""
