"""Staging -> pixels: libjpeg-turbo on the CPU (``cpu``), nvJPEG on the GPU (``gpu``)."""
