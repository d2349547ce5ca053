"""Shared fixtures: small real image sets made on the fly, and the GPU skip hook."""

import io
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from make_images import make_image  # noqa: E402


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def child_env(**extra) -> dict:
    """The environment for a child Python: this checkout first on its path, and whatever path the
    tests run under after it (where the packages of a machine without an index live)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def stand_in_driver(tmp_path, name, source, **defines):
    """A stand-in for the CUDA driver compiled from C ``source`` (``defines``: -D macros): its soname
    libcuda.so.1, its file named as a driver install names it (tmp_path/name/libcuda.so.580.1)."""
    code = tmp_path / f"{name}.c"
    code.write_text(source)
    library = tmp_path / name / "libcuda.so.580.1"
    library.parent.mkdir()
    subprocess.run([shutil.which("cc"), "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
                    *(f"-D{k}={v}" for k, v in defines.items()), "-o", str(library), str(code)], check=True)
    return library


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def release(module) -> tuple:
    """A package's (major, minor) release, from its __version__ ("2.4.1+cu121" -> (2, 4))."""
    return tuple(int(part) for part in module.__version__.split(".")[:2])


def needs_triton_interpreter():
    """Skip unless Triton's interpreter can run the GPU kernels on the CPU here: Triton installed (with
    torch), and not an interpreter before Triton 3.7 under NumPy 2.4 on (it turns one-element arrays
    into Python numbers, which NumPy 2.4 refuses). Not a limit of gdsdata's: compiled kernels take
    no NumPy."""
    triton = pytest.importorskip("triton")
    if release(triton) < (3, 7) and release(np) >= (2, 4):
        pytest.skip(f"Triton {triton.__version__}'s interpreter does not run under NumPy {np.__version__} "
                    f"(Triton 3.7 on, or NumPy before 2.4)")


