"""Text -> tokens -> batches: sample corpora (``samples/``), tokenizer, DataTrove preprocessing
into megatron indexed datasets (``preprocess``), corpus registry and mixtures (``config``),
long-context packing (``packing``) and the runtime blended datasets a run trains on (``build``)."""
