"""Triton / KServe v2 (Open Inference Protocol) with Triton's generate extension."""
