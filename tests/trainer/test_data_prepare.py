"""`data prepare` and the prepared-data reader, with the real `tokenizers`, `sentencepiece` and
`pyarrow`: reproducible shards, a continued prepare equal to an uninterrupted one, packing and
document boundaries, blends, and one-line errors for bad input."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece
import torch

from scaletrain.app.cli import main as cli_main
from scaletrain.errors import UserError
from trainer import options
from trainer.data.loader import (
    DeterministicLoader,
    check_same_data,
    open_source,
    source_identity,
)
from trainer.data.prepare import CRASH_ENV, MANIFEST, PrepareOptions, prepare
from trainer.data.shards import Blend, BlendPart, PreparedData, blend_table, parse_blend
from trainer.data.tokenizer import load_tokenizer
from trainer.model.llama import ModelArgs, Transformer, document_layout

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly oxen"


def _text(n: int, salt: int) -> str:
    words = WORDS.split()
    return " ".join(words[(i * 7 + salt) % len(words)] for i in range(n)) + f" doc {salt}."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of every input kind: text files, gzipped .jsonl and Parquet."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "books").mkdir()
    for i in range(6):
        (root / "books" / f"b{i}.txt").write_text(_text(150 + 40 * i, i))
    with gzip.open(root / "web.jsonl.gz", "wt") as f:
        for i in range(40):
            f.write(json.dumps({"text": _text(20 + i, 100 + i), "url": f"u{i}"}) + "\n")
    pq.write_table(pa.table({"content": [_text(30 + i, 200 + i) for i in range(30)]}),
                   root / "code.parquet")  # fmt: skip
    return root


def _prepare(corpus: Path, out: Path, **kw) -> dict:
    options = PrepareOptions(
        inputs=[str(corpus / "books"), str(corpus / "web.jsonl.gz")], out=out, **kw
    )
    return prepare(options)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_preparing_the_same_inputs_twice_gives_identical_bytes(corpus: Path, tmp_path: Path):
    kw = {"train_tokenizer": 400, "shard_tokens": 500}
    first = _prepare(corpus, tmp_path / "a", **kw)
    _prepare(corpus, tmp_path / "b", **kw)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert len(first["shards"]) > 2 and first["documents"] == 6 + 40
    assert first["dtype"] == "uint16" and 300 < first["tokenizer"]["vocab_size"] <= 400
    assert all(len(i["sha256"]) == 64 for i in first["inputs"])


def test_an_interrupted_prepare_continued_ends_equal_to_an_uninterrupted_one(
    corpus: Path, tmp_path: Path
):
    """The prepare is SIGKILLed after its second shard, then run again."""
    args = [str(corpus / "books"), str(corpus / "web.jsonl.gz"), "--train-tokenizer", "400",
            "--shard-tokens", "500"]  # fmt: skip
    cmd = [sys.executable, "-m", "scaletrain", "data", "prepare", *args]
    env = os.environ | {CRASH_ENV: "2"}
    killed = subprocess.run([*cmd, "--out", str(tmp_path / "cut")], env=env, capture_output=True)
    assert killed.returncode == -9, killed.stderr
    partial = json.loads((tmp_path / "cut" / MANIFEST).read_text())
    assert not partial["complete"] and len(partial["shards"]) == 2
    done = subprocess.run([*cmd, "--out", str(tmp_path / "cut")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert prepare_main([*args, "--out", str(tmp_path / "whole")]) == 0
    assert _files(tmp_path / "cut") == _files(tmp_path / "whole")


def prepare_main(argv: list[str]) -> int:
    return cli_main(["data", "prepare", *argv])


def _sentencepiece_model(path: Path, texts: list[str]) -> Path:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=60,
        model_type="bpe",
        eos_id=2,
        pad_id=3,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    return path


def test_every_tokenizer_kind_and_input_kind_prepares_and_reads_back(corpus: Path, tmp_path: Path):
    # Bytes over the whole directory (text, .jsonl.gz; the Parquet file has no "text" column,
    # so it is prepared on its own below).
    prepare(PrepareOptions(inputs=[str(corpus / "books"), str(corpus / "web.jsonl.gz")],
                           out=tmp_path / "bytes"))  # fmt: skip
    data = PreparedData(tmp_path / "bytes")
    first = data.read(0, int(data.document_ends[0]))
    assert first[-1] == data.eos_id == 256 and data.vocab_size == 257
    assert first[:-1].astype(np.uint8).tobytes() == (corpus / "books" / "b0.txt").read_bytes()
    # A SentencePiece model over the Parquet column.
    spm = _sentencepiece_model(tmp_path / "sp.model", [_text(40, i) for i in range(50)])
    prepare(PrepareOptions(inputs=[str(corpus / "code.parquet")], out=tmp_path / "spm",
                           tokenizer=str(spm), text_field="content"))  # fmt: skip
    data, tokenizer = PreparedData(tmp_path / "spm"), load_tokenizer(str(spm))
    assert (data.vocab_size, data.eos_id, data.pad_id) == (60, 2, 3)
    first = data.read(0, int(data.document_ends[0]))
    assert list(first) == [*tokenizer.encode_batch([_text(30, 200)])[0], 2]
    assert data.manifest["documents"] == 30


def test_packed_windows_cross_shards_and_the_document_mask_matches_the_index(
    corpus: Path, tmp_path: Path
):
    """Under --document-masking a query attends only to earlier tokens of its own document, and
    positions restart at each document: the mask the model reads off the EOS tokens is checked
    against a reference built from the prepared index (each document's end offset)."""
    _prepare(corpus, tmp_path / "p", train_tokenizer=400, shard_tokens=300)
    data = PreparedData(tmp_path / "p")
    stream = np.concatenate([np.fromfile(p, dtype=data.dtype)
                             for p in sorted((tmp_path / "p").glob("shard-*.bin"))])  # fmt: skip
    assert stream.size == data.tokens
    seq = 64
    windows = [data.window(w, seq) for w in range(data.windows(seq))]
    for w, window in enumerate(windows):
        assert np.array_equal(window, stream[w * seq : w * seq + seq + 1])
    inputs = torch.from_numpy(np.stack(windows)[:, :-1].astype(np.int64))
    positions, mask = document_layout(inputs, data.eos_id)
    for w in range(len(windows)):
        start = w * seq
        # The reference: token t's document is the number of document ends at or before it.
        doc = np.searchsorted(data.document_ends, np.arange(start, start + seq), side="right")
        first = {d: t for t, d in reversed(list(enumerate(doc)))}
        expected_mask = (doc[None, :] == doc[:, None]) & np.tri(seq, dtype=bool)
        assert np.array_equal(mask[w, 0].numpy(), expected_mask), f"window {w}"
        assert positions[w].tolist() == [t - first[d] for t, d in enumerate(doc)], f"window {w}"
    assert data.windows(seq) == (stream.size - 1) // seq
    assert (positions == 0).sum() > len(windows), "the windows hold no document boundary"


def test_a_masked_document_is_computed_as_if_it_stood_alone(corpus: Path, tmp_path: Path):
    """The logits of a document packed after others equal those of the document fed alone from
    position 0: nothing packed before it reaches it."""
    _prepare(corpus, tmp_path / "p", train_tokenizer=400)
    data = PreparedData(tmp_path / "p")
    ends = data.document_ends
    begin, end = int(ends[2]), int(ends[3])  # the fourth document, after three others
    packed = torch.from_numpy(data.read(int(ends[0]) - 5, end - int(ends[0]) + 5).astype(np.int64))
    alone = torch.from_numpy(data.read(begin, end - begin).astype(np.int64))
    model = Transformer(ModelArgs(vocab_size=data.vocab_size, max_seq_len=512))
    model.init_weights(7)
    with torch.no_grad():
        plain = model(alone[None])
        model.document_eos = data.eos_id
        masked = model(packed[None])
        # Other documents before it: every token changed, the document ends kept where they are.
        before = packed[: -len(alone)]
        changed_before = (before + 1) % data.vocab_size
        changed_before[changed_before == data.eos_id] = (data.eos_id + 1) % data.vocab_size
        changed_before[before == data.eos_id] = data.eos_id
        changed = model(torch.cat([changed_before, alone])[None])
    assert torch.allclose(masked[0, -len(alone) :], plain[0], atol=1e-5)
    assert torch.allclose(changed[0, -len(alone) :], plain[0], atol=1e-5)
    assert not torch.allclose(masked[0, : -len(alone)], changed[0, : -len(alone)], atol=1e-3)


def test_a_blend_draws_each_source_in_proportion_and_each_of_its_samples_once():
    weights = [0.7, 0.2, 0.1]
    table = blend_table(weights)
    assert list(np.bincount(table)) == [700, 200, 100]
    # Any prefix of the period stays within one sample of the weights.
    counts = np.zeros(3)
    for n, source in enumerate(table, 1):
        counts[source] += 1
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1.0), n
    odd = blend_table([1.0, 2.0, 4.0])
    assert list(np.bincount(odd)) == [143, 286, 571]


