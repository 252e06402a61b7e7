"""The packages of the wheel: every package under mergeflow/ (a new backend's folder included, with nothing to list),
and the repo's tasks/, flows/ and deployments/ folders, which pyproject.toml maps into the mergeflow package."""

from setuptools import find_packages, setup

PIPELINE_FOLDERS = ("tasks", "flows", "deployments")

setup(packages=[*find_packages(include=["mergeflow", "mergeflow.*"]), *(f"mergeflow.{folder}" for folder in PIPELINE_FOLDERS)])
