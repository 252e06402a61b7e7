"""Checkpoint formats, one folder per backend, each exporting its `Backend` record (listed in `formats.registry`).
Each finds its files without torch (`layout`) and indexes and reads its tensors behind the protocols of
`formats.base`; verl's run conventions, which they share, are in `formats.verl_run`."""
