"""What the ``gdsdata`` commands do besides pack and merge: ``doctor`` (what this machine gives the
GPU path), ``info`` (what a dataset holds; ``gdsdata inspect``) and ``verify`` (every checksum,
every sample decodes)."""
