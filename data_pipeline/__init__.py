"""Text -> tokens -> batches. Until the indexed-dataset pipeline lands, training reads a
deterministic byte-level token stream built from real text (see :mod:`data_pipeline.text_stream`)."""
