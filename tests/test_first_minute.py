"""The first minute with the tool: every mistake the paths and flags show is answered at once, in one line
(and at most one hint); errors found later are printed once; a merge ends on its verdict."""

import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

from mergeflow.cli import EXIT_BAD_INPUT, _EchoFilter, build_parser
from tests.cli_runs import run_cli, without_a_server

EARLY_SECONDS = 5.0
"""A loose bound for the tests (measured: about 0.2 s); what matters is that nothing heavy is imported."""


def early_mistakes(fixture, other_world_size, tmp_path) -> dict[str, tuple[list, str]]:
    """Each mistake: the `mergeflow` arguments that make it, and what the error says."""
    checkpoint = fixture.checkpoint_dir
    non_empty = tmp_path / "non-empty"
    non_empty.mkdir()
    (non_empty / "notes.txt").write_text("mine")
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    missing_rank = tmp_path / "missing-rank"
    shutil.copytree(checkpoint, missing_rank)
    (missing_rank / "model_world_size_2_rank_1.pt").unlink()
    extra_rank = tmp_path / "extra-rank"
    shutil.copytree(checkpoint, extra_rank)
    shutil.copy(extra_rank / "model_world_size_2_rank_1.pt", extra_rank / "model_world_size_2_rank_2.pt")
    truncated = tmp_path / "truncated"
    shutil.copytree(checkpoint, truncated)
    os.truncate(truncated / "model_world_size_2_rank_1.pt", (truncated / "model_world_size_2_rank_1.pt").stat().st_size // 2)
    swapped = tmp_path / "swapped"
    shutil.copytree(checkpoint, swapped)
    (swapped / "model_world_size_2_rank_0.pt").rename(swapped / "rank_0")
    (swapped / "model_world_size_2_rank_1.pt").rename(swapped / "model_world_size_2_rank_0.pt")
    (swapped / "rank_0").rename(swapped / "model_world_size_2_rank_1.pt")
    other_save = tmp_path / "other-save"
    shutil.copytree(checkpoint, other_save)
    shutil.copy(other_world_size.checkpoint_dir / "model_world_size_4_rank_0.pt", other_save / "model_world_size_2_rank_0.pt")
    target = tmp_path / "out"
    merge = ["merge", "--no-progress"]
    return {
        "missing directory": ([*merge, "--local_dir", tmp_path / "nowhere", "--target_dir", target], "checkpoint directory not found"),
        "global_step_N instead of actor": ([*merge, "--local_dir", checkpoint.parent, "--target_dir", target], "pass the role directory instead"),
        "the run root instead of actor": ([*merge, "--local_dir", fixture.run_dir, "--target_dir", target], "looks like a verl run directory"),
        "a missing rank file": ([*merge, "--local_dir", missing_rank, "--target_dir", target], "rank file missing"),
        "a truncated rank file": (
            [*merge, "--local_dir", truncated, "--target_dir", target],
            f"{truncated / 'model_world_size_2_rank_1.pt'} is truncated or was not written by torch.save",
        ),
        "a rank file saved as another rank": (
            [*merge, "--local_dir", swapped, "--target_dir", target],
            f"{swapped / 'model_world_size_2_rank_0.pt'} was saved as model_world_size_2_rank_1.pt",
        ),
        "a rank file of a save with another world size": (
            [*merge, "--local_dir", other_save, "--target_dir", target],
            f"{other_save / 'model_world_size_2_rank_0.pt'} was saved as model_world_size_4_rank_0.pt",
        ),
        "an extra rank file": ([*merge, "--local_dir", extra_rank, "--target_dir", target], "unexpected rank file"),
        "a non-empty target": ([*merge, "--local_dir", checkpoint, "--target_dir", non_empty], "is not empty"),
        "an overlapping target": ([*merge, "--local_dir", checkpoint, "--target_dir", checkpoint.parent], "contains the checkpoint"),
        "a config directory without config.json": (
            [*merge, "--local_dir", checkpoint, "--hf_model_config_path", no_config, "--target_dir", target],
            f"missing {no_config / 'config.json'}",
        ),
        "a bad repo id": ([*merge, "--local_dir", checkpoint, "--target_dir", target, "--hf_upload_path", "not a/repo id"], "invalid --hf_upload_path"),
        "a bad task runner": ([*merge, "--local_dir", checkpoint, "--target_dir", target, "--task-runner", "slurm"], "task runner 'slurm'"),
        "a bad shard size": ([*merge, "--local_dir", checkpoint, "--target_dir", target, "--max-shard-size", "big"], "invalid --max-shard-size"),
        "a missing reference": ([*merge, "--local_dir", checkpoint, "--target_dir", target, "--test_hf_dir", tmp_path / "ref"], "reference model directory not found"),
        "validating a missing folder": (["validate", tmp_path / "nowhere"], "model directory not found"),
        "serving a run directory that does not exist": (
            ["serve", "--watch", tmp_path / "nowhere", "--output", target], f"run directory not found: {tmp_path / 'nowhere'}"
        ),
        "serving a checkpoint instead of its run": (
            ["serve", "--watch", checkpoint, "--output", target],
            f"is a checkpoint, not a run directory: pass {fixture.run_dir}",
        ),
        "watching a step instead of its run": (["watch", checkpoint.parent], f"is a step directory, not a run directory: pass {fixture.run_dir}"),
        "sweeping a run directory that does not exist": (["sweep", tmp_path / "nowhere", "--output", target], "run directory not found"),
    }


MISTAKES = [
    "missing directory",
    "global_step_N instead of actor",
    "the run root instead of actor",
    "a missing rank file",
    "a truncated rank file",
    "a rank file saved as another rank",
    "a rank file of a save with another world size",
    "an extra rank file",
    "a non-empty target",
    "an overlapping target",
    "a config directory without config.json",
    "a bad repo id",
    "a bad task runner",
    "a bad shard size",
    "a missing reference",
    "validating a missing folder",
    "serving a run directory that does not exist",
    "serving a checkpoint instead of its run",
    "watching a step instead of its run",
    "sweeping a run directory that does not exist",
]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_an_early_mistake_exits_2_at_once_with_one_line(fixtures, tmp_path, mistake):
    argv, message = early_mistakes(fixtures["qwen2-ws2"], fixtures["qwen2-untied-ws4"], tmp_path)[mistake]

    run = run_cli(*argv)

    assert run.returncode == EXIT_BAD_INPUT
    assert run.seconds < EARLY_SECONDS
    assert run.error_lines[0].startswith("mergeflow: error: ") and message in run.error_lines[0], run.stderr
    assert len(run.error_lines) == 1 or (len(run.error_lines) == 2 and run.error_lines[1].startswith("mergeflow: hint: "))
    assert run.stdout == ""


def test_the_early_checks_import_neither_torch_nor_prefect(fixtures, tmp_path):
    code = (
        "import sys\n"
        "from mergeflow.cli import build_parser, check_arguments\n"
        "check_arguments(build_parser().parse_args(['merge', '--local_dir', sys.argv[1], '--target_dir', sys.argv[2]]))\n"
        "print(sorted(name for name in ('torch', 'prefect', 'transformers') if name in sys.modules))\n"
    )

    checked = subprocess.run(
        [sys.executable, "-c", code, str(fixtures["qwen2-ws2"].checkpoint_dir), str(tmp_path / "out")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip

    assert checked.stdout.strip() == "[]"


@pytest.mark.usefixtures("prefect_server")
def test_an_error_found_inside_the_flow_reaches_the_console_once(copy_checkpoint, tmp_path):
    fixture = copy_checkpoint("qwen2-ws2")
    config_path = fixture.checkpoint_dir / "huggingface" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "intermediate_size": 48}))

    run = run_cli("merge", "--local_dir", fixture.checkpoint_dir, "--target_dir", tmp_path / "out")

    assert run.returncode == EXIT_BAD_INPUT
    assert (run.stdout + run.stderr).count("shape mismatch") == 1
    assert run.error_lines[-1].startswith("mergeflow: error: PlanError: shape mismatch")
    assert "Traceback" not in run.stderr


