"""The `scaletrain` commands, one module a command (or a pair that belongs together), each with
`register(sub)` adding its parser(s), flags and handler to the top parser's subcommands
(scaletrain.app.cli calls them in the order `scaletrain --help` lists them):

    run          the embedded stack and a training job, then a summary
    rendezvous   a training job's c10d rendezvous store
    chaos        the same as run under a schedule of injected faults, then a report
    plan         a job's parameters, memory per rank, FLOPs, bubble and MFU, no GPU
    ckptd        the checkpoint daemon
    telemetry    the telemetry service, a run's curves as TensorBoard files, a run's health
    ui           the run-health UI
    data         corpora as token shards
    ckpt         list, show, verify, export and remove checkpoints
    credentials  certs (a development CA and certificates) and token (mint a token)

Shared by several: `common` (the parser class, --workdir, --allow-plaintext, the work directory's
telemetry database, the summary's badput and tier lines) and `launch` (what run, chaos and plan
take of the trainer's options, --nodes and the job they resolve to). A command's module imports
those, never another command's (an import-linter contract in pyproject.toml).

Each imports only what its flags need at the top; what its handler needs (torch, gRPC servers,
the database) it imports inside the handler, so that `scaletrain --help` stays fast.
"""
