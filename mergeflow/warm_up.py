"""Prepare a merge on a background thread while the pipeline starts (a temporary Prefect server takes
seconds to come up, with the CPU and the disk idle).

The warm-up starts reading the checkpoint's files ahead (on until the pipeline's own read-ahead ends)
and builds the model spec into the spec cache in a child process (`mergeflow.spec_build`, off this
process's GIL), so the pipeline's config step finds the spec ready (or waits for the build already
under way instead of starting a second one). This module imports no torch, so the warm-up can start
before the pipeline's imports, which take seconds. It changes nothing the merge writes: any problem it
meets is left for the pipeline to report, with its context.
"""

import threading
from pathlib import Path

from mergeflow.formats.fsdp.layout import default_config_dir, find_rank_files
from mergeflow.formats.megatron.layout import find_megatron_checkpoint
from mergeflow.perf.read_ahead import start_read_ahead
from mergeflow.spec.build import SpecBuild


def start_warm_up(
    local_dir: str,
    backend: str = "fsdp",
    hf_model_config_path: str | None = None,
    *,
    trust_remote_code: bool = False,
    is_value_model: bool = False,
) -> threading.Thread:
    """Start warming up the merge of `local_dir` (a daemon thread: it never keeps the process alive)."""
    thread = threading.Thread(
        target=_warm_up,
        args=(Path(local_dir), backend, hf_model_config_path, trust_remote_code, is_value_model),
        name="mergeflow-warm-up",
        daemon=True,
    )
    thread.start()
    return thread


def _warm_up(
    local_dir: Path, backend: str, hf_model_config_path: str | None, trust_remote_code: bool, is_value_model: bool
) -> None:
    try:
        if backend == "megatron":
            layout = find_megatron_checkpoint(local_dir)
            if layout.hf_weights:
                return
            data_files, config_dir = layout.data_files, Path(layout.hf_dir)
        else:
            data_files, config_dir = find_rank_files(local_dir).data_files, default_config_dir(local_dir)
        start_read_ahead(data_files)
        SpecBuild(
            Path(hf_model_config_path) if hf_model_config_path else config_dir,
            trust_remote_code=trust_remote_code,
            is_value_model=is_value_model,
        ).wait()
    except Exception:  # the pipeline meets the same problem and reports it
        return
