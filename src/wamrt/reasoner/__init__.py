"""The Reasoner speaks: the Reasoner half of the served Cosmos 3 transformer plus `lm_head` as a chat model, with a
K/V-cached decode loop (`engine`), Qwen3-VL vision input for Nano / Super (`vision`), loading of `lm_head` and the
vision tower from the checkpoint (`load`) and structured prompt upsampling for world generation (`upsample`).
Nothing here changes the model: `ReasonerLM` runs the transformer's own Reasoner layers."""

from .engine import DecodeBatch, DecodeSeq, Reasoner, TokenEvent
from .lm import KVCache, ReasonerLM
from .load import reasoner_of
from .prompt import PreparedPrompt
from .sampling import SamplingParams

__all__ = ["DecodeBatch", "DecodeSeq", "KVCache", "PreparedPrompt", "Reasoner", "ReasonerLM", "SamplingParams",
           "TokenEvent", "reasoner_of"]
