"""torchrun entry point: parse the command line, train, and turn errors into one line."""

from __future__ import annotations

import os
import sys

from scaletrain.errors import ScaletrainError, UserError
from scaletrain.process import KEEPER_PROCESS, RANK_PROCESS, exit_now, name_process
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

    name_process((KEEPER_PROCESS if cfg.in_job_restarts else RANK_PROCESS).format(rank=rank))

    def run() -> int:
        try:
            train(cfg)
        except (UserError, ScaletrainError, ValueError) as exc:
            print(f"trainer: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0

    if cfg.in_job_restarts:
        # This process keeps the rank: it forks the rank again after a failure (trainer.keeper).
        from trainer.keeper import keep

        return keep(run, cfg.in_job_restarts)
    return run()


if __name__ == "__main__":
    exit_now(main())
