"""Storage -> staging: a batch's reads planned (``plan``), read into host memory on the CPU path
(``cpu``) or into pinned or GPU staging on the GPU path (``gpu``), and the path a dataset takes
(``path``)."""
