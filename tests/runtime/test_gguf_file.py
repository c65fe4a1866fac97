"""GGUFFile reads what the `gguf` package's reader reads: every metadata value type and the
tensors' shapes, types and bytes, from a file the package's writer wrote."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from bucketserve.runtime.io.gguf_file import GGUFFile


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "every_type.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "h\u00e9llo \U0001f916")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.strs", ["a", "", "\u2581b", "<0x0A>"])
    writer.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("f32", weights)
    writer.add_tensor("f16", weights.astype(np.float16))
    q8 = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("vector", weights[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_and_tensors_equal_the_gguf_packages_reader(written: Path) -> None:
    ours, theirs = GGUFFile(written), gguf.GGUFReader(written)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.pop("t.nested") == [[1, 2], [3]]  # the package's reader flattens it
    del expected["t.nested"]
    assert ours.fields == expected
    assert ours.fields["t.strs"] == ["a", "", "\u2581b", "<0x0A>"]
    assert ours.fields["t.u64"] == 2**63 + 5 and ours.fields["t.bool"] is True
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(reversed([int(d) for d in t.shape]))
        assert mine.type == t.tensor_type
        assert np.array_equal(mine.data, t.data.reshape(-1).view(np.uint8))
    q8 = ours.tensors["q8"]
    back = gguf.quants.dequantize(q8.data, q8.type).reshape(q8.shape)
    floats = ours.tensors["f32"].data.view(np.float32).reshape(8, 64)
    assert back.shape == (8, 64) and np.allclose(back, floats, atol=0.05)


def test_what_is_not_a_gguf_is_refused_naming_the_file(written: Path, tmp_path: Path) -> None:
    other = tmp_path / "model.gguf"
    other.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match=r"model\.gguf is not a readable GGUF file: no GGUF magic"):
        GGUFFile(other)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(written.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"cut\.gguf: tensor .* runs past the end of the file"):
        GGUFFile(cut)
    short = tmp_path / "short.gguf"
    short.write_bytes(written.read_bytes()[:60])
    with pytest.raises(ValueError, match=r"short\.gguf is not a readable GGUF file"):
        GGUFFile(short)
