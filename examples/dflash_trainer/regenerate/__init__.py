"""Regeneration: the target's own responses to a prompt set, the data a DFlash drafter learns from
(``python -m examples.dflash_trainer.regenerate``; the prompt file and the resumable output in io)."""
