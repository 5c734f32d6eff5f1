"""Alembic revisions of the telemetry schema, oldest first by their down_revision chain."""
