"""titanlite: PyTorch-native LLM pretraining, from a laptop CPU to GPU clusters."""

__version__ = "0.1.0"
