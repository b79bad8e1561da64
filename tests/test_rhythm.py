"""The one rhythm the training loop and a sweep's groups keep: what happens after each step."""

from jaxgpt.config import load_config
from jaxgpt.train.rhythm import Rhythm


def test_each_moment_comes_at_its_multiples_and_after_the_last_step():
    train = load_config(None, ["train.steps=25", "train.log_every=5", "train.eval_every=10",
                               "train.checkpoint_every=20"]).train
    rhythm = Rhythm.of(train)
    moments = {done: rhythm.at(done) for done in range(1, 26)}
    assert [d for d, m in moments.items() if m.log] == [5, 10, 15, 20, 25]
    assert [d for d, m in moments.items() if m.eval] == [10, 20, 25]
    assert [d for d, m in moments.items() if m.checkpoint] == [20, 25]
    assert not any(m.tasks for m in moments.values())  # a run without harness tasks


def test_tasks_keep_their_own_rhythm_and_a_stop_saves_where_it_is():
    train = load_config(None, ["train.steps=30", "train.eval_every=10", "train.eval_tasks_every=15",
                               "train.checkpoint_every=100"]).train
    assert train.core_every == 10  # CORE's, unset, is the val loss's
    rhythm = Rhythm.of(train, tasks=(train.eval_tasks_every, 4))  # harness tasks and CORE, each its own
    assert [d for d in range(1, 31) if rhythm.at(d).tasks[0]] == [15, 30]
    assert [d for d in range(1, 31) if rhythm.at(d).tasks[1]] == [4, 8, 12, 16, 20, 24, 28, 30]
    assert not rhythm.at(7).checkpoint and rhythm.at(7, stopping=True).checkpoint
    assert rhythm.at(7, stopping=True)._replace(checkpoint=False) == rhythm.at(7)  # the stop moves nothing else
