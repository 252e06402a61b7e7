"""A damaged checkpoint is an error naming the file (and, for tensor data, the tensors), never a silently
wrong model, a traceback or a hang: torch's zip records carry a CRC-32 of each storage, checked while
the merge streams them."""

import random
import shutil
import threading
import zipfile
from pathlib import Path

import pytest
import torch

from mergeflow.cli import EXIT_BAD_INPUT
from mergeflow.errors import CheckpointError
from mergeflow.formats.dcp import _FileWindow, read_metadata
from mergeflow.formats.fsdp.rank_pickle import read_rank_pickle
from mergeflow.formats.megatron.layout import find_megatron_checkpoint
from mergeflow.output.staging import STAGING_PREFIX
from tests.cli_runs import run_cli
from tests.merging import load_weights, merge_with_engine

CHECKPOINT = "qwen2-ws2"
FLIPS = 24
SECONDS_PER_MERGE = 120


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        value = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([value ^ 0x20]))


def damage_tensor(rank_file: Path, name: str, at: int) -> None:
    """Flip a byte `at` bytes into the data of tensor `name` of a rank file."""
    flip_byte(rank_file, read_rank_pickle(rank_file)[name].file_offset + at)


def record_data_offset(archive_file, info: zipfile.ZipInfo) -> int:
    """Where a stored zip record's bytes start (after its local header)."""
    archive_file.seek(info.header_offset + 26)
    name_length, extra_length = int.from_bytes(archive_file.read(2), "little"), int.from_bytes(archive_file.read(2), "little")
    return info.header_offset + 30 + name_length + extra_length


def pickle_offset(rank_file: Path) -> tuple[int, int]:
    """Where the rank file's pickle (`data.pkl`) lies: (offset, length)."""
    with open(rank_file, "rb") as file, zipfile.ZipFile(file) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith("/data.pkl"))
        return record_data_offset(file, info), info.file_size


@pytest.fixture
def damaged(copy_checkpoint):
    return copy_checkpoint(CHECKPOINT)


def test_a_flipped_byte_in_tensor_data_is_an_error_naming_the_file_and_the_tensor(damaged, target_dir):
    rank_file = damaged.checkpoint_dir / "model_world_size_2_rank_1.pt"
    damage_tensor(rank_file, "model.layers.1.mlp.up_proj.weight", at=37)

    run = run_cli("merge", "--local_dir", damaged.checkpoint_dir, "--target_dir", target_dir, "--no-progress")

    assert run.returncode == EXIT_BAD_INPUT
    assert f"corrupt rank file {rank_file}" in run.stderr
    assert '"model.layers.1.mlp.up_proj.weight"' in run.stderr
    assert not target_dir.exists()


def test_damaged_tensor_data_ends_a_merge_on_a_terminal_with_one_error_and_its_hint_and_no_finished_bar(
    damaged, target_dir
):
    damage_tensor(damaged.checkpoint_dir / "model_world_size_2_rank_1.pt", "model.layers.1.mlp.up_proj.weight", at=37)

    code, output = run_on_a_terminal("merge", "--local_dir", damaged.checkpoint_dir, "--target_dir", target_dir)

    lines = [line for line in output.splitlines() if line.strip()]
    assert code == EXIT_BAD_INPUT
    assert [line.split(":")[1].strip() for line in lines[-2:]] == ["error", "hint"], lines[-3:]
    assert output.count("mergeflow: error:") == 1
    assert "100%" not in output


