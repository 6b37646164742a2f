"""Reference models: a Llama-family target with static KV buffers, and EAGLE/EAGLE3 drafts."""

from dcp_compile.models.draft_config import DraftConfig, eagle3_aux_layers
from dcp_compile.models.eagle import EagleDraft
from dcp_compile.models.mla import MLAConfig, MLATransformer
from dcp_compile.models.llama import Llama, LlamaConfig, init_weights

__all__ = [
    "DraftConfig", "EagleDraft", "Llama", "LlamaConfig", "MLAConfig", "MLATransformer", "eagle3_aux_layers", "init_weights",
]
