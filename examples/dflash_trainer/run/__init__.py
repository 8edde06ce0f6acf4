"""A run's lifecycle around the pipeline: its directory, checkpoints and metrics log, the startup
report, stopping (RunControl) and what ``train()`` returns (RunResult)."""
