"""`python -m scaletrain` is the `scaletrain` command."""

import sys

from scaletrain.app.cli import main

sys.exit(main())
