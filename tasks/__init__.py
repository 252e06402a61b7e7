"""Prefect tasks, one per pipeline step, each a thin wrapper over an engine call."""
