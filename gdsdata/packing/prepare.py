"""Pack-time validation and normalisation of one source image.

Every stored sample must decode on the GPU fast path. A JPEG that nvJPEG's hardware engines can
decode (see ``jpeg.probe``) and that libjpeg-turbo decodes without a warning is stored byte for
byte. Anything else PIL can
open is converted once, exactly as ``PIL.Image.open(path).convert("RGB")`` sees it (EXIF
orientation is not applied unless ``exif_transpose``, as YOLO packs ask; alpha is dropped, palette
images go through PIL's own conversion; 16-bit gray images keep their high byte, as OpenCV reads
them, where PIL's conversion would clip them to white), and re-encoded as a baseline JPEG: quality 95
by default with 4:4:4 chroma, so that colour edges survive (a palette image kept a mean absolute
difference near 2.5 where 4:2:0 at quality 90 gave 4); single-channel sources as a gray JPEG, the
rest as YCbCr. A file that cannot be decoded raises ``BadImageError`` with the reason.
"""

import contextlib
import io
import sys
import warnings
from dataclasses import dataclass, replace

import numpy as np
import simplejpeg
from PIL import Image, ImageOps

from gdsdata.format import layout as fmt
from gdsdata.errors import BadImageError
from gdsdata.packing.jpeg import NotJpeg, is_jpeg, probe

_GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"}


@dataclass(frozen=True)
class PackOptions:
    codec: str = "jpeg"  # "jpeg" or "raw"
    quality: int = 95  # JPEG quality of re-encoded images (4:4:4 chroma)
    max_side: int = 0  # downscale so the longer side is at most this (0: keep)
    raw_size: int = 0  # raw codec: downscale so the shorter side is this (0: keep)
    max_pixels: int = Image.MAX_IMAGE_PIXELS  # larger declared sizes are refused before decoding (0: no limit)
    exif_transpose: bool = False  # store images turned as their EXIF orientation says (detection: YOLO)

    def __post_init__(self):
        if self.codec not in ("jpeg", "raw"):
            raise ValueError(f"codec must be 'jpeg' or 'raw', got {self.codec!r}")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"JPEG quality must be between 1 and 100, got {self.quality}")
        if self.raw_size and self.codec != "raw":
            raise ValueError("a raw size (--size) applies to the raw codec (--codec raw); JPEGs are downscaled with "
                             "a max side (--max-side)")
        if self.max_side < 0 or self.raw_size < 0:
            raise ValueError("max side and raw size must be positive (or 0 to keep the size)")
        if self.max_pixels < 0:
            raise ValueError(f"max pixels must be positive (or 0 for no limit), got {self.max_pixels}")


def _check_pixels(width, height, options):
    """Refuse a declared size over the limit before anything is decoded (a few hundred bytes can
    declare 65500x65500 pixels, 12.9 GB of RGB)."""
    if options.max_pixels and width * height > options.max_pixels:
        raise BadImageError(f"declares {width}x{height} = {width * height:,} pixels, over the limit of "
                            f"{options.max_pixels:,} (--max-pixels; 0 lifts it)")


@dataclass(frozen=True)
class Prepared:
    payload: bytes
    codec: int
    width: int
    height: int
    components: int
    subsampling: int
    flags: int
    source_size: tuple = None  # (width, height) of the source as read (EXIF-turned), before any downscale
    source_format: str = ""  # what PIL calls the source's format, lower case ("jpeg", "png", "mpo" ...)
    warning: str = ""  # libjpeg's complaint where its strict decode refused the JPEG: stored as PIL decodes it


def pil_open():
    """PIL's own ``Image.open``. Importing Ultralytics replaces it, process-wide, with one that on a
    file PIL cannot identify pip-installs pi-heif and raises when it cannot: a non-image would then
    fetch a package at run time, or read as a missing module."""
    patches = sys.modules.get("ultralytics.utils.patches")
    original = getattr(patches, "_image_open", None)
    return original if original is not None and Image.open is getattr(patches, "image_open", None) else Image.open


