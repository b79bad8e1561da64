"""Planning: whether a config trains on a chip, at what batch, before paying for the chip.

    api.py         plan, plans, plan_groups, largest_fitting_batch: the entry points
    targets.py     the TPUs and GPUs users rent, by name
    programs.py    the run's train, eval and sampling programs compiled from shapes
    report.py      the plan's record and the largest batch that fits
    loop_ops.py    what one iteration of a compiled loop (the decode program's token loop) runs
    compilers.py, worker.py   the compile process that runs a target's compiler

May import the model, the steps, parallel and kernels; nothing but the command line, the
notebook and scripts import it.
"""

from jaxgpt.plan.api import largest_fitting_batch, plan, plan_groups, plans
from jaxgpt.plan.report import HEADROOM, PROGRAMS
from jaxgpt.plan.targets import Target, known_names, target

__all__ = ["HEADROOM", "PROGRAMS", "Target", "known_names", "largest_fitting_batch", "plan", "plan_groups", "plans",
           "target"]
