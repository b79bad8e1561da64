"""train.window_warmup_steps: the attention window grows to model.attention_window over a run's
first steps, in `STAGES` equal rises, each a config (and so a compiled train step) of its own.

Over steps [k n / 4, (k + 1) n / 4) of n warm-up steps the windowed blocks read the last
ceil((k + 1) W / 4) keys: W/4, W/2, 3W/4, then W for the rest of the run. A window is static in
each program (a kernel may then skip the blocks it masks), so a warm-up costs three programs
beside the full one, each compiled when its first step comes and kept by the compile cache. The
stage is a function of the step alone, so a resumed run picks up the program it stopped in.
Eval, the sampler and the harness always read the full window.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxgpt.config import RunConfig

STAGES = 4


def window_at(cfg: RunConfig, step: int) -> int:
    """The windowed blocks' window at `step` (0 for a model without a window)."""
    W, n = cfg.model.attention_window, cfg.train.window_warmup_steps
    if not W or step >= n:
        return W
    return -(-W * (step * STAGES // n + 1) // STAGES)


def config_at(cfg: RunConfig, step: int) -> RunConfig:
    """The config whose train step runs `step`: `cfg` itself once the window is whole."""
    window = window_at(cfg, step)
    return cfg if window == cfg.model.attention_window else cfg.replace("model", attention_window=window)


class StagedSteps:
    """A run's train steps by step: `full` (the config's own), and the warm-up's stages, each
    compiled by `compile(staged_config)` when its first step asks for it."""

    def __init__(self, cfg: RunConfig, full: Callable, compile: Callable[[RunConfig], Callable]) -> None:
        self.cfg, self.full, self.compile = cfg, full, compile
        self.stages: dict[RunConfig, Callable] = {}

    def at(self, step: int) -> Callable:
        staged = config_at(self.cfg, step)
        if staged is self.cfg:
            return self.full
        if staged not in self.stages:
            self.stages[staged] = self.compile(staged)
        return self.stages[staged]
