"""``python -m trapetum ...``: the same command line as the ``trapetum`` script (:mod:`trapetum.cli`)."""
import sys

from .cli import main

sys.exit(main())
