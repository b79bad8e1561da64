"""Hugging Face folders: GPT-2 and Llama weights and configs in and out (safetensors).

    importer.py   an HF folder to a ModelConfig and parameters (import-hf, --init-from)
    exporter.py   parameters to an HF folder that `transformers` loads

May import the foundation, `model` and `data` (the tokenizer); a run directory made
from imported weights is written by `jaxgpt.train.imported`.
"""

from jaxgpt.hf.exporter import export_hf
from jaxgpt.hf.importer import import_hf, model_config

__all__ = ["export_hf", "import_hf", "model_config"]