def test_blend_samples_of_each_source_are_consecutive(corpus: Path, tmp_path: Path):
    for name in ("x", "y"):
        _prepare(corpus, tmp_path / name, shard_tokens=4000)
    blend = Blend([BlendPart(tmp_path / "x", 3), BlendPart(tmp_path / "y", 1)])
    located = [blend.locate(i) for i in range(5000)]
    for source in (0, 1):
        mine = [j for s, j in located if s == source]
        assert mine == list(range(len(mine)))
    assert sum(1 for s, _ in located if s == 0) == 3750


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("a:0.5,b:x", "--data a:0.5,b:x: weight 'x' of b is not a number"),
        ("a:0.5,b:0", "--data a:0.5,b:0: weight 0 of b must be positive"),
        ("a:-1", "--data a:-1: weight -1 of a must be positive"),
    ],
)
def test_a_blend_whose_weights_are_not_positive_numbers_is_refused(spec: str, message: str):
    with pytest.raises(UserError) as err:
        parse_blend(spec)
    assert str(err.value) == message


def test_bad_inputs_are_named_in_one_line_and_nothing_prepared_is_lost(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text \xff\xfe more")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "nothing.txt").write_text("")
    parquet = str(corpus / "code.parquet")
    out = str(tmp_path / "out")
    cases = [
        ([str(tmp_path / "missing.txt")], f"{tmp_path}/missing.txt: no such file or directory"),
        ([parquet], f"{parquet}: no column 'text' (it has content; choose one with --field)"),
        ([str(bad)], f"{bad}: invalid UTF-8 at byte 10; pass --utf8-errors replace to replace "
                     "invalid bytes with U+FFFD"),
        ([str(empty)], f"{empty}: the corpus holds no text"),
        ([str(corpus), "--tokenizer", str(tmp_path / "nope.json")],
         f"--tokenizer {tmp_path}/nope.json: no such file (give a tokenizer.json, a "
         "SentencePiece .model or `bytes`)"),
    ]  # fmt: skip
    for args, message in cases:
        assert prepare_main([*args, "--out", out]) == 1
        assert capsys.readouterr().err.strip() == f"scaletrain data: error: {message}"
    # Invalid UTF-8 replaced on request.
    assert prepare_main([str(bad), "--out", out, "--utf8-errors", "replace"]) == 0
    assert "\ufffd" in PreparedData(Path(out)).read(0, 22)[:-1].astype(np.uint8).tobytes().decode()
    before = _files(Path(out))
    # Another prepare into the same directory is refused and leaves it as it was.
    assert prepare_main([str(corpus / "books"), "--out", out]) == 1
    assert "holds a prepare of other inputs or another tokenizer" in capsys.readouterr().err
    assert _files(Path(out)) == before


def test_a_damaged_shard_and_an_older_format_are_refused_when_read(corpus: Path, tmp_path: Path):
    out = tmp_path / "d"
    _prepare(corpus, out, shard_tokens=3000)
    shard = out / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"shard-00001.bin: fails its checksum"):
        PreparedData(out)
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps(manifest | {"format": 0}))
    with pytest.raises(UserError, match=r"format 0, this scaletrain reads format 1; prepare"):
        PreparedData(out)
    with pytest.raises(UserError, match=r"prepared with format 0, this scaletrain writes"):
        _prepare(corpus, out, shard_tokens=3000)


