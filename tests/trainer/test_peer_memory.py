"""Memory saves (--mem-ckpt-every) kept in the rank's own memory and a peer node's: a save
mirrors every rank's sealed own copy to its buddy on the next node, without ckptd; a resume
after a node is lost, or with a damaged own copy, brings the state back from the peer node's
memory, bit for bit, and never loads a damaged copy (two gloo ranks, each its own simulated
machine; a real ckptd, which must hold nothing of the memory steps)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch.distributed as dist
from copy_testing import damage_copies, machine_rank, resume, run_ranks

from ckptd.client import CkptdClient
from scaletrain.errors import NotFound
from trainer.checkpoint.checkpointer import Checkpointer, SaveKind
from trainer.checkpoint.digest import state_sha256
from trainer.checkpoint.own_copy import copy_dir, remove_copies
from trainer.checkpoint.peer_copy import buddies, peer_dir

RUN = "peer-memory"
WORLD = 2


def _rank(rank: int, port: int, address: str, out: str, loss: str) -> None:
    model, trainer = machine_rank(rank, port, WORLD, steps=8)

    def checkpointer() -> Checkpointer:
        return Checkpointer(address, RUN, model, trainer.optimizer, trainer.scheduler,
                            trainer.loader, every=0, last_step=8, mem_every=1)  # fmt: skip

    saver = checkpointer()
    report: dict[str, object] = {}
    for step in (1, 2, 3):
        trainer.step()
        if step == 3:
            report["saved"] = state_sha256(model.state_dict())
            report["sample"] = trainer.loader.offset().global_sample
        started = saver.save(step, labels={})
        assert started is not None and started.kind is SaveKind.MEMORY
        saver.wait_staged()
    report["errors"] = [str(done.error) for done in saver.finish() if done.error]
    with CkptdClient(address) as client, contextlib.suppress(NotFound):
        report["in_ckptd"] = client.get(RUN).ref.step  # the memory steps never went there
    trainer.step()  # the live state moves on
    # The loss strikes while the copies sit in the machines' memory; a new generation of the
    # checkpointer (as after a restart) then resumes.
    dist.barrier()
    if rank == 1 and loss == "lost":
        remove_copies(RUN, "machine1")  # its own copies, and the peer copy of rank 0 it held
    if rank == 1 and loss == "damaged":
        damage_copies(copy_dir(RUN, "machine1", rank, WORLD))  # type: ignore[arg-type]
    dist.barrier()
    restarted = checkpointer()
    report["resumed"] = resume(restarted, RUN)
    report["restored"] = state_sha256(model.state_dict())
    report["restored_sample"] = trainer.loader.offset().global_sample
    report["restored_from"] = restarted.restored_from
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    restarted.close()
    dist.destroy_process_group()


def test_each_rank_mirrors_to_the_same_place_on_the_next_node():
    hosts = ["a", "a", "b", "b", "c", "c"]
    assert [buddies(hosts, r) for r in range(6)] == [
        (2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3),
    ]  # fmt: skip
    assert buddies(["a", "a"], 1) == (None, None)  # one node: no peer to mirror to
    assert buddies(["a", "a", "b"], 1) == (None, None)  # node b has no second rank


@pytest.mark.skipif(
    copy_dir(RUN, "machine0", 0, WORLD) is None, reason="no /dev/shm for own copies"
)
@pytest.mark.parametrize("loss", ["lost", "damaged"])
def test_a_memory_step_comes_back_from_the_peer_nodes_memory_when_the_own_copy_is_gone_or_damaged(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], loss: str
):
    run_ranks(_rank, WORLD, tmp_path, RUN, loss)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["errors"] for r in ranks] == [[], []]
    assert [r.get("in_ckptd") for r in ranks] == [None, None]
    assert [r["resumed"] for r in ranks] == [3, 3]
    assert [r["restored"] == r["saved"] for r in ranks] == [True, True]
    assert [r["restored_sample"] == r["sample"] for r in ranks] == [True, True]
    # Rank 0 from its own memory; rank 1's copy, gone with its machine or damaged, from the
    # copy machine0 keeps of it.
    (sources,) = {json.dumps(r["restored_from"], sort_keys=True) for r in ranks}
    restored_from = json.loads(sources)
    assert set(restored_from) == {"own memory@machine0", "peer memory@machine0"}, restored_from
    assert restored_from["own memory@machine0"] == restored_from["peer memory@machine0"] > 0
    # The copies of a finished run are freed, the peer copies too.
    assert not peer_dir(RUN, "machine0", 1, WORLD).exists()
    assert "fails its CRC" not in capfd.readouterr().out  # a damaged copy was never loaded
