"""The sections of a run's health page, one concern each; each draws itself from a read-only
engine and a run id, and explains what to do when it has nothing to show."""
