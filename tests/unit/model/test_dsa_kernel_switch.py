"""``model.dsa.kernels``: the sparse DSA layer with the Triton kernels (run by the Triton CPU
interpreter) equals the layer with the torch kernels, outputs and gradients, for packed documents
(the dense prefix's packed attention through the document-attention kernel included);
the top-k from the Triton indexer equals the torch one (bf16 and fp8, packed documents and
context-parallel positions, on integer data whose logits both compute exactly, ties included);
auto does not pick Triton on the CPU; a value the run cannot honour is refused before any compute."""

import pytest
import json
import os
import subprocess
import sys


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_SCRIPT = r"""
import json, torch
import model_providers.glm5.model.dsa.attention as attention
import model_providers.glm5.model.dsa.dense_attention as dense_attention
import model_providers.glm5.model.dsa.indexer as indexer
import model_providers.glm5.model.dsa.kernels as kernels
from parallel.config import ParallelConfig
from parallel.initialize import initialize
from tests.support.dsa_layer import outputs_per_kernel_choice
from model_providers.glm5.model.dsa.kernels.interpreter import bf16_as_on_gpu

bf16_as_on_gpu()

initialize(ParallelConfig(), seed=1)
calls = {"attention": 0, "indexer": 0, "dense": 0}

def counted(name, fn):
    def run(*a, **k):
        calls[name] += 1
        return fn(*a, **k)
    return run

attention.sparse_mla_triton = counted("attention", attention.sparse_mla_triton)
kernels.index_logits_triton = counted("indexer", kernels.index_logits_triton)
dense_attention.document_attention_triton = counted("dense", dense_attention.document_attention_triton)
res = outputs_per_kernel_choice(("torch", "triton"))
from model_providers.glm5.model.dsa.visibility import TokenLayout
from parallel.context_parallel import zigzag_positions
g = torch.Generator().manual_seed(0)
same_topk = []
for dtype, d in (("bf16", 16), ("fp8", 128)):
    for q_pos in (None, zigzag_positions(16, 2, 1)):
        L = 32
        s = L if q_pos is None else len(q_pos)
        layout = TokenLayout.build(s, L, torch.tensor([[0] * 11 + [1] * 21, [0] * 25 + [1] * 7]), q_pos)
        q = torch.randint(-2, 3, (2, s, 3, d), generator=g).float()
        k = torch.randint(-2, 3, (2, L, d), generator=g).float()
        w = torch.randint(1, 3, (2, s, 3), generator=g).float()
        a = indexer.select_topk(q[:, 3:], k, w[:, 3:], 9, 5, dtype, 3, layout, triton=False)
        b = indexer.select_topk(q[:, 3:], k, w[:, 3:], 9, 5, dtype, 3, layout, triton=True)
        same_topk.append(bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])))
worst = max(float(((a - b).abs() / (b.abs().max() + 1e-12)).max()) for a, b in zip(res["triton"], res["torch"]))
print(json.dumps({"worst": worst, "calls": calls, "same_topk": same_topk, "auto_on_cpu": attention.use_triton_kernels("auto", torch.zeros(1))}))
"""


@pytest.mark.heavy
def test_triton_kernels_in_the_layer_equal_torch_kernels():
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert min(res["calls"].values()) >= 1, res
    assert res["worst"] <= 1e-5, res
    assert res["same_topk"] == [True] * 4, res
    assert res["auto_on_cpu"] is False


def test_kernel_choice_is_validated_before_compute(monkeypatch):
    from model_providers.glm5.model.config import DSAConfig, GLM5Config, check_model

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bad = check_model(GLM5Config(dsa=DSAConfig(kernels="cuda")), *_check_args())
    assert any("model.dsa.kernels='cuda' must be auto, torch or triton" in p for p in bad), bad
    no_gpu = check_model(GLM5Config(dsa=DSAConfig(kernels="triton")), *_check_args())
    assert any("model.dsa.kernels=triton needs triton and CUDA" in p for p in no_gpu), no_gpu
    assert not check_model(GLM5Config(dsa=DSAConfig(kernels="auto")), *_check_args())


def _check_args():
    from model_providers.glm5.model.config import PrecisionConfig

    return PrecisionConfig(), 1024
