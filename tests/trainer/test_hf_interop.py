"""Hugging Face weights in and out, proven with the real `transformers` library: a checkpoint in a
real ckptd (over loopback gRPC) exported with `scaletrain ckpt export --format hf` loads as a
`LlamaForCausalLM` with our logits; HF weights imported into any parallel layout (real gloo ranks)
and exported again are bitwise equal and give the HF model's first-step loss; bad input gets one
line and leaves nothing behind.

The HF models are tiny configs built here: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ckptd.config import CkptdConfig
from ckptd.dcp import CkptdStorageWriter
from ckptd.server import RunningCkptd, start
from scaletrain.app import checkpoints, cli
from scaletrain.errors import UserError
from trainer import options
from trainer.config import TrainConfig, from_values
from trainer.data.corpus import stdlib_corpus
from trainer.data.loader import DeterministicLoader
from trainer.data.prepare import PrepareOptions, prepare
from trainer.interop.hf import read_hf_model
from trainer.interop.hf_import import check_init, load_hf_weights
from trainer.model.llama import Transformer, next_token_loss, rope_frequencies
from trainer.parallel.probe import CORPUS_BYTES, launch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHAPE = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "multiple_of": 32,
    "rope_theta": 500_000.0,
}
HF_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 192, "vocab_size": 256,
            "rope_theta": 500_000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024,
            "tie_word_embeddings": False}  # fmt: skip


def job(**values: options.Value) -> dict[str, options.Value]:
    return options.resolve({"run_id": "r", **SHAPE, **values})


def hf_llama(directory: Path, seed: int = 0, **config: object) -> LlamaForCausalLM:
    """A tiny random LlamaForCausalLM saved as safetensors in `directory`."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(HF_SHAPE | config))).eval()
    model.save_pretrained(directory)
    return model


def trained(cfg: TrainConfig, steps: int = 3) -> Transformer:
    """Our model after a few AdamW steps on random tokens."""
    torch.manual_seed(1)
    model = Transformer(cfg.model)
    model.init_weights(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 17))
        next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def save_to_ckptd(address: str, run: str, step: int, model: Transformer, values: dict) -> None:
    """The model and the job config as the trainer's checkpoints keep them, in ckptd."""
    state = {"model": model.state_dict(), "train": {"config": options.to_toml(values)}}
    writer = CkptdStorageWriter(address, run, step)
    try:
        dcp.save(state, storage_writer=writer, no_dist=True)
    finally:
        writer.close()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path / "work"


