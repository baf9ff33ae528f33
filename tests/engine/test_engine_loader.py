"""engine.memory.loader: blocks read into caller buffers, checksums, truncation and changes on disk."""

import os
import threading

import numpy as np
import pytest

from engine.builder import GraphBuilder
from engine.format import save_model
from engine.memory.loader import ModelFileError, WeightLoader


@pytest.fixture
def model_file(tmp_path):
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    x = b.input("x", (1, 3, 8, 8))
    w1 = rng.standard_normal((16, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((8, 16, 1, 1)).astype(np.float32)
    b.output(b.conv(b.relu(b.conv(x, w1, pads=1)), w2))
    g = b.build()
    path = tmp_path / "m.sfe"
    save_model(g, path)
    return path, g.weights


def test_reads_whole_blocks_and_row_ranges_into_given_buffers(model_file):
    path, weights = model_file
    with WeightLoader(path) as loader:
        for name, w in weights.items():
            buf = np.empty(w.nbytes + 100, np.uint8)
            got = loader.read_into(name, buf)
            assert np.shares_memory(got, buf) and np.array_equal(got, w)
            rows = loader.blocks[name].shape[0]
            parts = [loader.read_into(name, np.empty(w.nbytes, np.uint8), rows=(a, min(a + 5, rows))).copy()
                     for a in range(0, rows, 5)]
            assert np.array_equal(np.concatenate(parts), w)
        assert loader.bytes_read == 2 * sum(w.nbytes for w in weights.values())


@pytest.mark.parametrize("kind", ["crc32c", "crc32"])
def test_a_flipped_byte_fails_the_checksum_naming_the_weight(model_file, kind, monkeypatch):
    import engine.format

    path, weights = model_file
    if kind == "crc32c":
        pytest.importorskip("crc32c")
    else:  # a process without the crc32c package checks zlib's CRC-32, which every file carries
        monkeypatch.setattr(engine.format, "_crc32c", None)
    name = next(iter(weights))
    assert WeightLoader(path).blocks[name].checksum_kind == kind
    off = WeightLoader(path).blocks[name].offset + 7
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))
    loader = WeightLoader(path)
    with pytest.raises(ModelFileError, match=f"{name}.*checksum \\({kind} "):
        loader.read_into(name, np.empty(weights[name].nbytes, np.uint8))
    # also caught when the block is read slice by slice, at its last slice
    rows = loader.blocks[name].shape[0]
    loader.read_into(name, np.empty(weights[name].nbytes, np.uint8), rows=(0, rows // 2))
    with pytest.raises(ModelFileError, match="checksum"):
        loader.read_into(name, np.empty(weights[name].nbytes, np.uint8), rows=(rows // 2, rows))


def test_mapped_blocks_are_writeable_views_checked_on_demand(model_file):
    path, weights = model_file
    with WeightLoader(path) as loader:
        views = loader.map_all()
        for name, w in weights.items():
            assert np.array_equal(views[name], w) and views[name].flags.writeable
            loader.verify(name, views[name])
        name = next(iter(weights))
        views[name].reshape(-1)[0] += 1.0  # copy-on-write: the file keeps its bytes
    with WeightLoader(path) as again:
        assert np.array_equal(again.map_all()[name], weights[name])


def test_a_flipped_byte_fails_the_mapped_check_naming_the_weight(model_file):
    path, weights = model_file
    name = next(iter(weights))
    off = WeightLoader(path).blocks[name].offset + 5
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x10]))
    loader = WeightLoader(path)
    views = loader.map_all()
    with pytest.raises(ModelFileError, match=f"{name}.*checksum \\(crc32"):
        loader.verify(name, views[name])
    other = [n for n in weights if n != name][0]
    loader.verify(other, views[other])  # the others are intact


def test_truncated_file_is_refused_at_open(model_file):
    path, _ = model_file
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(ModelFileError, match="truncated"):
        WeightLoader(path)


def test_garbage_file_is_refused(tmp_path):
    path = tmp_path / "junk"
    path.write_bytes(b"not a model at all")
    with pytest.raises(ModelFileError, match="unreadable model header"):
        WeightLoader(path)


def test_file_replaced_while_open_is_detected(model_file, tmp_path):
    path, weights = model_file
    loader = WeightLoader(path)
    name = next(iter(weights))
    other = tmp_path / "other.sfe"
    other.write_bytes(path.read_bytes())
    os.replace(other, path)
    with pytest.raises(ModelFileError, match="changed while in use"):
        loader.read_into(name, np.empty(weights[name].nbytes, np.uint8))


def test_bad_buffer_and_rows_are_refused(model_file):
    path, weights = model_file
    loader = WeightLoader(path)
    name = next(iter(weights))
    with pytest.raises(ValueError, match="hold"):
        loader.read_into(name, np.empty(4, np.uint8))
    with pytest.raises(ValueError, match="outside"):
        loader.read_into(name, np.empty(weights[name].nbytes, np.uint8), rows=(0, 999))
    with pytest.raises(KeyError):
        loader.read_into("nope", np.empty(4, np.uint8))


def test_usable_from_a_background_thread(model_file):
    path, weights = model_file
    loader = WeightLoader(path)
    out = {}

    def load():
        for name, w in weights.items():
            out[name] = loader.read_into(name, np.empty(w.nbytes, np.uint8))

    t = threading.Thread(target=load)
    t.start()
    t.join()
    assert all(np.array_equal(out[n], w) for n, w in weights.items())


def test_aligned_reads_use_direct_io_and_others_the_page_cache(tmp_path):
    rng = np.random.default_rng(1)
    b = GraphBuilder()
    x = b.input("x", (1, 64, 8, 8))
    w = rng.standard_normal((64, 64, 3, 3)).astype(np.float32)  # rows of 2304 bytes: slices of 16 rows align
    b.output(b.conv(x, w, pads=1))
    path = tmp_path / "aligned.sfe"
    save_model(b.build(), path, align=4096)
    loader = WeightLoader(path)
    name = next(iter(loader.blocks))
    if loader._dfd < 0:
        pytest.skip("this file system has no direct I/O")
    raw = np.empty(w.nbytes + 3 * 4096, np.uint8)
    buf = raw[(-raw.ctypes.data) % 4096:][: w.nbytes + 4096]  # aligned, with room for the rounded-up read
    got = [loader.read_into(name, buf, rows=(r, r + 16)).copy() for r in range(0, 64, 16)]
    assert np.array_equal(np.concatenate(got), w) and loader.direct_bytes == w.nbytes
    loader.read_into(name, buf[64:], rows=(0, 16))  # an unaligned buffer: read through the page cache
    loader.read_into(name, buf[: 8 * 2304], rows=(0, 8))  # no room for the rounded-up length: the same
    assert loader.direct_bytes == w.nbytes and loader.bytes_read == w.nbytes + 24 * 2304
    with open(path, "r+b") as f:  # a flipped byte is caught on the direct path too
        f.seek(loader.blocks[name].offset + 5)
        byte = f.read(1)
        f.seek(loader.blocks[name].offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelFileError, match="checksum"):
        WeightLoader(path).read_into(name, buf)


def test_verify_blocks_reads_every_named_block_in_small_chunks_and_names_a_corrupt_one(model_file):
    path, weights = model_file
    names = list(weights)
    with WeightLoader(path) as loader:
        nbytes, seconds = loader.verify_blocks(names, chunk=256)  # several chunks per block
        assert nbytes == loader.bytes_read == sum(w.nbytes for w in weights.values()) and seconds > 0
        last = max(names, key=lambda n: loader.blocks[n].offset)
        off = loader.blocks[last].offset + loader.blocks[last].nbytes - 1  # in its last chunk
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x01]))
    with WeightLoader(path) as loader, pytest.raises(ModelFileError, match=f"{last}.*checksum"):
        loader.verify_blocks(names, chunk=256)
