"""scaletrain: checkpoints, telemetry and resume for large-model training, as one system.

This package holds what every part shares: the generated gRPC contracts (`scaletrain.v1`), the one
module that builds servers and channels (`scaletrain.rpc`), the domain errors, the embedded stack
and the `scaletrain` command line.
"""
