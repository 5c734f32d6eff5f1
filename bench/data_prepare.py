"""How close `data prepare` and the shard reader come to the libraries they are built on.

Two ratios, each beside its baseline in the same process, interleaved run by run, best of a few:

1. **Prepare throughput ÷ the tokenizer's own `encode_batch`.** A corpus of the standard
   library's `.py` files (--mib of text) and a byte-level BPE trained on it once; then the whole
   `prepare` (find and hash the inputs, read them, encode in the tokenizer's thread pool, write
   and checksum the shards and the manifest) against one `encode_batch` call over the same
   documents already in memory, with the same cores (target >= 0.8).
2. **Window reads ÷ numpy memmap slicing.** Random packed windows through `PreparedData.window`
   (which maps a stream offset to its shard and crosses shard boundaries) against slicing one
   `np.memmap` of the same tokens in one file (target >= 0.8). Both copy each window out (what a
   loader does to make a batch), so the pages are really read.

Run: `.venv/bin/python bench/data_prepare.py [--mib 16] [--vocab 8192] [--runs 3]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
from ckptd_common import best_of, timed

from trainer.data.prepare import PrepareOptions, prepare
from trainer.data.shards import PreparedData
from trainer.data.tokenizer import load_tokenizer, train_bpe


def _corpus(root: Path, mib: int) -> Path:
    """Copies of stdlib sources up to `mib` MiB, as a directory of text files."""
    corpus = root / "corpus"
    corpus.mkdir()
    size, n = 0, 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if size >= mib << 20:
            break
        data = path.read_bytes()
        try:
            data.decode()
        except UnicodeDecodeError:
            continue
        (corpus / f"{n:05d}.txt").write_bytes(data)
        size, n = size + len(data), n + 1
    return corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--windows", type=int, default=20000)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    cores = os.cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = _corpus(root, args.mib)
        texts = [p.read_text() for p in sorted(corpus.iterdir())]
        tok_path = train_bpe(texts, args.vocab, root / "tok")
        tokenizer = load_tokenizer(str(tok_path), threads=cores or 1)
        out = root / "out"

        def run_prepare() -> None:
            shutil.rmtree(out, ignore_errors=True)
            prepare(PrepareOptions(inputs=[str(corpus)], out=out, tokenizer=str(tok_path),
                                   shard_tokens=1 << 20))  # fmt: skip

        def encode() -> None:
            tokenizer.encode_batch(texts)

        prep_s, encode_s = best_of(args.runs, lambda: timed(run_prepare), lambda: timed(encode))
        data = PreparedData(out)
        mb = sum(len(t.encode()) for t in texts) / 1e6
        print(f"corpus: {len(texts)} files, {mb:.1f} MB, {data.tokens:,} tokens, {cores} cores")
        print(f"encode_batch (baseline)  {data.tokens / encode_s:14,.0f} tokens/s")
        print(f"data prepare             {data.tokens / prep_s:14,.0f} tokens/s")
        print(f"prepare / encode_batch   {encode_s / prep_s:.2f}  (target >= 0.8)")

        flat = root / "flat.bin"
        data.read(0, data.tokens).tofile(flat)
        mm = np.memmap(flat, dtype=data.dtype, mode="r")
        seq = min(args.seq_len, data.tokens // 4)
        order = np.random.default_rng(0).permutation(data.windows(seq))[: args.windows]
        order = np.resize(order, args.windows)

        def ours() -> None:
            for w in order:
                np.array(data.window(int(w), seq))

        def baseline() -> None:
            for w in order:
                start = int(w) * seq
                np.array(mm[start : start + seq + 1])

        ours_s, base_s = best_of(args.runs, lambda: timed(ours), lambda: timed(baseline))
        print(f"memmap slicing (baseline) {args.windows / base_s:13,.0f} windows/s of {seq + 1}")
        print(f"PreparedData.window       {args.windows / ours_s:13,.0f} windows/s")
        print(f"window reads / memmap     {base_s / ours_s:.2f}  (target >= 0.8)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
