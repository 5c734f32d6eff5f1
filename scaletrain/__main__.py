"""`python -m scaletrain` is the `scaletrain` command."""

from scaletrain.app.cli import main
from scaletrain.process import exit_now

exit_now(main())
