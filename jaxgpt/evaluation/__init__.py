"""What a trained model is asked: sampling, scoring, benchmark tasks.

    generate.py   sampling on the KV cache in fixed-shape chunks, speculative decoding
    scoring.py    log-likelihoods of (context, continuation) pairs in fixed-shape batches
    harness.py    the lm-evaluation-harness model backed by parameters, and its results
    tasks.py      task files, the harness's task manager, tasks run during training

May import the foundation, `runs`, `process`, `kernels`, `model` and `data` (the tokenizer);
takes parameters, not checkpoints, so the training loop can import it.
"""
