"""A stored run's curves as TensorBoard event files, written from telemetry alone.

`scaletrain telemetry export --tensorboard DIR --run RUN` (any stored run) and `scaletrain run
--tensorboard DIR` (the run just trained) write `telemetry.scalars.step_scalars` with
the `tensorboard` package's own `EventFileWriter` (what `torch.utils.tensorboard` writes
through, without importing torch into telemetry), one scalar per column and step that has a
value, under DIR/RUN, so several runs share one DIR.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from telemetry.queries import Bind
from telemetry.scalars import step_scalars

# Each column of telemetry.scalars.SCALAR_COLUMNS and its tag: training curves apart from the
# efficiency figures.
TAGS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "goodput": "perf/goodput",
    "checkpoint_stall_s": "perf/checkpoint_stall_s",
}


def write_tensorboard(bind: Bind, run_id: str, directory: Path) -> tuple[Path, int]:
    """Write run `run_id`'s scalars under `directory`/`run_id`: (that directory, scalars
    written). NotFound for a run telemetry does not know."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    scalars = step_scalars(bind, run_id)
    logdir = directory / run_id
    written = 0
    writer = EventFileWriter(str(logdir))
    try:
        for row in scalars.itertuples(index=False):
            values = [
                Summary.Value(tag=tag, simple_value=getattr(row, column))
                for column, tag in TAGS.items()
                if math.isfinite(getattr(row, column))
            ]
            writer.add_event(Event(wall_time=time.time(), step=int(row.step),
                                   summary=Summary(value=values)))  # fmt: skip
            written += len(values)
    finally:
        writer.close()
    return logdir, written
