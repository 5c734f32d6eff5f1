"""telemetry: per-rank step records, events and resume points of training runs, stored in SQL, and
what they say about the run's health.

The service (`telemetry.server`) writes what ranks report through `telemetry.client` (records sent
as `telemetry.columns`) into SQLite or PostgreSQL via `telemetry.store` and its bulk path
`telemetry.ingest`; `telemetry.live` follows the runs as records arrive, scoring stragglers
(`telemetry.detect`) and serving Prometheus metrics (`telemetry.metrics`). The UI and users read it
back through `telemetry.queries`, `telemetry.efficiency` (MFU, goodput; peaks in `telemetry.mfu`)
and `telemetry.health`. The store is a plain class so every rule (validation, idempotence, resume
points) is testable without a network.
"""