@pytest.mark.usefixtures("prefect_server")
def test_a_merge_ends_on_its_verdict_and_shows_no_staging_path(fixtures, tmp_path):
    target = tmp_path / "out"

    run = run_cli("merge", "--local_dir", fixtures["qwen2-ws2"].checkpoint_dir, "--target_dir", target)

    assert run.returncode == 0, run.stderr
    assert run.last_line.startswith(f"mergeflow: merged {fixtures['qwen2-ws2'].checkpoint_dir} into {target}")
    assert "validation passed: complete (1 weight file, 26 tensors)" in run.last_line
    assert ".mergeflow-staging" not in run.stdout + run.stderr
    assert "tensors compared" not in run.stdout + run.stderr


def test_a_merge_with_no_server_configured_runs_on_a_temporary_one(fixtures, tmp_path):
    target = tmp_path / "out"

    run = run_cli(
        "merge", "--local_dir", fixtures["qwen2-ws2"].checkpoint_dir, "--target_dir", target, env=without_a_server()
    )

    assert run.returncode == 0, run.stderr
    assert run.last_line.startswith(f"mergeflow: merged {fixtures['qwen2-ws2'].checkpoint_dir} into {target}")
    assert "View at" not in run.stdout + run.stderr, "a temporary server has no UI to link to"


