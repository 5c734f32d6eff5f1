"""The embedded trainer: `torchrun --nproc-per-node N -m trainer --run-id ID ...`."""
