"""When a run logs, evaluates, runs its harness tasks and saves: one rhythm for the training loop
(`jaxgpt.train.loop`) and a sweep's groups (`jaxgpt.tools.sweep`).

    rhythm = Rhythm.of(cfg.train, tasks=bool(cfg.train.eval_tasks))
    now = rhythm.at(done, stopping=False)      # after `done` steps: Moments(log, eval, tasks, checkpoint)

Each happens every `*_every` steps and after the last one; a run stopping by a signal saves
where it stops, and nothing else moves with the stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from jaxgpt.config import TrainConfig


class Moments(NamedTuple):
    log: bool
    eval: bool
    tasks: bool
    checkpoint: bool


@dataclass(frozen=True)
class Rhythm:
    total: int  # the run's last step
    log_every: int
    eval_every: int
    checkpoint_every: int
    tasks_every: int | None = None  # None: the run has no harness tasks

    @classmethod
    def of(cls, train: TrainConfig, *, tasks: bool = False) -> Rhythm:
        return cls(train.steps, train.log_every, train.eval_every, train.checkpoint_every,
                   train.eval_tasks_every if tasks else None)

    def _due(self, every: int | None, done: int) -> bool:
        return every is not None and (done % every == 0 or done == self.total)

    def at(self, done: int, *, stopping: bool = False) -> Moments:
        """What happens once `done` steps are finished."""
        return Moments(log=self._due(self.log_every, done), eval=self._due(self.eval_every, done),
                       tasks=self._due(self.tasks_every, done),
                       checkpoint=self._due(self.checkpoint_every, done) or stopping)
