"""Triton's CPU interpreter (TRITON_INTERPRET=1) made to compute bf16 as a GPU does, for running
the kernels here on CPU: the tests and ``make gpu-check ARGS="--device cpu"``."""


def bf16_as_on_gpu() -> None:
    """triton 3.9's interpreter holds bf16 as raw uint16 bits and (1) ``tl.dot`` multiplies
    those bits as integers, (2) casts fp32 -> bf16 by truncation. A GPU multiplies the values
    (exact products, fp32 sums) and rounds to nearest even: make the interpreter do that. For the
    interpreter only (the tests, ``gpu-check --device cpu``); the kernels carry no interpreter
    branches. (triton-lang/triton#11584: the interpreter does not support bf16 arithmetic;
    loads, stores, transposes and casts are what we use.)"""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    dot, cast = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            u = np.asarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            return TensorHandle(((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = create_dot, cast_impl
