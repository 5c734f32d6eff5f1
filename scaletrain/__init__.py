"""scaletrain: checkpoints, telemetry and resume for large-model training, as one system.

This package is two layers. Its modules are the base every part shares: the generated gRPC
contracts (`scaletrain.v1`), the one module that builds servers and channels
(`scaletrain.transport`), the guard in front of every service (`scaletrain.guard`), the one serve
loop (`scaletrain.serving`), the names every service agrees on (`scaletrain.names`), credentials
(`scaletrain.security`) and the domain errors. `scaletrain.app` is the application on top of every
package: the `scaletrain` command line, the embedded stack, the chaos drill.
"""
