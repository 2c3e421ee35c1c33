"""``python -m benchmarks.gpu_check [--device cuda|cpu] [--json PATH]`` (``make gpu-check``): the
one command for a fresh GPU node (one GPU, no data files, no network; budget <= 8 minutes on an
H200). It writes one JSON (``benchmarks/results/gpu-<date>-<gpu>.json`` unless ``--json``) and
prints a table of:

1. ``environment``: Python, torch, CUDA, GPU, triton, Transformer Engine, megatron-core, apex;
2. ``tiny_dense`` / ``tiny_warmup`` / ``tiny_sparse`` (and ``tiny_te_dense`` where TE imports):
   the tiny GLM-5 in bf16 for ``--steps`` steps through the training step itself (megatron DDP,
   optimizer, schedule, loss) on a fixed synthetic batch, in each DSA mode
   (:mod:`model_providers.glm5.model.dsa.modes`): losses finite and falling (the LM loss; in
   warm-up, where only the indexers train, their KL), time, grad norm and host syncs per step;
3. ``kernel_*``: each Triton kernel against its torch reference (norm-relative error, or for the
   indexer logits max |diff| / max |ref|, under the entry's ``tol``) and, on a GPU, its time and
   TFLOP/s at GLM-5 shapes next to ``flash_sdpa`` (dense causal SDPA at GLM-5's dense MLA head,
   64 x 256, measured in the same run): sparse MLA forward and backward, the indexer logits in
   fp8 and bf16, the fused indexer KL, packed-document dense attention. A kernel module that does
   not import is a failed entry carrying the import error;
4. ``slice_dense_4k`` / ``slice_sparse_32k``: a real-width GLM-5 slice -- ``conf/model/glm5_744b``
   with 2 MoE layers of 16 of the 256 experts (one EP16 rank's share, ``slice.SLICE_EXPERTS``), no
   MTP, bf16, built by the model provider from the composed Hydra config -- forward + backward of
   one sequence at 4K (DSA dense) and 32K (sparse): time, TFLOP/s (``counting.flops``' exact
   count), peak memory, and the planner's prediction for the same run config next to each
   (``planner.step_time`` on a one-GPU layout of the node's cluster preset: its step time less
   the optimizer step and DP time; its peak memory: weights, gradients and activations).

The JSON is rewritten (atomically) after every part, so a run killed at its time limit leaves
every finished part; ``--budget-s N`` skips, and records as skipped, a part whose estimate
(``ESTIMATE_S``) exceeds the time left. ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
is set unless the environment sets it.

``--device cpu`` runs the same code at small sizes: the strict CUDA emulation for the training
steps, the Triton kernels in the interpreter (``TRITON_INTERPRET=1``, set here before any kernel
module is imported; fp32 inputs but for the bf16 indexer), the tiny GLM-5 as the slice. The test
suite runs it (``tests/e2e/test_gpu_check.py``). Every part records its own error and the run goes
on; the exit status is 1 if any part failed.
"""
