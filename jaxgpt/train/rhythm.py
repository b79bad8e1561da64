"""When a run logs, evaluates, runs its harness tasks and saves: one rhythm for the training loop
(`jaxgpt.train.loop`) and a sweep's groups (`jaxgpt.tools.sweep`).

    rhythm = Rhythm.of(cfg.train, tasks=(cfg.train.eval_tasks_every,))
    now = rhythm.at(done, stopping=False)      # after `done` steps: Moments(log, eval, tasks, checkpoint)

Each happens every `*_every` steps and after the last one; a run stopping by a signal saves
where it stops, and nothing else moves with the stop. `tasks` holds the every of each of the
run's task evaluations (harness tasks, CORE); `Moments.tasks` says which are due.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from jaxgpt.config import TrainConfig


class Moments(NamedTuple):
    log: bool
    eval: bool
    tasks: tuple[bool, ...]  # per task evaluation of the run
    checkpoint: bool


@dataclass(frozen=True)
class Rhythm:
    total: int  # the run's last step
    log_every: int
    eval_every: int
    checkpoint_every: int
    tasks_every: tuple[int, ...] = ()  # each task evaluation's

    @classmethod
    def of(cls, train: TrainConfig, *, tasks: tuple[int, ...] = ()) -> Rhythm:
        return cls(train.steps, train.log_every, train.eval_every, train.checkpoint_every, tuple(tasks))

    def _due(self, every: int | None, done: int) -> bool:
        return every is not None and (done % every == 0 or done == self.total)

    def at(self, done: int, *, stopping: bool = False) -> Moments:
        """What happens once `done` steps are finished."""
        return Moments(log=self._due(self.log_every, done), eval=self._due(self.eval_every, done),
                       tasks=tuple(self._due(every, done) for every in self.tasks_every),
                       checkpoint=self._due(self.checkpoint_every, done) or stopping)
