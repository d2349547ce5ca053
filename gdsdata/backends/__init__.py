"""A dataset's two paths, the same protocol each: ``read(indices) -> Staged`` (the storage half,
on the Loader's I/O thread), ``decode(staged, stream) -> PixelBatch`` (on its decode thread),
``release(staged)``, ``load_batch``, ``load_path`` and ``close``: ``cpu`` and ``gpu``."""
