"""DFlash drafter trainer: 5 target-model threads feed 3 drafter threads (threadgraph workers).

Run ``python -m examples.dflash_trainer --help``.
"""
