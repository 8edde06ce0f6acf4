"""``python -m examples.dflash_trainer.export``: see ``export.export`` for the flags."""

import sys

from .export import main

sys.exit(main())