def test_a_dataset_smaller_than_one_global_batch_is_refused(corpus: Path, tmp_path: Path):
    prepare(PrepareOptions(inputs=[str(corpus / "books" / "b0.txt")], out=tmp_path / "s"))
    data = PreparedData(tmp_path / "s")
    with pytest.raises(UserError, match=r"fewer than one global batch of 4096"):
        data.check_fits(seq_len=64, global_batch=4096)
    data.check_fits(seq_len=64, global_batch=2)


def _global_batches(source, dp_size: int, steps: int, start: int = 0) -> list[torch.Tensor]:
    """The global batches of `steps` steps from sample `start`, as dp_size ranks read them."""
    loaders = [DeterministicLoader(source, 16, 8, r, dp_size, seed=11) for r in range(dp_size)]
    for loader in loaders:
        loader.load_state_dict({"global_sample": start})
    return [torch.cat([loader.next_batch()[0] for loader in loaders]) for _ in range(steps)]


def test_a_run_saved_at_dp4_and_resumed_at_dp2_reads_the_same_samples_of_a_blend(
    corpus: Path, tmp_path: Path
):
    for name, inputs in (("books", [corpus / "books"]), ("web", [corpus / "web.jsonl.gz"])):
        prepare(PrepareOptions(inputs=[str(p) for p in inputs], out=tmp_path / name))
    for source in (
        PreparedData(tmp_path / "books"),
        Blend(parse_blend(f"{tmp_path / 'books'}:0.7,{tmp_path / 'web'}:0.3")),
    ):
        whole = _global_batches(source, 4, 6)
        resumed = _global_batches(source, 4, 3) + _global_batches(source, 2, 3, start=3 * 8)
        assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))
        digests = {hashlib.sha256(b.numpy().tobytes()).hexdigest() for b in whole}
        assert len(digests) == 6  # six different batches, not one repeated


