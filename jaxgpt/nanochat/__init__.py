"""nanochat's models (karpathy/nanochat's `GPT`) as jaxgpt's: its config, weights, optimizer,
tokenizer and checkpoint files.

    weights.py      nanochat's GPTConfig to a ModelConfig, its state dict to params and back (numpy)
    training.py     its optimizer and schedules as [train] overrides
    checkpoints.py  its model_NNNNNN.pt and meta_NNNNNN.json read and written (PyTorch, imported there alone)

May import the foundation, `model` and `data` (whose `Tokenizer.load` reads its tokenizer.pkl:
`jaxgpt/data/tiktoken_pickle.py`); a run directory made from a nanochat checkpoint,
and one written back, is `jaxgpt.train.imported`'s. docs/nanochat.md maps every part.
"""

from jaxgpt.nanochat.training import TRAIN_OVERRIDES
from jaxgpt.nanochat.weights import model_config, params_from_state, short_window, state_from_params

__all__ = ["TRAIN_OVERRIDES", "model_config", "params_from_state", "short_window", "state_from_params"]
