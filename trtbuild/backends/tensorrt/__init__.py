"""The TensorRT backends, written to the real APIs and checked only against strict doubles here:
`onnx_plan` (ONNX -> TensorRT plan) and `llm` (TensorRT-LLM's engine flow), with `common` (timing
cache, plan files) and `runtime` (running a plan)."""
