"""Coverage-guided fuzzing of ckptd's parsers with atheris (libFuzzer for Python).

    .venv/bin/python tests/fuzz/run.py TARGET [LIBFUZZER ARGS...] [CORPUS DIRS...]

TARGET is one of `fuzz_targets.TARGETS` (frames, manifest, catalog), or `every` for all three
(the first byte of an input picks one, as `make test` runs them). Everything after it goes to
libFuzzer: `-runs=N` or `-max_total_time=S` to stop, and corpus directories (the first one
receives the new inputs it finds). The campaign of the README:

    .venv/bin/python tests/fuzz/run.py frames -runs=1000000 -print_final_stats=1 \\
        /tmp/frames-corpus tests/fuzz/corpus/frames

A finding is written as `crash-<sha1>` in the current directory and the run stops with a
traceback; replay it with `run.py TARGET crash-<sha1>`. Copy inputs worth keeping (small, new
coverage) into tests/fuzz/corpus/TARGET, where `make test` replays them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).parent))

# Only the parsers are instrumented: coverage of the rest of ckptd (imported with them) would
# cost seconds at every start and guide nothing.
with atheris.instrument_imports(
    include=["ckptd.datapath", "ckptd.manifest", "ckptd.names", "fuzz_targets"]
):
    import fuzz_targets


def main() -> None:
    targets = {**fuzz_targets.TARGETS, "every": fuzz_targets.every}
    if len(sys.argv) < 2 or sys.argv[1] not in targets:
        sys.exit(f"usage: run.py {{{','.join(targets)}}} [libFuzzer args]")
    target = targets[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
