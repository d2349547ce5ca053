"""Every GPU kernel compiles for the H200's architecture (sm_90) on a machine without a GPU, as Triton
compiles it there: Triton's interpreter, which runs the pixel tests on the CPU, accepts programs its
compiler refuses (a helper returning int32 on one branch and int64 on the other, say)."""

import inspect

import pytest
from conftest import release

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
NORM = {f"{name}{c}": "fp32" for name in "sb" for c in range(3)}  # per-channel scale and shift


def kernels():
    """(kernel, argument types, constexpr values) for each variant the library launches."""
    from gdsdata.io import checksums as C
    from gdsdata.transforms import kernels as K

    rows, cols = K._tile(224)
    for nchw in (True, False):
        for out in ("*fp16", "*bf16", "*fp32", "*u8"):  # the transforms' dtypes
            flags = {"NCHW": nchw, "TO_U8": out == "*u8"}
            yield K._bilinear, {"src": "*u8", "meta": "*i64", "out": out, "out_h": "i32", "out_w": "i32",
                                **NORM}, {**flags, "BLOCK": K._BLOCK}
            yield K._aa_columns, {"meta": "*i64", "tmp": "*fp16", "out": out, "out_h": "i32", "out_w": "i32",
                                  **NORM}, {**flags, "ROWS": rows, "COLS": cols}
    for rgb in (True, False):  # every image of the batch RGB, or some grayscale
        yield K._aa_rows, {"src": "*u8", "meta": "*i64", "tmp": "*fp16", "out_w": "i32"}, \
            {"ROWS": rows, "COLS": cols, "RGB": rgb}
    for hsv in (True, False):
        for out in ("*u8", "*fp16", "*fp32"):
            yield K._detect, {"src": "*u8", "offsets": "*i64", "channels": "*i64", "inverse": "*fp32",
                              "centre": "*fp32", "slots": "*fp32", "gains": "*fp32", "out": out, "height": "i32",
                              "width": "i32", "pad": "fp32"}, {"HSV": hsv, "TO_U8": out == "*u8", "BLOCK": K._BLOCK}
    yield C._chunks, {"words": "*i32", "starts": "*i64", "count": "i32", "tables": "*i32", "out": "*i32"}, \
        {"WORDS": C.CHUNK // 4, "BLOCK": C._BLOCK}
    yield C._combine, {"data": "*u8", "offsets": "*i64", "lengths": "*i64", "first": "*i64", "chunk_crcs": "*i32",
                       "columns": "*i32", "tables": "*i32", "out": "*i32", "count": "i32", "most_chunks": "i32"}, \
        {"CHUNK_BYTES": C.CHUNK, "BLOCK": C._BLOCK}


@pytest.mark.parametrize("kernel, args, constants", list(kernels()),
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else None)
def test_the_gpu_kernels_compile_for_hopper(kernel, args, constants):
    marked = {**args, **{name: "constexpr" for name in constants}}
    if "constexprs" in inspect.signature(ASTSource).parameters:  # Triton 3.3 on (torch 2.7)
        source = ASTSource(fn=kernel, signature=marked, constexprs=constants)
    elif release(triton) >= (3, 2):  # torch 2.6
        source = ASTSource(fn=kernel, signature=marked, constants=constants)
    else:  # Triton 3.0-3.1 (torch 2.4-2.5): by position
        at = kernel.arg_names.index
        source = ASTSource(fn=kernel, signature={at(name): kind for name, kind in args.items()},
                           constants={at(name): value for name, value in constants.items()})
    compiled = triton.compile(source, target=HOPPER)
    assert compiled.asm.get("cubin"), kernel.__name__
