"""Triton kernels for Kitty pages, each with a PyTorch reference beside it (see decode.py)."""
