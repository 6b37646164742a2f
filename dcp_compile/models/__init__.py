"""Reference models: a Llama-family target with static KV buffers."""

from dcp_compile.models.llama import Llama, LlamaConfig, init_weights

__all__ = ["Llama", "LlamaConfig", "init_weights"]
