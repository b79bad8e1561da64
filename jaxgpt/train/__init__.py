"""Training: the compiled step, its state on devices and on disk, and the loop that drives it.

    optim.py        clipping, AdamW with a decay mask, Muon, schedules
    step.py         pure train_step and eval_step, the train state
    sharding.py     the mesh, state and batch shardings (data / fsdp), pmap
    runtime.py      the steps run in the chosen parallel mode
    checkpoint.py   Orbax checkpoints, manifests, checksums, damage told from other errors, load_run
    state_layout.py a saved state's leaves by name, carried over to another optimiser layout
    imported.py     a run directory started from Hugging Face weights
    rhythm.py       when a run logs, evaluates, samples and saves (the loop's and the sweep's)
    sweep_mesh.py   a sweep group's members trained as one program on a ("members", "data") mesh
    loop.py         train(): the training loop

May import every package below it (foundation, runs, process, kernels, model, data, evaluation,
hf); plan, tools and the command line import it.

    from jaxgpt.train import train

`train` is looked up when first asked for, so that importing the step alone (`jaxgpt.plan`,
`jaxgpt.tools.bench`) does not import the loop and all it drives.
"""

from typing import Any

__all__ = ["train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from jaxgpt.train.loop import train

        return train
    raise AttributeError(f"module 'jaxgpt.train' has no attribute {name!r}")
