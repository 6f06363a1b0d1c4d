"""Kernels: Triton HyTopK for CUDA, and the plain-PyTorch reference they are tested against."""
