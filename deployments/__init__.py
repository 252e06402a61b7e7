"""Prefect deployments of the flows: serve/deploy definitions, triggers and schedules."""
