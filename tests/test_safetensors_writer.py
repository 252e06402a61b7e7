"""The streaming safetensors writer writes what safetensors itself writes."""


import pytest
import torch
from safetensors.torch import load_file, save_file

from mergeflow.dtypes import dtype_name
from mergeflow.output.writer import AlignedFile, SafetensorsWriter, TensorEntry

TENSORS = {
    "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b.bias": torch.arange(5, dtype=torch.float32),
    "c.scale": torch.tensor(2.5),
}


def entries(tensors):
    return [TensorEntry(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()]


def test_file_is_byte_identical_to_safetensors_save_file(tmp_path):
    with SafetensorsWriter(tmp_path / "mine.safetensors", entries(TENSORS)) as writer:
        for name, tensor in TENSORS.items():
            writer.write(name, tensor)
    save_file(TENSORS, tmp_path / "theirs.safetensors", metadata={"format": "pt"})

    assert (tmp_path / "mine.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_a_tensor_written_in_chunks_reads_back_whole(tmp_path):
    tensor = torch.randn(1000, 3)
    with SafetensorsWriter(tmp_path / "out.safetensors", entries({"x": tensor})) as writer:
        for rows in tensor.split(7):
            writer.write("x", rows)

    assert torch.equal(load_file(tmp_path / "out.safetensors")["x"], tensor)


def test_bytes_for_the_wrong_tensor_are_refused(tmp_path):
    with (
        pytest.raises(ValueError, match=r'expected bytes of "a\.weight"'),
        SafetensorsWriter(tmp_path / "out.safetensors", entries(TENSORS)) as writer,
    ):
        writer.write("b.bias", TENSORS["b.bias"])


def test_closing_before_every_tensor_is_written_is_refused(tmp_path):
    writer = SafetensorsWriter(tmp_path / "out.safetensors", entries(TENSORS))
    writer.write("a.weight", TENSORS["a.weight"])

    with pytest.raises(ValueError, match=r'closed before tensor "b\.bias"'):
        writer.close()


def test_aligned_file_writes_exact_sizes_across_buffer_boundaries(tmp_path):
    data = bytes(range(256)) * 300
    file = AlignedFile(tmp_path / "out.bin", buffer_bytes=4096 * 3)
    for start in range(0, len(data), 5000):
        file.write(memoryview(data[start : start + 5000]))
    file.close()

    assert (tmp_path / "out.bin").read_bytes() == data


def test_aligned_file_that_drops_o_direct_mid_file_keeps_every_byte(tmp_path):
    """What happens when a filesystem refuses an O_DIRECT write with EINVAL."""
    data = bytes(range(256)) * 100
    file = AlignedFile(tmp_path / "out.bin", buffer_bytes=4096)
    file.write(memoryview(data[:10_000]))
    file._stop_direct_io()
    file.write(memoryview(data[10_000:]))
    file.close()

    assert not file.direct
    assert (tmp_path / "out.bin").read_bytes() == data

