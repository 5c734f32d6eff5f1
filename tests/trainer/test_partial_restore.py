"""A restore where a rank's own copy is gone (a replaced machine's) or fails its checksum: the
ranks whose copy holds the step intact restore from it, only the others read ckptd, a damaged
copy is never loaded, and every rank ends with the saved state bit for bit (two gloo ranks, a
real ckptd, DCP)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from copy_testing import damage_copies, machine_rank, run_ranks

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.digest import state_sha256
from trainer.checkpoint.own_copy import copy_dir, remove_copies

RUN = "partial-restore"
WORLD = 2


def _rank(rank: int, port: int, address: str, out: str, loss: str) -> None:
    # Each rank is a machine of its own: rank 1's is replaced before the restore.
    model, trainer = machine_rank(rank, port, WORLD, steps=6)
    saver = Checkpointer(address, RUN, model, trainer.optimizer, trainer.scheduler,
                         trainer.loader, every=2, last_step=6)  # fmt: skip
    trainer.step(), trainer.step()
    saved = state_sha256(model.state_dict()), trainer.loader.offset().global_sample
    assert saver.save(2, labels={}) is not None
    assert [done.error for done in saver.finish()] == [None]
    trainer.step(), trainer.step()  # the live state moves on
    dist.barrier()
    if rank == 1 and loss == "lost":
        remove_copies(RUN, "machine1")  # its machine was lost: a spare restores in its place
    if rank == 1 and loss == "damaged":
        damage_copies(copy_dir(RUN, "machine1", rank, WORLD))  # type: ignore[arg-type]
    dist.barrier()
    assert saver.load(2)["step"] == 2
    restored = state_sha256(model.state_dict()), trainer.loader.offset().global_sample
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"equal": restored == saved, "restored_from": saver.restored_from})
    )
    saver.close()
    dist.destroy_process_group()


@pytest.mark.skipif(
    copy_dir(RUN, "machine0", 0, WORLD) is None, reason="no /dev/shm for own copies"
)
@pytest.mark.parametrize("loss", ["lost", "damaged"])
def test_only_the_ranks_without_an_intact_own_copy_read_ckptd(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], loss: str
):
    server = run_ranks(_rank, WORLD, tmp_path, RUN, loss)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["equal"] for r in ranks] == [True, True]
    # Every rank reports the restore of the whole job: rank 0's part from its own memory, rank
    # 1's (its copy gone with its machine, or damaged) from ckptd's memory tier.
    (sources,) = {json.dumps(r["restored_from"], sort_keys=True) for r in ranks}
    restored_from = json.loads(sources)
    assert set(restored_from) == {"own memory@machine0", f"memory@{server.store.node}"}, (
        restored_from
    )
    assert all(size > 0 for size in restored_from.values()), restored_from
    said = "rank 1: its own copy of step 2 is not used: "
    assert (said in capfd.readouterr().out) is (loss == "damaged")
