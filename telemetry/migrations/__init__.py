"""Alembic migrations of the telemetry schema; `telemetry.db.migrate` applies them."""
