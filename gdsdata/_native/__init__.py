"""Private ctypes bindings: nvJPEG's batched decoder (``nvjpeg``), the CUDA driver's batched copy
(``cuda``) and Linux native AIO for ``O_DIRECT`` reads (``aio``)."""
