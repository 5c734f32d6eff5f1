"""telemetry: per-rank step records, events and resume points of training runs, stored in SQL.

The service (`telemetry.server`) writes what ranks report through `telemetry.client` into SQLite or
PostgreSQL via `telemetry.store`; the UI reads it back through `telemetry.queries`. The store is a
plain class so every rule (validation, idempotence, resume points) is testable without a network.
"""
