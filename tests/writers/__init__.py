"""Fixture writers of the tests: checkpoints saved by the real writers (megatron-core, mbridge) on CPU."""
