"""Named instants of the commit protocol at which a test can make ckptd die.

The crash tests start a real ckptd with CKPTD_CRASH_AT=<phase> (optionally `<phase>:<n>` for the
n-th time the phase is reached) and expect it to SIGKILL itself exactly there, so that every step
of the protocol is proven to leave no partial checkpoint visible. Unset, `crash_point` costs a
dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "CKPTD_CRASH_AT"

# Every phase, in protocol order (the tests iterate over this).
PHASES = (
    "file-staged",  # a file is received, written, fsynced and renamed into the save's staging
    "ssd-before-rename",  # every file and the SSD marker are fsynced; the dir is not in place
    "ssd-after-rename",  # the dir is in place, not yet fsynced in its parent, catalog not told
    "ssd-committed",  # the catalog says committed; the client has no answer yet
    "s3-part-uploaded",  # one part of a multipart upload is on S3
    "s3-files-uploaded",  # every file is on S3 and verified; no marker yet
    "s3-marker-written",  # the S3 marker exists; the catalog still says pending
    "s3-marker-deleted",  # a delete (retention or rm) removed an S3 marker, not yet the files
)

# The two-phase commit over several nodes (ckptd.cluster); reached only with peers.
CLUSTER_PHASES = (
    "cluster-prepared",  # a participant recorded its vote; the coordinator has no answer yet
    "cluster-voted",  # the coordinator has every vote and no decision (no marker) yet
    "cluster-decided",  # the coordinator's marker (the decision) is durable; no peer told yet
)

_lock = threading.Lock()
_seen: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return None
    phase, _, nth = spec.partition(":")
    return phase, int(nth or 1)


def crash_point(phase: str) -> None:
    """SIGKILL this process if CKPTD_CRASH_AT names `phase` (and this is its n-th arrival)."""
    target = _target()
    if target is None or target[0] != phase:
        return
    with _lock:
        _seen[phase] = _seen.get(phase, 0) + 1
        if _seen[phase] == target[1]:
            os.kill(os.getpid(), signal.SIGKILL)
