"""The one native piece: gdsdata/_hostdecode.c, the host Huffman loop (see that file). Optional: where
it cannot be built, gdsdata works without it and the GPU path decodes on the hardware engines alone."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("gdsdata._hostdecode", ["gdsdata/_hostdecode.c"], optional=True,
                             extra_compile_args=["-O2"])])
