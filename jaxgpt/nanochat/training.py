"""nanochat's optimizer and schedule (nanochat/optim.py's MuonAdamW with gpt.py's
`setup_optimizer` groups, base_train.py's schedules) as jaxgpt's `[train]` keys
(docs/nanochat.md): pass them as `--set` overrides, or `load_config(path, TRAIN_OVERRIDES)`.

The peaks are base_train.py's defaults before its batch-size scaling (which is 1 at its
reference batch of 2^19 tokens); its weight decay is scaled by the batch and the horizon there:
set `train.weight_decay` to the figure it prints.
"""

TRAIN_OVERRIDES = (
    "train.optimizer=muon", "train.muon_orthogonalizer=polar_express", "train.muon_equilibrate_rows=true",
    "train.muon_renormalize=true", "train.muon_beta2=0.9", "train.muon_cautious_decay=true",
    "train.muon_qkv_apart=true", "train.muon_momentum_schedule=nanochat", "train.muon_decay_schedule=cosine",
    "train.adam_groups=nanochat", "train.adam_reference_width=768", "train.adam_eps=1e-10", "train.clip_norm=0",
    "train.muon_lr=0.02", "train.lr=0.02", "train.min_lr=0.0", "train.lr_embed=0.3", "train.lr_head=0.008",
    "train.lr_scalar=0.5", "train.weight_decay=0.28", "train.schedule=warmdown", "train.warmup_steps=40",
    "train.warmdown_ratio=0.65", "train.final_lr_frac=0.05",
)
