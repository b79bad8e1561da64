"""The public path of sampling (`from jaxgpt.generate import generate`); the decoder's sampling
lives in `jaxgpt.evaluation.generate`."""

from jaxgpt.evaluation.generate import generate, generate_tokens

__all__ = ["generate", "generate_tokens"]
