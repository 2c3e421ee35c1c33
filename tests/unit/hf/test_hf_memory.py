"""Import memory: a synthetic multi-shard GLM-5 checkpoint (~300 MB fp32, 64 MB shards) is
imported while a thread samples the process RSS; the growth over the RSS before the import
must stay below one shard plus one layer's tensors (and far below the model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.launch import REPO

SHARD = 64 * 2**20
CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
              num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
              n_routed_experts=16, num_experts_per_tok=2, kv_lora_rank=128, q_lora_rank=256,
              qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, index_topk=64,
              index_head_dim=32, index_n_heads=4, first_k_dense_replace=1,
              max_position_embeddings=4096)

MAKE = r"""
import json, os, sys
import torch
from safetensors.torch import save_file
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

cfg = GlmMoeDsaConfig(**json.loads(sys.argv[1]))
hf_dir, shard = sys.argv[2], int(sys.argv[3])
with torch.device("meta"):
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in GlmMoeDsaForCausalLM(cfg).state_dict().items()}
cfg.save_pretrained(hf_dir)
names = {}
for k, (shape, dtype) in shapes.items():  # the per-expert layout save_pretrained writes
    if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
        base = k.rsplit(".", 1)[0]
        for e in range(shape[0]):
            if k.endswith("gate_up_proj"):
                names[f"{base}.{e}.gate_proj.weight"] = ((shape[1] // 2, shape[2]), dtype)
                names[f"{base}.{e}.up_proj.weight"] = ((shape[1] // 2, shape[2]), dtype)
            else:
                names[f"{base}.{e}.down_proj.weight"] = ((shape[1], shape[2]), dtype)
    else:
        names[k] = (shape, dtype)
layers, shards, buf, size, where = {}, 0, {}, 0, {}
def flush():
    global buf, size, shards
    fname = f"model-{shards:05d}.safetensors"
    save_file(buf, os.path.join(hf_dir, fname), metadata={"format": "pt"})
    where.update({k: fname for k in buf})
    shards, buf, size = shards + 1, {}, 0
for k, (shape, dtype) in names.items():
    t = torch.randn(shape).to(dtype) * 0.02
    n = t.numel() * t.element_size()
    parts = k.split(".")
    group = ".".join(parts[:3]) if parts[1] == "layers" else k
    layers[group] = layers.get(group, 0) + n
    if buf and size + n > shard:
        flush()
    buf[k], size = t, size + n
flush()
json.dump({"weight_map": where}, open(os.path.join(hf_dir, "model.safetensors.index.json"), "w"))
sizes = [os.path.getsize(os.path.join(hf_dir, f)) for f in set(where.values())]
print(json.dumps({"model": sum(layers.values()), "max_layer": max(layers.values()),
                  "max_shard": max(sizes), "shards": len(sizes)}))
"""

#: a fresh process: everything imported and set up, then the import alone, measured by the
#: kernel's RSS high-water mark (VmHWM, reset to the current RSS just before) and by a 2 ms sampler
IMPORT = r"""
import json, sys, threading, time, warnings
import psutil
from model_providers.glm5.hf.convert import ensure_one_rank, import_hf
import transformers.models.glm_moe_dsa.modeling_glm_moe_dsa
ensure_one_rank()

def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))

proc = psutil.Process()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark to the current RSS
base, peak, done = proc.memory_info().rss, [0], []
before = hwm()
def sample():
    while not done:
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.002)
th = threading.Thread(target=sample)
th.start()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import_hf(sys.argv[1], sys.argv[2], mtp_num_steps=0)
done.append(1)
th.join()
print(json.dumps({"base": base, "peak": peak[0], "hwm_before": before, "hwm_after": hwm()}))
"""


def _run(code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.heavy
@pytest.mark.heavy
def test_import_peak_rss_is_one_shard_plus_one_layer(tmp_path):
    m = _run(MAKE, json.dumps(CONFIG), str(tmp_path / "hf"), str(SHARD))
    r = _run(IMPORT, str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    sampled = r["peak"] - r["base"]
    kernel = r["hwm_after"] - r["base"]
    mib = 2**20
    print(f"\nimport of a {m['model'] / mib:.0f} MiB model in {m['shards']} shards (largest "
          f"{m['max_shard'] / mib:.0f} MiB, largest layer {m['max_layer'] / mib:.0f} MiB): RSS "
          f"{r['base'] / mib:.0f} MiB before; growth: sampled {sampled / mib:.0f} MiB, kernel peak "
          f"{kernel / mib:.0f} MiB (VmHWM {r['hwm_before'] / mib:.0f} -> {r['hwm_after'] / mib:.0f} MiB)")
    assert abs(r["hwm_before"] - r["base"]) < 8 * mib  # the reset worked
    assert m["shards"] >= 4 and m["model"] > 3 * (m["max_shard"] + m["max_layer"]) / 2
    assert max(sampled, kernel) < m["max_shard"] + m["max_layer"]
    assert (tmp_path / "ckpt" / "metadata.json").exists()
