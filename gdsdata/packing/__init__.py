"""Packing: what a source holds (``sources``), each image validated and normalised (``prepare``,
``jpeg``), written into shards with journals (``packer``), parts joined (``merge``) and packed on
a Ray cluster (``ray``)."""