@pytest.mark.usefixtures("prefect_server")
def test_validate_casts_an_fp32_reference_to_a_bf16_merge_and_says_so(fixtures, tmp_path):
    target = tmp_path / "out"
    assert run_cli("merge", "--local_dir", fixtures["qwen2-ws2"].checkpoint_dir, "--target_dir", target).returncode == 0

    run = run_cli("validate", target, "--test_hf_dir", fixtures["qwen2-ws2"].reference_dir)

    assert run.returncode == 0, run.stderr
    assert "26 tensors equal" in run.last_line
    assert "reference cast float32 -> bfloat16" in run.last_line


def test_every_option_of_every_command_has_help_text():
    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command").choices

    undocumented = [
        f"{name} {action.option_strings or action.dest}"
        for name, command in commands.items()
        for action in command._actions
        if action.dest != "help" and not action.help
    ]

    assert undocumented == []


def test_merge_help_states_verls_default_target():
    merge = next(action for action in build_parser()._actions if action.dest == "command").choices["merge"]

    assert "default: ./tmp, as verl" in merge.format_help()


@pytest.mark.usefixtures("prefect_server")
def test_the_model_card_has_the_permissions_of_the_other_files(fixtures, tmp_path):
    from mergeflow.flows.merge import merge_checkpoint

    saved = merge_checkpoint(
        local_dir=str(fixtures["qwen2-ws2"].checkpoint_dir), target_dir=str(tmp_path / "out"), progress=False
    )

    modes = {path.name: stat.S_IMODE(os.stat(path).st_mode) for path in (tmp_path / "out").iterdir()}
    assert modes["README.md"] == modes["config.json"] == modes["model.safetensors"], modes
    assert saved.files


def info_logs() -> dict[str, str]:
    """The environment of a merge whose Prefect logs reach the console at INFO, as a user's do."""
    return {**os.environ, "PREFECT_LOGGING_LEVEL": "INFO"}


@pytest.mark.usefixtures("prefect_server")
def test_a_first_merge_says_its_weights_were_written_ahead_not_kept_from_an_earlier_run(fixtures, tmp_path):
    run = run_cli("merge", "--local_dir", fixtures["qwen2-ws2"].checkpoint_dir, "--target_dir", tmp_path / "out", env=info_logs())

    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "interrupted" not in output and "earlier" not in output
    assert "model.safetensors: " in output


@pytest.mark.usefixtures("prefect_server")
def test_a_merge_already_in_place_says_it_is_up_to_date_and_writes_nothing(fixtures, tmp_path):
    target = tmp_path / "out"
    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir
    assert run_cli("merge", "--local_dir", checkpoint, "--target_dir", target).returncode == 0
    written = {path.name: path.stat().st_mtime_ns for path in target.iterdir()}

    run = run_cli("merge", "--local_dir", checkpoint, "--target_dir", target)

    assert run.returncode == 0, run.stderr
    assert run.last_line.startswith(f"mergeflow: {target} is up to date: it holds this merge of {checkpoint}, nothing was written")
    assert {path.name: path.stat().st_mtime_ns for path in target.iterdir()} == written


@pytest.mark.usefixtures("prefect_server")
def test_a_merge_reports_its_size_in_units_people_read(fixtures, tmp_path):
    run = run_cli("merge", "--local_dir", fixtures["qwen2-ws2"].checkpoint_dir, "--target_dir", tmp_path / "out")

    assert run.returncode == 0, run.stderr
    assert re.search(r", \d+(\.\d+)? kB in 1 weight file;", run.last_line), run.last_line
    assert "0.00 GB" not in run.last_line


@pytest.mark.usefixtures("prefect_server")
def test_a_merge_whose_output_is_not_a_terminal_draws_no_progress_bars(fixtures, tmp_path):
    run = run_cli("merge", "--local_dir", fixtures["qwen2-ws2"].checkpoint_dir, "--target_dir", tmp_path / "out")

    assert run.returncode == 0, run.stderr
    assert "%|" not in run.stdout + run.stderr


def test_the_console_leaves_out_the_progress_lines_of_prefects_queues_sent_at_the_end():
    record = logging.LogRecord(
        "prefect.EventsWorker", logging.WARNING, __file__, 1, "Still processing items: 12 items remaining...", None, None
    )

    assert not _EchoFilter(temporary_server=False).filter(record)
