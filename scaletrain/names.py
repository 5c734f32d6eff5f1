"""Names every service agrees on: the checkpoint tiers, and the rule a run id follows.

A base module (it imports only the generated contracts, `scaletrain.errors` and the standard
library), so that ckptd, telemetry, the trainer and the command line all take these from one place
without importing one another. A tier named one way in ckptd's logs and another in telemetry's
rows, or a run id the trainer accepts and ckptd refuses at the first save, is what it prevents.
"""

from __future__ import annotations

import re

from scaletrain.errors import InvalidArgument
from scaletrain.v1 import common_pb2

# The casing rule: a tier named by an acronym keeps it in capitals, one named by a word is in
# lower case. Every tier of the contract (common_pb2.Tier) is named, so a new one needs no entry.
_ACRONYMS = frozenset({"SSD", "S3"})


def _label(proto_name: str) -> str:
    name = proto_name.removeprefix("TIER_")
    return name if name in _ACRONYMS else name.lower()


# A tier as people read it in ckptd's log lines, errors and Prometheus labels: memory, SSD, S3.
TIER_LABELS: dict[int, str] = {
    value: _label(name)
    for name, value in common_pb2.Tier.items()
    if value != common_pb2.TIER_UNSPECIFIED
}
# The same names in lower case, as identifiers: what telemetry stores, and what the command line,
# its JSON and the UI print (memory, ssd, s3).
TIER_NAMES: dict[int, str] = {tier: label.lower() for tier, label in TIER_LABELS.items()}

# A run id becomes a directory on SSD, an S3 key segment, a telemetry key (128 characters at most)
# and a label: one short token that cannot escape a path, start like a flag, or need quoting.
RUN_ID_RULE = "1-128 letters, digits and . _ : + = @ -, starting with a letter or digit"
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+=@-]{0,127}")


def check_run_id(value: str, what: str = "run id") -> str:
    """`value` when it follows the run-id rule, else InvalidArgument in one line naming the rule.

    `what` is how the caller's interface names the field ("run_id" in telemetry's messages, "run
    name" in ckptd's, the flag in the trainer's), so every service refuses the same ids with the
    same words after it.
    """
    if not value:
        raise InvalidArgument(f"{what} is empty")
    if not _RUN_ID.fullmatch(value):
        shown = repr(value) if len(value) <= 128 else f"{value[:128]!r}..."
        raise InvalidArgument(f"{what} {shown} is invalid: use {RUN_ID_RULE}")
    return value
