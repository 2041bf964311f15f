"""``python -m epd``: the ``epd`` command (``epd.cli``)."""
import sys

from epd.cli import main

sys.exit(main())