def pytest_collection_modifyitems(config, items):
    if "heavy" not in (config.option.markexpr or ""):  # the many-trial runs only when asked for by name
        kept = [item for item in items if "heavy" not in item.keywords]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if "heavy" in item.keywords])
            items[:] = kept
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU tests run on a machine with one (pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def loader_threads() -> set:
    """The live threads of gdsdata Loaders (their read-ahead, window, decode and transform threads)."""
    return {t for t in threading.enumerate()
            if t.name in ("gdsdata-read", "gdsdata-decode", "gdsdata-transform")
            or t.name.startswith(("gdsdata-read-ahead", "gdsdata-window"))}


def slow_decode(ds, seconds):
    """Make each batch's decode of ``ds`` (the decode thread's call) take ``seconds`` longer."""
    original = ds._backend.decode

    def slow(staged, stream=None):
        time.sleep(seconds)
        return original(staged, stream)

    ds._backend.decode = slow


def photo(seed, label=0, noise=2.0, scale=0.5) -> Image.Image:
    """A photographic-looking RGB image; noise 2 is a camera's after its own denoising."""
    return make_image(seed, label, noise, scale)


def jpeg_bytes(image, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **kwargs)
    return buffer.getvalue()


def png_bytes(image, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", **kwargs)
    return buffer.getvalue()


def _exif_rotated(image):
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to display
    return jpeg_bytes(image, quality=90, exif=exif.tobytes())


def _extraneous_bytes(image):
    """Junk before the end-of-image marker: PIL decodes it, libjpeg-turbo warns."""
    data = jpeg_bytes(image, quality=90)
    return data[:-2] + b"\x00" * 7 + data[-2:]


def _sixteen_bit(image):
    gray = np.asarray(image.convert("L"), dtype=np.uint16) * 257 + np.arange(image.width, dtype=np.uint16) % 200
    return png_bytes(Image.fromarray(gray))


# name -> (class folder, bytes maker, expected outcome): "as_is", "converted" or "skipped"
KINDS = {
    "baseline420.jpg": ("animals", lambda im: jpeg_bytes(im, quality=90), "as_is"),
    "baseline444.jpg": ("animals", lambda im: jpeg_bytes(im, quality=90, subsampling=0), "as_is"),
    "baseline422.jpeg": ("animals", lambda im: jpeg_bytes(im, quality=90, subsampling=1), "as_is"),
    "gray.jpg": ("animals", lambda im: jpeg_bytes(im.convert("L"), quality=90), "as_is"),
    "exif_rotated.JPG": ("animals", _exif_rotated, "as_is"),
    "extraneous.jpg": ("animals", _extraneous_bytes, "converted"),
    "progressive.jpg": ("plants", lambda im: jpeg_bytes(im, quality=90, progressive=True), "converted"),
    "cmyk.jpg": ("plants", lambda im: jpeg_bytes(im.convert("CMYK"), quality=90), "converted"),
    "rgba.png": ("plants", lambda im: png_bytes(im.convert("RGBA")), "converted"),
    "palette.png": ("plants", lambda im: png_bytes(im.convert("P", palette=Image.Palette.ADAPTIVE)), "converted"),
    "sixteen_bit.png": ("plants", _sixteen_bit, "converted"),
    "gray.png": ("plants", lambda im: png_bytes(im.convert("L")), "converted"),
    "image.bmp": ("rocks", lambda im: _save(im, "BMP"), "converted"),
    "image.webp": ("rocks", lambda im: _save(im, "WEBP", quality=95), "converted"),
    "truncated.jpg": ("rocks", lambda im: jpeg_bytes(im, quality=90)[:3000], "skipped"),
    "empty.jpg": ("rocks", lambda im: b"", "skipped"),
    "text.jpg": ("rocks", lambda im: b"this is not an image\n" * 20, "skipped"),
    "notes.txt": ("rocks", lambda im: b"ignored: not an image extension\n", "ignored"),
}


def _save(image, fmt, **kwargs):
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def write_kinds(root):
    """Write one file of every kind under root/CLASS/; returns {relative path: expected outcome}."""
    expected = {}
    for seed, (name, (folder, maker, outcome)) in enumerate(sorted(KINDS.items())):
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        with open(os.path.join(root, folder, name), "wb") as f:
            f.write(maker(photo(seed, label=seed % 3)))
        expected[os.path.join(folder, name)] = outcome
    return expected


def write_photos(root, count, classes=3, start_seed=100, **kwargs):
    """Baseline JPEGs, spread over class folders; returns their relative paths in ImageFolder order."""
    paths = []
    for i in range(count):
        folder = f"class{i % classes}"
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        rel = os.path.join(folder, f"{i:05d}.jpg")
        with open(os.path.join(root, rel), "wb") as f:
            f.write(jpeg_bytes(photo(start_seed + i, label=i % classes, **kwargs), quality=90))
        paths.append(rel)
    return sorted(paths)


@pytest.fixture(scope="session")
def kinds_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds_src")
    return str(root), write_kinds(str(root))


@pytest.fixture(scope="session")
def kinds_dataset(kinds_source, tmp_path_factory):
    from gdsdata.packing.packer import pack

    src, expected = kinds_source
    out = str(tmp_path_factory.mktemp("kinds") / "ds")
    result = pack(src, out, workers=2)
    return src, expected, out, result


@pytest.fixture(scope="session")
def photos_dataset(tmp_path_factory):
    """60 baseline JPEGs in 3 classes, packed into small shards so reads cross shard boundaries."""
    from gdsdata.packing.packer import pack

    src = str(tmp_path_factory.mktemp("photos_src"))
    paths = write_photos(src, 60)
    out = str(tmp_path_factory.mktemp("photos") / "ds")
    pack(src, out, workers=2, shard_size=600_000)
    return src, paths, out


def damaged_copy(dataset, out, sample, at, data) -> str:
    """Copy a packed dataset to ``out`` and overwrite bytes of one sample's payload with ``data``,
    starting ``at`` bytes into it (negative: from its end). Returns ``out``."""
    import shutil

    from gdsdata.format.index import load

    shutil.copytree(dataset, out)
    index = load(out)
    record = index.samples[sample]
    start = int(record["offset"]) + (at if at >= 0 else int(record["length"]) + at)
    with open(index.shard_path(int(record["shard"])), "r+b") as f:
        f.seek(start)
        f.write(data)
    return out


def pil_reference(path) -> np.ndarray:
    """What a pack should hold of an image file: PIL's RGB conversion, except that a 16-bit gray
    image keeps each pixel's high byte (as OpenCV reads it; PIL's conversion clips it to white)."""
    image = Image.open(path)
    if image.mode.startswith("I;16"):
        image = Image.fromarray((np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8), "L")
    return np.asarray(image.convert("RGB"))


def mean_abs_diff(tensor_chw, reference_hwc) -> float:
    pixels = tensor_chw.permute(1, 2, 0).numpy().astype(np.int16)
    assert pixels.shape == reference_hwc.shape, (pixels.shape, reference_hwc.shape)
    return float(np.abs(pixels - reference_hwc.astype(np.int16)).mean())


def resealed(raw: bytes) -> bytes:
    """An index file's bytes with its checksums made right again (the body's, and the header's where
    it records one), so that the checks behind them see what a test changed."""
    import zlib

    from gdsdata.format import index as index_io
    from gdsdata.format import layout as fmt

    size = fmt.INDEX_HEADER.itemsize
    if len(raw) < size:
        return bytes(raw)
    header = np.frombuffer(bytes(raw[:size]), fmt.INDEX_HEADER, count=1)[0].copy()
    header["body_crc32"] = zlib.crc32(bytes(raw[size:]))
    if header["header_crc32"]:
        header["header_crc32"] = index_io._header_crc(header)
    return header.tobytes() + bytes(raw[size:])