@pytest.fixture
def ckptd(workdir: Path) -> Iterator[RunningCkptd]:
    """A real ckptd on loopback, its data dir where `--workdir` looks for it."""
    running = start(CkptdConfig(data_dir=workdir / "ckptd", memory_budget_bytes=64 << 20))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset with a byte-level BPE of 300 tokens trained on its text."""
    text = tmp_path_factory.mktemp("text") / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path_factory.mktemp("prepared")
    prepare(PrepareOptions(inputs=[str(text)], out=out, train_tokenizer=300))
    return out


def test_a_model_trained_a_few_steps_exported_from_ckptd_gives_our_logits_in_transformers(
    ckptd: RunningCkptd, workdir: Path, prepared: Path, tmp_path: Path
) -> None:
    values = job(data=str(prepared))
    model = trained(from_values(values))
    save_to_ckptd(ckptd.address, "run", 3, model, values)
    dest = tmp_path / "hf"
    exported = checkpoints.export_hf(
        workdir, ckptd.address, "run", 3, dest, max_shard_bytes=100_000
    )
    assert len(exported.shards) > 1 and (dest / "model.safetensors.index.json").exists()

    hf = LlamaForCausalLM.from_pretrained(dest).eval()
    tokens = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(dest)
    ids = tokenizer("the lazy fox", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "the lazy fox"
    assert hf.config.eos_token_id == json.loads((prepared / "manifest.json").read_text())[
        "tokenizer"]["eos_id"]  # fmt: skip


def test_the_export_reads_the_ssd_tier_offline_with_the_same_result(
    ckptd: RunningCkptd, workdir: Path, tmp_path: Path
) -> None:
    values = job()
    save_to_ckptd(ckptd.address, "run", 1, trained(from_values(values), steps=1), values)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an export warns of nothing
        checkpoints.export_hf(workdir, ckptd.address, "run", 1, tmp_path / "from-memory")
    # Made with the user's umask, as any directory (not mkdtemp's 0700).
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "from-memory").stat().st_mode & 0o777 == 0o777 & ~umask
    ckptd.stop()
    checkpoints.export_hf(workdir, None, "run", 1, tmp_path / "from-ssd")
    memory = load_file(tmp_path / "from-memory" / "model-00001-of-00001.safetensors")
    ssd = load_file(tmp_path / "from-ssd" / "model-00001-of-00001.safetensors")
    assert memory.keys() == ssd.keys() and all(torch.equal(memory[k], ssd[k]) for k in memory)


def test_hf_weights_imported_then_exported_are_bitwise_equal(
    ckptd: RunningCkptd, workdir: Path, tmp_path: Path
) -> None:
    hf_llama(tmp_path / "source")
    values = job()
    cfg = from_values(values)
    model = Transformer(cfg.model)
    model.init_weights(7)
    load_hf_weights(model, tmp_path / "source", cfg.model)
    save_to_ckptd(ckptd.address, "imported", 0, model, values)
    checkpoints.export_hf(workdir, ckptd.address, "imported", 0, tmp_path / "again")
    source = load_file(tmp_path / "source" / "model.safetensors")
    again = load_file(tmp_path / "again" / "model-00001-of-00001.safetensors")
    assert source.keys() == again.keys() and all(torch.equal(source[k], again[k]) for k in source)


# Llama 3.1's rotary scaling, on a pretraining length short enough that the tiny model's
# frequencies fall in all three bands (kept, ramped, divided).
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip


def test_a_llama_3_1_with_scaled_rope_imports_with_its_own_frequencies_and_logits(
    tmp_path: Path,
) -> None:
    hf = hf_llama(tmp_path, rope_scaling=LLAMA31_ROPE)
    shape = read_hf_model(tmp_path).options
    assert (shape["rope_scaling"], shape["rope_original_max_len"]) == (8.0, 16)
    cfg = from_values(job(**shape))
    model = Transformer(cfg.model)
    model.init_weights(7)
    load_hf_weights(model, tmp_path, cfg.model)
    # The very frequencies transformers computes, bit for bit.
    assert torch.equal(rope_frequencies(cfg.model), hf.model.rotary_emb.inv_freq)
    tokens = torch.randint(0, 256, (2, 40))  # past the original 16 positions
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_a_llama_3_2_with_tied_embeddings_loads_with_its_logits_and_exports_untied(
    ckptd: RunningCkptd, workdir: Path, tmp_path: Path
) -> None:
    hf = hf_llama(tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")
    values = job(**read_hf_model(tmp_path / "tied").options)
    cfg = from_values(values)
    model = Transformer(cfg.model)
    model.init_weights(7)
    load_hf_weights(model, tmp_path / "tied", cfg.model)
    # The output starts as the embedding (then trains on its own: our model is untied).
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    save_to_ckptd(ckptd.address, "tied", 0, model, values)
    checkpoints.export_hf(workdir, ckptd.address, "tied", 0, tmp_path / "again")
    again = LlamaForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert again.config.tie_word_embeddings is False
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_a_model_with_scaled_rope_exports_what_transformers_reads_back(
    ckptd: RunningCkptd, workdir: Path, tmp_path: Path
) -> None:
    values = job(rope_scaling=8.0, rope_original_max_len=16)
    model = trained(from_values(values), steps=1)
    save_to_ckptd(ckptd.address, "run", 1, model, values)
    checkpoints.export_hf(workdir, ckptd.address, "run", 1, tmp_path / "hf")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    tokens = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
    # And back: the exported directory maps to the same options.
    assert read_hf_model(tmp_path / "hf").options["rope_scaling"] == 8.0


def test_an_export_into_a_non_empty_directory_is_refused_unless_overwrite(
    ckptd: RunningCkptd, workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = job()
    save_to_ckptd(ckptd.address, "run", 1, trained(from_values(values), steps=1), values)
    dest = tmp_path / "taken"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep me")
    argv = ["ckpt", "export", "--format", "hf", "--ckptd", ckptd.address, "run", "1", str(dest)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty (--overwrite replaces it)" in err
    assert [p.name for p in dest.iterdir()] == ["mine.txt"]
    assert cli.main([*argv, "--overwrite"]) == 0
    assert sorted(p.name for p in dest.iterdir()) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".taken")]


def test_an_export_whose_tokenizer_is_missing_is_refused_and_writes_nothing(
    ckptd: RunningCkptd, workdir: Path, tmp_path: Path, prepared: Path
) -> None:
    gone = tmp_path / "gone"
    values = job(data=str(prepared)) | {"data": str(gone)}
    save_to_ckptd(ckptd.address, "run", 1, trained(from_values(values), steps=1), values)
    with pytest.raises(UserError, match=f"the run's tokenizer is missing: {gone}: not a prepared"):
        checkpoints.export_hf(workdir, ckptd.address, "run", 1, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))


def test_an_moe_checkpoint_is_refused_naming_what_differs_from_mixtral(
    ckptd: RunningCkptd, workdir: Path, tmp_path: Path
) -> None:
    values = job(n_experts=4, shared_experts=1)
    model = Transformer(from_values(values).model)
    model.init_weights(1)
    save_to_ckptd(ckptd.address, "moe", 1, model, values)
    with pytest.raises(UserError, match=r"MixtralForCausalLM, differs in 1 shared expert\(s\)"):
        checkpoints.export_hf(workdir, ckptd.address, "moe", 1, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def _mixed_dtypes(directory: Path) -> None:
    weights = load_file(directory / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"].bfloat16()
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


def _edit_config(**changes: object) -> object:
    def edit(directory: Path) -> None:
        path = directory / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | changes))

    return edit


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), "no config.json (not a Hugging Face model"),
        (
            _edit_config(architectures=["MistralForCausalLM"]),
            "architecture MistralForCausalLM cannot be mapped; this trainer's model is a "
            "LlamaForCausalLM",
        ),
        (
            _edit_config(rope_scaling={"rope_type": "linear", "factor": 2.0}),
            'rope_type = "linear" cannot be mapped; this trainer\'s Llama has rope_type = '
            '"default"',
        ),
        (
            _edit_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
            'rope_type = "yarn" cannot be mapped; this trainer\'s Llama has rope_type = "default"',
        ),
        (_mixed_dtypes, "the weights mix dtypes (bfloat16, float32); expected one"),
        (
            _edit_config(torch_dtype="bfloat16", dtype="bfloat16"),
            "config.json says torch_dtype bfloat16, the weights are float32",
        ),
    ],
    ids=[
        "no-config",
        "architecture",
        "rope-scaling",
        "rope-type",
        "mixed-dtypes",
        "declared-dtype",
    ],
)
def test_a_bad_hf_directory_is_refused_in_one_line_naming_the_problem(
    tmp_path: Path, damage: object, message: str
) -> None:
    hf_llama(tmp_path)
    damage(tmp_path)  # type: ignore[operator]
    with pytest.raises(UserError) as refused:
        read_hf_model(tmp_path)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("ours", "message"),
    [
        (
            {"vocab_size": 512},
            "model.embed_tokens.weight is 256x64, this run's "
            "tok_embeddings.weight is 512x64; set --vocab-size 256 --dim 64",
        ),
        (
            {"multiple_of": 256},
            "model.layers.0.mlp.gate_proj.weight is 192x64, this run's "
            "layers.0.feed_forward.w1.weight is 256x64; set --dim 64 --multiple-of 192 "
            "--ffn-dim-multiplier 0",
        ),
        ({"n_layers": 3}, "the HF model has 2 layers, this run's model 3; set --n-layers 2"),
        (
            {"n_kv_heads": 4},
            "model.layers.0.self_attn.k_proj.weight is 32x64, this run's "
            "layers.0.attention.wk.weight is 64x64; set --dim 64 --n-heads 4 --n-kv-heads 2",
        ),
        (
            {"rope_theta": 10_000.0},
            "its rope-theta is 500000, this run's 10000; set --rope-theta 500000",
        ),
    ],
    ids=["vocab", "ffn", "layers", "kv-heads", "rope-theta"],
)
def test_a_shape_mismatch_is_refused_naming_the_tensor_both_shapes_and_the_fixing_option(
    tmp_path: Path, ours: dict[str, options.Value], message: str
) -> None:
    hf_llama(tmp_path)
    with pytest.raises(UserError) as refused:
        check_init(tmp_path, from_values(job(**ours)).model)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_scaletrain_run_refuses_a_mismatched_hf_directory_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf_llama(tmp_path / "hf")
    argv = ["run", "--workdir", str(tmp_path / "work"), "--init-from-hf", str(tmp_path / "hf"),
            "--dim", "64", "--n-layers", "2", "--vocab-size", "512"]  # fmt: skip
    capsys.readouterr()
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and (
            f"--vocab-size 512 contradicts --init-from-hf {tmp_path / 'hf'}, whose config.json "
            "gives 256; leave --vocab-size out to take the model's"
        )
        in err
    )
    assert not (tmp_path / "work").exists()


def test_a_run_from_hf_weights_takes_the_models_shape_from_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf_llama(tmp_path / "hf", vocab_size=2048)
    # The same values given again are no contradiction.
    argv = ["run", "--init-from-hf", str(tmp_path / "hf"), "--dim", "64", "--print-config"]
    capsys.readouterr()
    assert cli.main(argv) == 0
    model = tomllib.loads(capsys.readouterr().out)["model"]
    assert (model["dim"], model["n_layers"], model["n_heads"], model["n_kv_heads"]) == (64, 2, 4, 2)
    assert model["vocab_size"] == 2048 and model["rope_theta"] == 500_000.0
    assert model["norm_eps"] == 1e-5
    # And plan measures that model, not the preset's.
    assert cli.main(["plan", "--ranks", "1", "--init-from-hf", str(tmp_path / "hf")]) == 0
    assert f"embedding {2048 * 64:,}" in capsys.readouterr().out


def hf_first_loss(directory: Path, seq_len: int, global_batch: int, seed: int = 1234) -> float:
    """The HF model's loss on the first global batch the trainer reads from the built-in corpus."""
    hf = LlamaForCausalLM.from_pretrained(directory).eval()
    loader = DeterministicLoader(stdlib_corpus(CORPUS_BYTES), seq_len, global_batch, 0, 1,
                                 seed=seed)  # fmt: skip
    inputs, targets = loader.next_batch()
    with torch.no_grad():
        return F.cross_entropy(hf(inputs).logits.flatten(0, 1), targets.flatten()).item()


