"""`wamrt.train`: flow-matching post-training of a small Cosmos 3 policy on simulator demonstrations,
through the same packing the server uses at inference (see trainer.py)."""

from .data import DemoSet, load_demo_set, record_canvas_demos
from .trainer import PolicyTrainer, TrainConfig, request_layout

__all__ = ["DemoSet", "PolicyTrainer", "TrainConfig", "load_demo_set", "record_canvas_demos", "request_layout"]