def test_a_blend_feeds_the_loader_each_source_in_its_weight(corpus: Path, tmp_path: Path):
    """Samples are told apart by their tokens: one source holds bytes below 128 only, the
    other's documents are all made of a byte above it."""
    low, high = tmp_path / "low.txt", tmp_path / "high.txt"
    low.write_text("plain ascii words " * 400)
    high.write_bytes("é".encode() * 4000)
    for path in (low, high):
        prepare(PrepareOptions(inputs=[str(path)], out=tmp_path / path.stem))
    blend = Blend(parse_blend(f"{tmp_path / 'low'}:0.75,{tmp_path / 'high'}:0.25"))
    loader = DeterministicLoader(blend, 16, 8, 0, 1, seed=3)
    highs = sum(int((loader.sample_tokens(i) > 127).all()) for i in range(4000))
    assert highs == 1000


def test_a_resume_on_other_data_or_another_tokenizer_is_refused_naming_both(
    corpus: Path, tmp_path: Path
):
    books, web = tmp_path / "books", tmp_path / "web"
    prepare(PrepareOptions(inputs=[str(corpus / "books")], out=books))
    prepare(PrepareOptions(inputs=[str(corpus / "web.jsonl.gz")], out=web))
    one, blend = open_source(str(books), 0), open_source(f"{books}:0.7,{web}:0.3", 0)
    assert isinstance(one, PreparedData) and isinstance(blend, Blend)
    assert one.vocab_size == blend.sources[0].vocab_size == 257
    check_same_data(source_identity(one), source_identity(open_source(str(books), 0)))
    for other in (web, f"{books}:0.6,{web}:0.4"):
        with pytest.raises(UserError) as err:
            check_same_data(source_identity(one), source_identity(open_source(str(other), 0)))
        message = str(err.value)
        assert message.startswith("--resume: the checkpoint was trained on prepared data ")
        assert one.sha256[:12] in message and message.endswith("resume with the same --data")


def test_the_model_takes_its_vocabulary_from_the_datas_tokenizer(corpus: Path, tmp_path: Path):
    out = tmp_path / "v"
    _prepare(corpus, out, train_tokenizer=400)
    vocab = PreparedData(out).vocab_size
    assert options.resolve({"data": str(out)})["vocab_size"] == vocab
    assert options.resolve({"data": str(out), "vocab_size": 512})["vocab_size"] == 512  # padded
    with pytest.raises(ValueError) as err:
        options.resolve({"data": str(out), "vocab_size": 256})
    assert str(err.value) == (
        f"--vocab-size 256 is smaller than the vocabulary {vocab:,} of the tokenizer of --data "
        f"{out}; leave --vocab-size out to take the tokenizer's"
    )
