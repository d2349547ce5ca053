"""Private ctypes bindings: nvJPEG's batched decoder (``nvjpeg``) and the CUDA driver's batched copy
(``cuda``)."""