@contextlib.contextmanager
def _no_pixel_limit():
    """PIL's decompression-bomb limit off: the limit is ours (``--max-pixels``, ``_check_pixels``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        previous, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = previous


def stored_size(path) -> tuple[int, int]:
    """An image file's (width, height) as stored (no EXIF turn), from its header, opened as the pack
    opens files (HEIF through its plugin where one is installed; the pixel limit applied when the
    pack decodes it, not here). Raises what PIL raises for a file it cannot open."""
    with open(path, "rb") as f:
        if _heif(f.read(16)):
            _register_heif()
        f.seek(0)
        with _no_pixel_limit(), pil_open()(f) as image:
            return image.size


def _open(data: bytes, options) -> Image.Image:
    """Decode fully with PIL, after checking the declared size, turning every failure into a
    one-line reason."""
    try:
        with _no_pixel_limit():
            image = pil_open()(io.BytesIO(data))
            _check_pixels(image.width, image.height, options)
            image.load()
    except BadImageError:
        raise
    except (Image.UnidentifiedImageError, ImportError) as e:  # (ImportError: a patched Image.open's plugin)
        if _heif(data) and _register_heif():
            return _open(data, options)
        if _heif(data) and ".heic" not in Image.registered_extensions():
            raise BadImageError("a HEIC/HEIF image: PIL reads it with the pillow-heif or pi-heif plugin (pip "
                                "install pi-heif), neither installed") from e
        raise BadImageError("not an image PIL can identify") from e
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadImageError(f"too many pixels ({e})") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise BadImageError(f"truncated or corrupt: {e}") from e
    except Exception as e:  # noqa: BLE001 - any failure of a decoder on untrusted bytes is a bad file
        raise BadImageError(f"corrupt: {type(e).__name__}: {e}") from e
    if image.width == 0 or image.height == 0:
        raise BadImageError("image has no pixels")
    return image


_HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"hevm", b"hevs", b"mif1", b"msf1")


def _heif(data: bytes) -> bool:
    """Whether the bytes are an ISO-BMFF file of a HEIF brand (what iPhones save as .heic)."""
    return data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS


def _register_heif() -> bool:
    """Let PIL open HEIF files through pillow-heif or pi-heif where one is installed: whether this
    call did (False where neither is, or PIL had the opener already)."""
    if ".heic" in Image.registered_extensions():
        return False
    for plugin in ("pillow_heif", "pi_heif"):  # (pi-heif: its decoder alone, what Ultralytics installs)
        try:
            module = __import__(plugin)
        except ImportError:
            continue
        module.register_heif_opener()
        break
    return ".heic" in Image.registered_extensions()


def _target_size(width, height, options):
    """The stored size for a source of this size, or None to keep it."""
    if options.codec == "raw" and options.raw_size and min(width, height) > options.raw_size:
        scale = options.raw_size / min(width, height)
    elif options.max_side and max(width, height) > options.max_side:
        scale = options.max_side / max(width, height)
    else:
        return None
    return max(1, round(width * scale)), max(1, round(height * scale))


def _to_rgb(image: Image.Image, source_format: str = "") -> Image.Image:
    if image.mode.startswith("I;16") or image.mode == "I":
        image = _eight_bit(image, source_format)
    elif image.mode == "F":
        _check_float(image)
    try:
        return image.convert("RGB")
    except MemoryError:
        raise BadImageError(f"out of memory converting its {image.width}x{image.height} {image.mode} pixels to "
                            f"RGB") from None
    except Exception as e:  # noqa: BLE001 - as in _open: the file is bad, whatever PIL raised
        raise BadImageError(f"cannot convert {image.mode} to RGB: {type(e).__name__}: {e}".rstrip(": ")) from e


def _eight_bit(image: Image.Image, source_format: str) -> Image.Image:
    """A 16-bit gray image as 8-bit gray, keeping each pixel's high byte as OpenCV does when it reads
    one in colour (PIL's own conversion clips every value over 255 to white); refused where no value
    reaches 4096 (12 bits or fewer: 16 levels of gray or fewer, black under 256). 32-bit integer
    pixels ("I"): within 0..255 as they are; from a PNG (16 bits, as older PILs open them) as 16-bit
    ones; otherwise refused, as no scale is known for them."""
    values = _pixels(image)
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    if image.mode == "I" and source_format != "png" and 0 <= low and high <= 255:  # (a PNG's are 16-bit ones)
        return Image.fromarray(values.astype(np.uint8), "L")
    if image.mode == "I" and not (source_format == "png" and 0 <= low and high <= 65535):
        raise BadImageError(f"32-bit integer pixels from {low} to {high}: no 8-bit image without choosing a scale "
                            f"(convert it to 8 bits first)")
    if high < 4096:  # 12 bits or fewer in 16 (a sensor's or a scanner's): their high bytes are 16 levels or fewer
        raise BadImageError(f"16-bit pixels from {low} to {high}: their high bytes, the 8-bit image OpenCV reads, "
                            f"hold {(high >> 8) + 1} level(s){' (black)' if high < 256 else ''}; convert it to 8 "
                            f"bits with its own scale first")
    return Image.fromarray((values.astype(np.uint32) >> 8).astype(np.uint8), "L")


def _check_float(image: Image.Image):
    """32-bit float pixels ("F", TIFF) convert as PIL converts them (each value truncated to 0..255)
    where they lie on that scale; on another (0..1, say, which PIL's conversion turns black) or
    none (NaN), refused, as no scale is known for them."""
    values = _pixels(image)
    if not np.isfinite(values).all():
        raise BadImageError("32-bit float pixels that are not all finite (NaN or infinity): no 8-bit image "
                            "(convert it to 8 bits first)")
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if low < 0 or high > 255:
        raise BadImageError(f"32-bit float pixels from {low:g} to {high:g}: no 8-bit image without choosing a "
                            f"scale (convert it to 8 bits first)")
    if 0 < high <= 1:
        raise BadImageError(f"32-bit float pixels from {low:g} to {high:g} (a 0-1 scale?): an 8-bit image of them "
                            f"is black (convert it to 8 bits first)")


def _pixels(image: Image.Image) -> np.ndarray:
    """``image``'s pixels as an array; its failures as the image's."""
    try:
        return np.asarray(image)
    except MemoryError:
        raise BadImageError(f"out of memory reading its {image.width}x{image.height} {image.mode} pixels") from None
    except Exception as e:  # noqa: BLE001 - as in _open: the file is bad, whatever PIL raised
        raise BadImageError(f"cannot read its {image.mode} pixels: {e}") from e


def _encode_jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality, subsampling="4:4:4", progressive=False, optimize=False)
    return buffer.getvalue()


def _as_is(data: bytes, options: PackOptions):
    """(the JPEG itself, if the GPU engines take it and libjpeg-turbo decodes it without a single
    warning (the CPU path's decoder, in strict mode), else None, which sends it through conversion;
    libjpeg's complaint where the strict decode refused it)."""
    try:
        info = probe(data)
    except NotJpeg:
        return None, ""
    _check_pixels(info.width, info.height, options)
    if not info.gpu_ready or _target_size(info.width, info.height, options) is not None:
        return None, ""
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)
    except (ValueError, RuntimeError) as e:  # PIL decides whether it is readable at all, and conversion cleans it
        return None, " ".join(str(e).split()) or type(e).__name__
    if pixels.shape[:2] != (info.height, info.width):
        return None, ""
    return Prepared(data, fmt.CODEC_JPEG, info.width, info.height, info.components, info.subsampling, 0,
                    (info.width, info.height), "jpeg"), ""


def _oriented(data: bytes) -> bool:
    """Whether the image carries an EXIF orientation other than 'as stored' (1)."""
    try:
        with pil_open()(io.BytesIO(data)) as image:
            return image.getexif().get(0x0112, 1) not in (0, 1)
    except Exception:  # noqa: BLE001 - an unreadable file fails later, with its reason
        return False


def _first_picture(data: bytes) -> bytes:
    """A multi-picture JPEG's (``.mpo``, or a phone's ``.jpg`` holding a gain or depth map) first
    picture, the one PIL and OpenCV read, without the pictures after it; other bytes as they are
    (also where the first picture's size entry does not cut out an image of the same size)."""
    if b"MPF\x00" not in data[:65536]:
        return data
    try:
        with pil_open()(io.BytesIO(data)) as image:
            if image.format != "MPO":
                return data
            size, whole = int(image.mpinfo[0xB002][0]["Size"]), image.size
        first = data[:size]
        if not 0 < size < len(data) or first[-2:] != b"\xff\xd9":
            return data
        info = probe(first)
    except Exception:  # noqa: BLE001 - not a readable MPO: the bytes go on as they are, and fail or pass there
        return data
    return first if (info.width, info.height) == whole else data


def prepare(data: bytes, options: PackOptions) -> Prepared:
    """Validate one image file's bytes and return what to store; raises ``BadImageError``."""
    if len(data) == 0:
        raise BadImageError("empty file")
    whole = len(data)
    if is_jpeg(data):
        data = _first_picture(data)
    turned = options.exif_transpose and _oriented(data)
    warning = ""
    if options.codec == "jpeg" and is_jpeg(data) and not turned:
        stored, warning = _as_is(data, options)
        if stored is not None:  # (a multi-picture file's first picture: not the file byte for byte)
            return stored if len(data) == whole else replace(stored, flags=stored.flags | fmt.FLAG_CONVERTED)
    image = _open(data, options)
    source_format = (image.format or "").lower()
    if turned:
        image = ImageOps.exif_transpose(image)
    source_size = image.size
    size = _target_size(image.width, image.height, options)
    gray = image.mode in _GRAY_MODES
    rgb = _to_rgb(image, source_format)
    flags = fmt.FLAG_CONVERTED
    if size is not None:
        rgb = rgb.resize(size, Image.Resampling.BICUBIC)
        flags |= fmt.FLAG_RESIZED
    stored = rgb.getchannel("R") if gray else rgb
    if options.codec == "raw":
        return Prepared(stored.tobytes(), fmt.CODEC_RAW, stored.width, stored.height,
                        1 if gray else 3, fmt.SUBSAMPLING_NONE, flags, source_size, source_format, warning)
    payload = _encode_jpeg(stored, options.quality)
    check = probe(payload)
    return Prepared(payload, fmt.CODEC_JPEG, check.width, check.height, check.components,
                    check.subsampling, flags, source_size, source_format, warning)
