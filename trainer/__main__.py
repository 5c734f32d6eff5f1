"""torchrun entry point: parse the command line, train, and turn errors into one line."""

from __future__ import annotations

import atexit
import os
import sys

from scaletrain.errors import ScaletrainError, UserError
from trainer.config import from_args, parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        cfg = from_args(args)
    except ValueError as exc:
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print(
            "trainer: error: run me under torchrun, e.g. "
            "`torchrun --standalone --nproc-per-node 4 -m trainer --run-id r1`",
            file=sys.stderr,
        )
        return 2
    from trainer.train import train

    try:
        train(cfg)
    except (UserError, ScaletrainError, ValueError) as exc:
        print(f"trainer: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def exit_now(code: int) -> None:
    """End the rank's process with `code` once `main` has returned, skipping the interpreter's
    teardown.

    By then the run has finished everything it owes explicitly (telemetry handed over, saves
    committed or failed, threads stopped, the process group destroyed), and the atexit handlers
    (logging, multiprocessing's children, torch's) still run here. What is skipped is freeing every
    module's objects one by one: for torch with dynamo and sympy loaded that costs a rank about a
    second of CPU, which on a host shared by many ranks delays the others, and an elastic agent
    waits for the slowest rank to exit before the job is over.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
