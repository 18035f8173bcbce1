"""Kernels and kernel selection (attention backends). Each has a plain-PyTorch reference in tests."""
