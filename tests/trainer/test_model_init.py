"""Initial weights depend on (seed, name, position) alone, so a rank builds only its shards.

The layout tests check that every parallel layout starts from one process's weights bit for bit;
here: the scheme's own properties, and a model too large for the old build path (every rank
materialising the whole model) that builds and trains a step on 4 gloo ranks under FSDP2.
"""

from __future__ import annotations

import json
import resource
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.config import TrainConfig
from trainer.model.init import fill_normal, parameter_key, standard_normal
from trainer.model.llama import ModelArgs, Transformer
from trainer.parallel.dims import validate_layout
from trainer.parallel.parallelize import build_model

# ~100M parameters (400 MB in fp32), nearly all in the blocks: each rank holds a quarter.
LARGE = ModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=256)


def _full(shape: tuple[int, ...], key: int) -> torch.Tensor:
    whole = torch.empty(shape)
    fill_normal(whole, shape, [torch.arange(n) for n in shape], key, 1.0)
    return whole


def test_any_block_of_rows_and_columns_gets_the_values_of_the_whole_tensor():
    key, shape = parameter_key(0, "layers.0.attention.wq.weight"), (37, 53)
    whole = _full(shape, key)
    rows, columns = torch.arange(5, 15), torch.arange(53)[1::3]  # uneven, strided
    block = torch.empty(len(rows), len(columns))
    fill_normal(block, shape, [rows, columns], key, 1.0)
    assert torch.equal(block, whole[rows][:, columns])


def test_values_depend_on_seed_and_name_and_follow_a_standard_normal():
    values = standard_normal(parameter_key(0, "w"), torch.arange(200_000))
    assert abs(values.mean()) < 0.01 and abs(values.std() - 1) < 0.01
    assert abs((values**4).mean() - 3) < 0.05  # a normal's kurtosis
    other_seed = standard_normal(parameter_key(1, "w"), torch.arange(8))
    other_name = standard_normal(parameter_key(0, "v"), torch.arange(8))
    assert not torch.equal(values[:8], other_seed) and not torch.equal(values[:8], other_name)


def test_a_plain_model_and_its_meta_built_twin_get_the_same_weights():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    plain = Transformer(args)
    plain.init_weights(7)
    with torch.device("meta"):
        twin = Transformer(args)
    twin.to_empty(device="cpu")
    twin.init_weights(7)
    pairs = zip(plain.state_dict().values(), twin.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert torch.equal(plain.rope_cos, twin.rope_cos)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _train_one_step(rank: int, world: int, port: int, out: str) -> None:
    """One rank: build LARGE under FSDP2 (the peak RSS that adds), then one forward, backward and
    SGD step."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    cfg = TrainConfig(run_id="large", model=LARGE, seq_len=16, global_batch=world)
    mesh = validate_layout(cfg, world).build_mesh("cpu")
    before = _peak_rss()
    parallel, _ = build_model(cfg, mesh, torch.device("cpu"))
    built = _peak_rss() - before
    tokens = torch.randint(0, LARGE.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    loss = parallel.forward(tokens[:, :-1], tokens[:, 1:])
    parallel.backward(loss)
    grad_norm = parallel.clip_grad_norm_(1.0)
    # Plain SGD keeps no state: AdamW's two moments alone are half the model over 4 ranks.
    torch.optim.SGD(parallel.model.parameters(), lr=1e-3).step()
    every: list[object] = [None] * world
    dist.all_gather_object(every, (built, loss.item(), grad_norm, parallel.param_bytes()))
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def large_step(tmp_path_factory: pytest.TempPathFactory) -> list[list[float]]:
    out = tmp_path_factory.mktemp("large") / "ranks.json"
    mp.start_processes(_train_one_step, args=(4, _free_port(), str(out)), nprocs=4,
                       start_method="spawn")  # fmt: skip
    return json.loads(out.read_text())


def test_a_model_is_built_in_shards_no_rank_holds_whole_and_trains_a_step_on_4_ranks(large_step):
    with torch.device("meta"):
        full_bytes = 4 * Transformer(LARGE).num_params(exclude_embedding=False)
    for built, loss, grad_norm, param_bytes in large_step:
        assert param_bytes <= full_bytes / 4 + 4 * LARGE.dim * 4  # its shards: norms round up
        # The old path added the whole model on every rank before sharding it.
        assert built < 0.5 * full_bytes, (built, full_bytes)
        assert torch.isfinite(torch.tensor(loss)) and grad_norm > 0
