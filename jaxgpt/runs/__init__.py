"""What jaxgpt keeps on disk: a run's directory and the cache folder beside the token stores.

    rundir.py    a run directory's file names (RunDir), atomic writes, $JAXGPT_CACHE
    metrics.py   metrics.jsonl (written, read back, cut at a resumed step), the loss plot
    trackers.py  where the records go beside it (train.trackers): the interface, TensorBoard's
    events.py    TensorBoard event files, written without TensorFlow
    wandb_tracker.py  Weights & Biases (jaxgpt[wandb]), resumed runs and fallbacks

Imports only the foundation (`jaxgpt.config`, `jaxgpt.errors`); every other package may import it.
"""