def test_hf_weights_load_into_every_layout_bit_for_bit_with_the_hf_models_first_step_loss(
    tmp_path: Path,
) -> None:
    """FSDP over 4 ranks, FSDP x TP (strided shards), and pipeline stages x FSDP, one job; the
    HF model's embeddings tied (Llama 3.2), so the output is read from the embedding in each
    layout's own shards (on the pipeline's last stage only)."""
    hf_llama(tmp_path / "hf", tie_word_embeddings=True)
    model = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256,
             "ffn_multiple_of": 32, "rope_theta": 500_000.0}  # fmt: skip
    common = {
        "model": model,
        "seq_len": 32,
        "global_batch": 8,
        "init_from_hf": str(tmp_path / "hf"),
    }
    layouts = [
        {"name": "dp4", **common},
        {"name": "dp2.tp2", "parallel": {"tp": 2}, **common},
        {"name": "pp2.dp2", "parallel": {"pp": 2, "pp_schedule": "GPipe"}, **common},
    ]
    results = launch(4, layouts, steps=1)
    cfg = from_values(job())
    whole = Transformer(cfg.model)
    load_hf_weights(whole, tmp_path / "hf", cfg.model)
    expected = hf_first_loss(tmp_path / "hf", 32, 8)
    for name, result in results.items():
        state = result["initial_state"]
        assert all(torch.equal(state[k], v) for k, v in whole.state_dict().items()), name
        assert result["losses"][0] == pytest.approx(expected, rel=2e-5), name
    # The 4-rank layout's gathered weights, saved and exported, are the HF files bit for bit.
    dcp.save({"model": results["dp2.tp2"]["initial_state"],
              "train": {"config": options.to_toml(job())}},
             checkpoint_id=tmp_path / "dcp", no_dist=True)  # fmt: skip
    from trainer.interop.hf_export import export_hf

    (tmp_path / "out").mkdir()
    export_hf(dcp.FileSystemReader(tmp_path / "dcp"), tmp_path / "out")
    source = load_file(tmp_path / "hf" / "model.safetensors")
    again = load_file(tmp_path / "out" / "model-00001-of-00001.safetensors")
    assert all(torch.equal(source[k], again[k]) for k in source)
    assert torch.equal(again["lm_head.weight"], source["model.embed_tokens.weight"])


def test_a_trainer_run_initialised_from_hf_logs_the_hf_models_first_step_loss(
    tmp_path: Path,
) -> None:
    hf_llama(tmp_path / "hf", seed=3)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "trainer",
            "--run-id",
            "ft",
            "--steps",
            "1",
            "--log-every",
            "1",
            "--seq-len",
            "32",
            "--global-batch",
            "4",
            "--tp",
            "2",
            "--corpus-bytes",
            str(CORPUS_BYTES),
            "--init-from-hf",
            str(tmp_path / "hf"),
            *options.to_argv(SHAPE),
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    logged = float(re.search(r"\[trainer\] step 1 loss (\S+)", proc.stdout).group(1))
    assert logged == pytest.approx(hf_first_loss(tmp_path / "hf", 32, 4), abs=1e-4)
