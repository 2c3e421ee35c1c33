"""The network: architecture against GLM-5's numbers, DSA pieces against references, kernels."""
