"""Reference models: a Llama-family target with static KV buffers."""

from dcp_compile.models.llama import Llama, LlamaConfig, init_weights

__all__ = ["Llama", "LlamaConfig", "init_weights"]
from dcp_compile.models.eagle import DraftConfig, EagleDraft, eagle3_aux_layers

__all__ += ["DraftConfig", "EagleDraft", "eagle3_aux_layers"]
