"""Training health: the dense peak MFU divides by, silent-data-corruption and loss-spike detection
with step replay, and the faults that prove them (bit flips, stragglers, bad batches).

The loop in `trainer.train` and the step in `trainer.step` call into here from a few lines;
everything that decides lives here.
Straggler detection needs every rank's times, so it runs in the telemetry service on what arrives.
"""

from __future__ import annotations

# What the step guard may do with a suspicious step (see trainer.health.guard). This module imports
# no torch, so that trainer.options (which `scaletrain run` reads) can offer the same choices.
POLICIES = ("rollback", "skip", "alert", "off")
# What is done with a rank the corruption checks keep naming (trainer.health.quarantine).
QUARANTINE_POLICIES = ("cordon", "alert", "off")
