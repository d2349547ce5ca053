"""Reading a JPEG's marker segments: the properties the GPU decoder needs, without decoding pixels.

nvJPEG's hardware engines decode baseline (SOF0), 8-bit, single-scan, Huffman-coded JPEGs with one
(gray) or three (YCbCr) components and 4:4:4, 4:2:2, 4:2:0 or 4:4:0 chroma subsampling. ``probe``
reads the headers of a bitstream and says whether it qualifies and, if not, why.
"""

from dataclasses import dataclass

from gdsdata.format import layout as fmt

_SOF_BASELINE = 0xC0
_SOF_MARKERS = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG and DAC are not SOFs
_STANDALONE = set(range(0xD0, 0xD8)) | {0x01, 0xD8}  # RSTn, TEM, SOI carry no length
_SOS, _EOI, _APP14 = 0xDA, 0xD9, 0xEE
_SOF_KIND = {
    0xC0: "baseline", 0xC1: "extended sequential", 0xC2: "progressive", 0xC3: "lossless",
    0xC5: "differential sequential", 0xC6: "differential progressive", 0xC7: "differential lossless",
    0xC9: "arithmetic sequential", 0xCA: "arithmetic progressive", 0xCB: "arithmetic lossless",
    0xCD: "arithmetic differential sequential", 0xCE: "arithmetic differential progressive",
    0xCF: "arithmetic differential lossless",
}
_CHROMA = {  # luma sampling factors (h, v) relative to chroma -> subsampling
    (1, 1): fmt.SUBSAMPLING_444, (2, 1): fmt.SUBSAMPLING_422, (2, 2): fmt.SUBSAMPLING_420,
    (1, 2): fmt.SUBSAMPLING_440, (4, 1): fmt.SUBSAMPLING_411, (4, 2): fmt.SUBSAMPLING_410,
}
_GPU_SUBSAMPLING = {fmt.SUBSAMPLING_444, fmt.SUBSAMPLING_422, fmt.SUBSAMPLING_420,
                    fmt.SUBSAMPLING_440, fmt.SUBSAMPLING_GRAY}


@dataclass(frozen=True)
class JpegInfo:
    width: int
    height: int
    components: int
    subsampling: int  # a format.SUBSAMPLING_* value, or -1 when the layout has none
    gpu_ready: bool
    reason: str  # why the stream does not qualify for the GPU fast path ("" when it does)


class NotJpeg(ValueError):
    """The bytes are not a parseable JPEG stream."""


def is_jpeg(data) -> bool:
    return len(data) >= 3 and data[0] == 0xFF and data[1] == 0xD8 and data[2] == 0xFF


def _subsampling(factors):
    if len(factors) == 1:
        return fmt.SUBSAMPLING_GRAY
    if len(factors) != 3 or factors[1] != factors[2]:
        return -1
    (hy, vy), (hc, vc) = factors[0], factors[1]
    if hy % hc or vy % vc:
        return -1
    return _CHROMA.get((hy // hc, vy // vc), -1)


def _next_marker(data, pos):
    """Position of the next marker after entropy-coded data starting at pos (skips FF00 and RSTn)."""
    end = len(data)
    while True:
        pos = data.find(b"\xff", pos)
        if pos < 0 or pos + 1 >= end:
            return -1
        following = data[pos + 1]
        if following == 0x00 or 0xD0 <= following <= 0xD7 or following == 0xFF:
            pos += 1
            continue
        return pos


def probe(data) -> JpegInfo:
    """Parse the marker segments of a JPEG bitstream; raises ``NotJpeg`` if they are malformed."""
    data = bytes(data) if not isinstance(data, bytes) else data
    if not is_jpeg(data):
        raise NotJpeg("no JPEG start-of-image marker")
    pos, end = 2, len(data)
    sof = None
    factors = []
    width = height = components = precision = 0
    scans = 0
    adobe_transform = None
    component_ids = ()
    while True:
        if pos + 1 >= end:
            raise NotJpeg("stream ends before the end-of-image marker")
        if data[pos] != 0xFF:
            raise NotJpeg(f"expected a marker at byte {pos}")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == _EOI:
            break
        if marker in _STANDALONE:
            pos += 2
            continue
        if pos + 4 > end:
            raise NotJpeg("stream ends inside a marker segment")
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if length < 2 or pos + 2 + length > end:
            raise NotJpeg(f"marker segment 0x{marker:02X} at byte {pos} runs past the end")
        body = data[pos + 4:pos + 2 + length]
        if marker in _SOF_MARKERS:
            if sof is not None:
                raise NotJpeg("more than one frame header")
            if len(body) < 6:
                raise NotJpeg("frame header too short")
            sof = marker
            precision = body[0]
            height = int.from_bytes(body[1:3], "big")
            width = int.from_bytes(body[3:5], "big")
            components = body[5]
            if len(body) < 6 + 3 * components:
                raise NotJpeg("frame header too short for its components")
            factors = [(body[7 + 3 * i] >> 4, body[7 + 3 * i] & 15) for i in range(components)]
            component_ids = tuple(body[6 + 3 * i] for i in range(components))
        elif marker == _APP14 and body[:5] == b"Adobe" and len(body) >= 12:
            adobe_transform = body[11]
        pos += 2 + length
        if marker == _SOS:
            scans += 1
            pos = _next_marker(data, pos)
            if pos < 0:
                raise NotJpeg("stream ends inside entropy-coded data (truncated)")
    if sof is None:
        raise NotJpeg("no frame header")
    if width == 0 or height == 0:
        raise NotJpeg("frame header gives a zero width or height")
    subsampling = _subsampling(factors)
    reason = ""
    if sof != _SOF_BASELINE:
        reason = f"{_SOF_KIND.get(sof, 'unknown')} JPEG (GPU engines need baseline)"
    elif precision != 8:
        reason = f"{precision}-bit samples (GPU engines need 8-bit)"
    elif components not in (1, 3):
        reason = f"{components} components (CMYK/YCCK or other)"
    elif scans != 1:
        reason = f"{scans} scans (GPU engines need a single scan)"
    elif components == 3 and (adobe_transform == 0 or component_ids == (82, 71, 66)):
        reason = "RGB colour space (GPU decoding assumes YCbCr)"
    elif subsampling not in _GPU_SUBSAMPLING:
        name = fmt.SUBSAMPLING_NAMES.get(subsampling, "irregular")
        reason = f"chroma subsampling {name} (GPU engines need 4:4:4, 4:2:2, 4:2:0, 4:4:0 or gray)"
    return JpegInfo(width, height, components, subsampling, reason == "", reason)
