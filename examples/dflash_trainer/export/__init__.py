"""Export a trainer checkpoint as a drafter that serving stacks read: ``python -m
examples.dflash_trainer.export`` (``export``), in the z-lab (``zlab``) or the speculators
(``export_speculators``) format, from a checkpoint read and checked by ``source``."""
