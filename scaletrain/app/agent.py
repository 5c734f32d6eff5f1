"""torchrun for the embedded stack's machines: `torch.distributed.run`, less one torch 2.13 crash.

When a job ends while an agent waits in the rendezvous' redundancy list (a hot spare that was
never needed), the rendezvous closes, torch's agent returns no result, and torchrun then fails on
it (`AttributeError: 'NoneType' object has no attribute 'is_failed'` in `launch_agent`) and exits
1 with a traceback. That is the normal end of an unused spare: it says so in one line and exits
0. Anything else torchrun raises is left as it is.
"""

from __future__ import annotations

import sys


def main() -> int:
    from torch.distributed import run

    try:
        run.main()
    except AttributeError as exc:
        if "is_failed" not in str(exc):
            raise
        print("[agent] the job ended while this machine waited as a spare", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
