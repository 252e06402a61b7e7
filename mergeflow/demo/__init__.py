"""The demo's checkpoint writer: real verl-layout FSDP checkpoints saved by torch FSDP on CPU (the tests and
the bench use it too; the tests' other writers live in tests/writers)."""
