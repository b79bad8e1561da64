"""nanochat's models (karpathy/nanochat's `GPT`) as jaxgpt's: its config and its weights.

    weights.py   nanochat's GPTConfig to a ModelConfig, its state dict to params and back (numpy)
    training.py  its optimizer and schedules as [train] overrides

May import the foundation, `model` and `data`; docs/nanochat.md maps every part.
"""

from jaxgpt.nanochat.training import TRAIN_OVERRIDES
from jaxgpt.nanochat.weights import model_config, params_from_state, short_window, state_from_params

__all__ = ["TRAIN_OVERRIDES", "model_config", "params_from_state", "short_window", "state_from_params"]
