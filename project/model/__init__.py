from project.model.flops import count_parameters, training_flops_per_token
from project.model.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig", "count_parameters", "training_flops_per_token"]
