"""The fixed keys of everything a checkpoint holds (plain Python: config checks use it)."""

STATE_KEYS: tuple[str, ...] = (
    "model",
    "optimizer",
    "lr_scheduler",
    "dataloader",
    "train_state",
    "rng",
    "ema",
    "diloco",
)
"""In this order ``titanlite.checkpoint.states.build_states`` builds the registry (the average
of the weights only with training.ema_decay; DiLoCo's outer state, titanlite.ft, only with
fault_tolerance.semi_sync_method); the same names are what
``checkpoint.exclude_from_loading`` may list."""
