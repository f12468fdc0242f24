"""Attention kernels the model can run (`attn_implementation="triton"`): `fused_attention`, a fused causal
attention kernel for short bf16 sequences in Triton. The model imports it on first use, by its absolute name:
checkpoints do not carry it, and their code runs SDPA where the package is not installed."""
