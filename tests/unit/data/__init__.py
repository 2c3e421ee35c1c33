"""The data pipeline: config, preprocessing, mixtures, packing, groups, integrity."""
