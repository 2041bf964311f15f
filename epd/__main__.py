import sys

from epd.cli import main

sys.exit(main())
