"""The steps `merge` and `test` share, from the config to the plan: each a task run, in order."""

from mergeflow.job import CheckpointFound, MergeJob, MergeSteps
from mergeflow.tasks.extract_lora import extract_lora
from mergeflow.tasks.load_config import load_config
from mergeflow.tasks.load_shards import load_shards
from mergeflow.tasks.plan_merge import plan_merge


def prepare(job: MergeJob, checkpoint: CheckpointFound, *, replace: bool = False) -> MergeSteps:
    """Read the config and the shards' metadata, find the LoRA, and plan every tensor. Each step builds on the
    state the job keeps from the one before, so the order is what the steps pass (`wait_for`)."""
    config = load_config(job, wait_for=[checkpoint])
    shards = load_shards(job, wait_for=[config])
    lora = extract_lora(job, wait_for=[shards])
    plan = plan_merge(job, replace=replace, wait_for=[lora])
    return MergeSteps(config, shards, lora, plan)
