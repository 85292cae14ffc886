"""The call-site fusions of trtbuild's decode matmul: what of the code around a matmul the kernel does.

Plain names, no Triton, so the model (models/llama.py) can read them on any machine; the kernel's
source digest covers this file too (decode_matmul.source_digest).
"""

# What a decode matmul can absorb from the code around it, so each is one launch instead of two or three
# (the H200 profiles show each small norm, gating or add kernel at 1.4-2.3 us, 3-4 of them per layer):
#   none      y = x @ w^T
#   norm      y = rmsnorm(x) @ w^T            (the RMSNorm before QKV, gate/up and the LM head)
#   residual  y = r + x @ w^T                 (the residual add after the output and down projections)
#   norm_gate y = silu(a) * b, [a | b] = rmsnorm(x) @ w^T   (gate/up: w holds both halves, y half as wide)
#   gate      y = silu(a) * b, [a | b] = x @ w^T            (gate/up with the norm left outside)
#   rms       y = (x / rms(x)) @ w^T, rms_gate likewise: the norm with its gain already folded into w
#             (`Transformer.fold_norm_gains`), so the kernel reads no gain vector and scales nothing per
#             element; it only sums x's squares as it streams, and scales the sums once at the end
FUSIONS = ("none", "norm", "residual", "norm_gate", "gate", "rms", "rms_gate")
GATED = ("norm_gate", "gate", "rms_gate")
GAINED = ("norm", "norm_gate")  # the normed fusions whose gain the kernel applies itself
# The fusions that include the RMSNorm before the matmul: "rms" and "rms_gate" are "norm" and
# "norm_gate" after `Transformer.fold_norm_gains`.
NORMED = ("norm", "norm_gate", "rms", "rms_gate")
