"""The on-disk format: the byte layout (``layout``: magic, version, record dtypes), the index
(``index``), shard files (``shards``), and writing a dataset safely (``lock``: one writer at a time,
datasets swapped in only when complete). The layout's names are re-exported here."""

from gdsdata.format.layout import *  # noqa: F401,F403
