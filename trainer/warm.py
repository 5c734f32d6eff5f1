"""The rank's entry point when torchrun forks it from a warm process instead of starting a new
interpreter (`scaletrain.app.agent`).

A new interpreter per rank costs `import trainer.train` (5.4 s of wall time here, 4.4 s of CPU,
four ranks sharing two cores) at every start and at every restart torchrun's agent makes. The
agent instead keeps one forkserver per machine that has imported the trainer once (`PRELOAD`),
started as the agent starts: a spare waiting in the rendezvous is warm before it is needed, and a
restart (a lost node replaced, a spare taking over, a failure the keepers pass on) forks ranks
with torch loaded. This module itself imports nothing heavy: the agent names `worker` without
loading the trainer.
"""

from __future__ import annotations

import atexit

# What the forkserver imports once, before any rank is forked from it.
PRELOAD = ["trainer.train", "trainer.keeper", "trainer.__main__"]


def worker(*argv: str) -> None:
    """Train as the rank torchrun's environment names, with the command line `argv`; a failure
    ends the process with the code `python -m trainer` would exit with."""
    from trainer.__main__ import main

    code = main(list(argv))
    # What `exit_now` runs before it ends a process: a forked worker ends with os._exit.
    atexit._run_exitfuncs()
    if code:
        raise SystemExit(code)
