"""The layers hold: scaletrain's base below every package, scaletrain.app above them all.

`lint-imports` checks the import-linter contracts in pyproject.toml (README, "Layout") over the
whole import graph, indirect imports included.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The console script installed beside this interpreter (the project's virtual environment).
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_no_import_crosses_a_layer() -> None:
    result = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        'an import crosses a layer (README, "Layout"; contracts in pyproject.toml): the base '
        "(scaletrain but scaletrain.app) imports nothing of ours above it, no package imports "
        "scaletrain.app, and telemetry < ckptd < trainer | ui. Move the code to the layer it "
        "belongs to, or pass what it needs in from above.\n" + result.stdout + result.stderr
    )


def test_every_base_module_is_under_the_base_contract() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    base = next(c for c in contracts["contracts"] if c["id"] == "base")
    package = ROOT / "scaletrain"
    modules = {p.stem for p in package.glob("*.py")}
    modules |= {p.parent.name for p in package.glob("*/__init__.py")}
    found = {f"scaletrain.{name}" for name in modules - {"__init__", "__main__", "app"}}
    missing = sorted(found - set(base["source_modules"]))
    assert not missing, (
        f"{', '.join(missing)}: a module of scaletrain's base that the layer check does not "
        "cover; add it to source_modules of the 'base' contract in pyproject.toml (or move it "
        "into scaletrain/app/ if it imports the packages)"
    )
