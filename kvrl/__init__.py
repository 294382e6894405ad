"""kvrl: train KV-cache compression policies for reasoning LLMs with reinforcement learning."""

__version__ = "0.1.0"