def run_on_a_terminal(*args, timeout: float = SECONDS_PER_MERGE) -> tuple[int, str]:
    """`mergeflow ARGS` with a pseudo-terminal as its stdout and stderr (where progress bars are drawn): its exit
    code and everything it printed."""
    import os
    import pty
    import subprocess

    from tests.cli_runs import COMMAND

    leader, follower = pty.openpty()
    process = subprocess.Popen([*COMMAND, *map(str, args)], stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    output = bytearray()
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process has ended
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    return process.wait(timeout=timeout), output.decode(errors="replace").replace("\r", "\n")


def test_a_merge_that_fails_on_damaged_data_leaves_no_staging_folder(damaged, target_dir):
    rank_file = damaged.checkpoint_dir / "model_world_size_2_rank_0.pt"
    damage_tensor(rank_file, "model.norm.weight", at=1)

    run = run_cli("merge", "--local_dir", damaged.checkpoint_dir, "--target_dir", target_dir, "--no-progress")

    assert run.returncode == EXIT_BAD_INPUT
    assert list(target_dir.parent.glob(f"{STAGING_PREFIX}*")) == []


def test_a_flipped_byte_in_the_pickle_is_an_error_naming_the_file(damaged, target_dir):
    rank_file = damaged.checkpoint_dir / "model_world_size_2_rank_0.pt"
    offset, length = pickle_offset(rank_file)
    flip_byte(rank_file, offset + length // 2)

    run = run_cli("merge", "--local_dir", damaged.checkpoint_dir, "--target_dir", target_dir, "--no-progress")

    assert run.returncode == EXIT_BAD_INPUT
    assert f"corrupt rank file {rank_file}" in run.error_lines[0]
    assert "Traceback" not in run.stderr
    assert not target_dir.exists()


def test_the_test_command_reports_damaged_tensor_data_too(damaged, fixtures):
    rank_file = damaged.checkpoint_dir / "model_world_size_2_rank_0.pt"
    damage_tensor(rank_file, "model.norm.weight", at=1)

    run = run_cli("test", "--local_dir", damaged.checkpoint_dir, "--test_hf_dir", fixtures[CHECKPOINT].reference_dir)

    assert run.returncode == EXIT_BAD_INPUT
    assert '"model.norm.weight"' in run.stderr


def merge_outcome(checkpoint_dir: Path, target_dir: Path) -> Exception | None:
    """What merging gives, within a bound: None for a written model, else the exception raised."""
    outcome: list[Exception | None] = []

    def merge() -> None:
        try:
            merge_with_engine(checkpoint_dir, target_dir)
            outcome.append(None)
        except Exception as error:
            outcome.append(error)

    worker = threading.Thread(target=merge, daemon=True)
    worker.start()
    worker.join(SECONDS_PER_MERGE)
    assert outcome, f"the merge of {checkpoint_dir} did not finish within {SECONDS_PER_MERGE}s"
    return outcome[0]


@pytest.fixture(scope="module")
def clean_merge(fixtures, tmp_path_factory) -> dict[str, torch.Tensor]:
    target = tmp_path_factory.mktemp("clean") / "merged"
    merge_with_engine(fixtures[CHECKPOINT].checkpoint_dir, target)
    return load_weights(target)


@pytest.mark.parametrize("seed", range(FLIPS))
def test_a_byte_flipped_anywhere_gives_the_clean_model_or_an_error_naming_the_file(
    fixtures, clean_merge, tmp_path, seed
):
    run_dir = tmp_path / "run"
    shutil.copytree(fixtures[CHECKPOINT].run_dir, run_dir)
    checkpoint = run_dir / fixtures[CHECKPOINT].checkpoint_dir.relative_to(fixtures[CHECKPOINT].run_dir)
    rank_file = sorted(checkpoint.glob("model_world_size_*_rank_*.pt"))[seed % 2]
    offset = random.Random(seed).randrange(rank_file.stat().st_size)
    flip_byte(rank_file, offset)

    error = merge_outcome(checkpoint, tmp_path / "merged")

    if error is None:  # the byte was one no reader depends on (zip padding, a comment): the model is intact
        assert load_weights(tmp_path / "merged").keys() == clean_merge.keys()
        assert all(torch.equal(load_weights(tmp_path / "merged")[name], t) for name, t in clean_merge.items())
    else:
        assert isinstance(error, CheckpointError), f"byte {offset} of {rank_file.name}: {error!r}"
        assert str(rank_file) in str(error)
        assert not (tmp_path / "merged").exists()


def test_a_flipped_byte_in_a_megatron_chunk_is_an_error_naming_the_file(megatron_fixtures, tmp_path):

    source = megatron_fixtures["megatron-qwen2-tp1"]
    checkpoint = tmp_path / "actor"
    shutil.copytree(source.checkpoint_dir, checkpoint)
    layout = find_megatron_checkpoint(checkpoint)
    stored = read_metadata(Path(layout.dist_ckpt_dir))["decoder.final_layernorm.weight"]
    chunk = stored.chunks[0]
    data_file = Path(layout.dist_ckpt_dir) / chunk.file
    with open(data_file, "rb") as file:
        window = _FileWindow(file, chunk.byte_offset, chunk.byte_length)
        with zipfile.ZipFile(window) as archive:
            info = next(info for info in archive.infolist() if "/data/" in info.filename)
            offset = chunk.byte_offset + record_data_offset(window, info)
    flip_byte(data_file, offset + 2)

    with pytest.raises(CheckpointError, match=f"corrupt data file {data_file}: the chunk of decoder.final_layernorm"):
        merge_with_engine(checkpoint, tmp_path / "merged", backend="megatron")
    assert not (tmp_path / "merged").exists()
