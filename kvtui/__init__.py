"""kvtui: a terminal load simulator for LLM batching with a real PyTorch + transformers engine inside."""

__version__ = "0.1.0"
