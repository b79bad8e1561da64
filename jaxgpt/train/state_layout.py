"""A train state's leaves by name, and a saved state carried over to another layout.

A checkpoint names each array of the state by its path, as Orbax writes it ("step",
"params.blocks.attention.qkv.kernel", "opt_state.1.0.mu.token_embedding.embedding"). A run
asks for the state its config lays out now; the saved one may differ where the optimiser's
state changed shape (gradient clipping switched on or off by a forced resume, a new optax).
That is no damage: `carry_over` maps each leaf asked for to the saved leaf it continues (the
same path once the positions in optax's chains are set aside, the same shape and dtype, in the
saved order), and names what is fresh and what is dropped. The parameters and the step must all
carry over; where they do not, the saved state is another model's and nothing is carried.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import jax

# What must carry over for a saved state to continue: the model and where training stood.
MUST_CARRY = ("step", "params")


def key_name(entry: Any) -> str:
    """One step of a path as Orbax names it: a dict key, an attribute, a position."""
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def leaf_names(tree: Any) -> list[tuple[str, Any]]:
    """(name, leaf) for every leaf of `tree`, in its flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(".".join(key_name(entry) for entry in path), leaf) for path, leaf in flat]


def _role(name: str) -> str:
    """The name without positions: what a leaf is, wherever optax's chain puts it."""
    return ".".join(part for part in name.split(".") if not part.isdigit())


def _signature(leaf: Any) -> tuple[tuple[int, ...], str]:
    return tuple(leaf.shape), str(leaf.dtype)


@dataclass(frozen=True)
class Carried:
    """How a saved state maps onto the one asked for: `sources[name]` is the saved leaf each
    wanted leaf continues, or None where it starts fresh; `dropped` the saved leaves left out."""
    sources: dict[str, str | None]
    dropped: tuple[str, ...]

    @property
    def fresh(self) -> tuple[str, ...]:
        return tuple(name for name, source in self.sources.items() if source is None)

    def summary(self) -> str:
        """One line: what carried over, what is fresh, what is dropped."""
        optimiser = [name for name in self.sources if name.split(".")[0] not in MUST_CARRY]
        kept = sum(self.sources[name] is not None for name in optimiser)
        parts = [f"carried over the params, the step and {kept} of {len(optimiser)} optimiser arrays"]
        if self.fresh:
            parts.append(f"fresh: {_few(self.fresh)}")
        if self.dropped:
            parts.append(f"dropped: {_few(self.dropped)}")
        return "; ".join(parts)


def _few(names: tuple[str, ...], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class NotCarried(ValueError):
    """The saved state's parameters or step do not match the ones asked for."""


def same_layout(wanted: list[tuple[str, Any]], saved: dict[str, Any]) -> bool:
    return len(wanted) == len(saved) and all(
        name in saved and _signature(leaf) == _signature(saved[name]) for name, leaf in wanted)


def carry_over(wanted: list[tuple[str, Any]], saved: dict[str, Any]) -> Carried:
    """Map each wanted leaf to the saved one it continues (module docstring); NotCarried where
    the params or the step would not all carry over."""
    available: dict[tuple, list[str]] = defaultdict(list)
    for name, leaf in saved.items():  # saved in its own order
        available[(_role(name), *_signature(leaf))].append(name)
    sources: dict[str, str | None] = {}
    for name, leaf in wanted:
        candidates = available.get((_role(name), *_signature(leaf)))
        sources[name] = candidates.pop(0) if candidates else None
    missing = [name for name, source in sources.items() if source is None and name.split(".")[0] in MUST_CARRY]
    if missing:
        raise NotCarried(f"{len(missing)} of its parameters differ from this model's ({_few(tuple(missing))})")
    used = set(sources.values())
    dropped = tuple(name for name in saved if name not in used)
    lost = [name for name in dropped if name.split(".")[0] in MUST_CARRY]
    if lost:
        raise NotCarried(f"it holds {len(lost)} parameters this model has not ({_few(tuple(lost))})")
    return Carried(sources, dropped)
