"""The GPU kit's fallback PNG writer (bench/gpu/plot.py), used where matplotlib is missing: a valid PNG
(signature, chunk CRCs, IHDR size, scanlines) with the series drawn in their colours."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from sluice_inference.bench.gpu.plot import COLOURS, panels, raster, write_png

FIGURES = {
    "device_curve": {"points": [
        {"bucket": 16, "batch": 1, "items_per_s": 100.0}, {"bucket": 16, "batch": 8, "items_per_s": 600.0},
    ]},
    "end_to_end": {"in_process_bound_items_per_s": 600.0, "steps": [
        {"model": "bert", "rate": 50.0, "goodput_rps": 50.0},
        {"model": "bert", "rate": 500.0, "goodput_rps": 420.0},
    ]},
}  # fmt: skip


def read_png(path: Path) -> tuple[int, int, bytes]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, offset = {}, 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks[kind] = body
        offset += 12 + length
    width, height, depth, colour_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour_type) == (8, 2)  # 8-bit RGB
    pixels = zlib.decompress(chunks[b"IDAT"])
    assert len(pixels) == height * (1 + 3 * width) and b"IEND" in chunks
    return width, height, pixels


def test_the_fallback_writer_draws_every_series(tmp_path: Path) -> None:
    curve, e2e, bound = panels(FIGURES)
    assert (
        [name for name, _ in curve] == ["L=16"] and [name for name, _ in e2e] == ["bert"] and bound == 600.0
    )
    path = tmp_path / "kit.png"
    write_png(path, raster(curve, e2e, bound))
    width, height, pixels = read_png(path)
    assert (width, height) == (820, 320)
    assert pixels.count(bytes(COLOURS[0])) > 100  # each panel's first series, in the first colour
    assert bytes((128, 128, 128)) in pixels  # the dashed in-process bound
