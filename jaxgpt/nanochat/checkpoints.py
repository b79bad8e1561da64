"""nanochat's checkpoint files read and written as its checkpoint_manager lays them out.

    BASE/base_checkpoints/d{L}/model_{step:06d}.pt    the GPT's state dict (torch tensors)
    BASE/base_checkpoints/d{L}/meta_{step:06d}.json   {"step", "model_config": GPTConfig's fields, ...}
    BASE/tokenizer/tokenizer.pkl                      a pickled tiktoken Encoding

Reading and writing `.pt` files needs PyTorch (the `nanochat` extra; a CPU build is enough),
imported here alone. The state dict is read with `weights_only=True`: tensors, no code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.errors import UserError

MODEL_FILE = re.compile(r"model_(\d+)\.pt$")


def torch_module() -> Any:
    try:
        import torch
    except ImportError:
        raise UserError("reading and writing nanochat's .pt files needs PyTorch: pip install 'jaxgpt[nanochat]' "
                        "(a CPU build is enough)") from None
    return torch


def newest_step(folder: Path) -> int:
    """The highest step of a model_NNNNNN.pt in `folder`, as nanochat's find_last_step."""
    if not folder.is_dir():
        raise UserError(f"no nanochat checkpoint folder at {folder}")
    steps = [int(m.group(1)) for f in folder.iterdir() if (m := MODEL_FILE.match(f.name))]
    if not steps:
        raise UserError(f"{folder} holds no model_NNNNNN.pt: not a nanochat checkpoint folder")
    return max(steps)


def read_checkpoint(folder: str | Path, step: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any], int]:
    """(the state dict as float32 numpy arrays, the meta, the step) of `folder`'s newest
    checkpoint, or of `step`'s. A missing meta or model file is one line."""
    folder = Path(folder)
    step = newest_step(folder) if step is None else step
    model_path, meta_path = folder / f"model_{step:06d}.pt", folder / f"meta_{step:06d}.json"
    if not model_path.is_file():
        raise UserError(f"{folder} holds no model_{step:06d}.pt (its newest is step {newest_step(folder)})")
    if not meta_path.is_file():
        raise UserError(f"{folder} holds model_{step:06d}.pt but no meta_{step:06d}.json: nanochat's meta names "
                        "the model's config")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{meta_path} is not JSON: {err}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model_config"), dict):
        raise UserError(f"{meta_path} has no model_config")
    torch = torch_module()
    try:
        tensors = torch.load(model_path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch's unpickler raises many kinds; each is a file that is not a state dict
        raise UserError(f"{model_path} is not a state dict torch can read: {str(err).splitlines()[0]}") from None
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise UserError(f"{model_path} does not hold a state dict of tensors")
    return {k: v.detach().float().numpy() for k, v in tensors.items()}, meta, step


def write_checkpoint(folder: Path, step: int, state: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """model_NNNNNN.pt and meta_NNNNNN.json, as nanochat's save_checkpoint writes them (float32
    tensors: nanochat's loader casts them to its compute dtype)."""
    torch = torch_module()
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()}, folder / f"model_{step:06d}.pt")
    (folder / f"meta_{step:06d}.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
