"""Builders for the diffusers 0.42.1 reference (the test oracle). Test-only code."""
