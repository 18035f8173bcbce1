"""wamrt: World-Action Model runtime for NVIDIA Cosmos 3 checkpoints."""

__version__ = "0.1.0"
