"""The application on top of every package: the `scaletrain` command (`cli`, one module a command
in `commands`), the embedded stack (`stack`, `seaweed`), `scaletrain run` (`embedded`) and its
summary (`summary`), the chaos drill (`chaos`), offline checkpoint commands (`checkpoints`) and
the planner (`plan`).

Nothing below it imports it: the base (`scaletrain.errors`, `.names`, `.security`, `.serving`,
`.transport`, `.guard`, `.throttle`, `.v1`) imports nothing of ours above itself, and trainer,
ckptd, telemetry and ui import only the base (the import-linter contracts in pyproject.toml, run
by tests/scaletrain/test_layers.py).
"""
