"""One cuDNN and one FA3 decode call at a shape, for a profiler to look at (no timing here).

    ncu --kernel-name regex:'(?i)(cudnn|fmha|flash|attn)' --launch-count 4 \
        python3 bench/ncu_probe.py --shape 16,32,8,128,32768
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="16,32,8,128,32768", help="batch,hq,hkv,d,L")
args = ap.parse_args()
b, hq, hkv, d, L = map(int, args.shape.split(","))
kw = dict(device="cuda", dtype=torch.bfloat16)
q = torch.randn(b, hq, 1, d, **kw)
k = torch.randn(b, hkv, L, d, **kw)
v = torch.randn(b, hkv, L, d, **kw)
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    for _ in range(2):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
try:
    from fa3_fwd_interface import flash_attn_with_kvcache

    qf = q.transpose(1, 2).contiguous()
    kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    for _ in range(2):
        flash_attn_with_kvcache(qf, kf, vf, num_splits=0)
except ImportError as e:
    print(f"fa3: {e}")
torch.cuda.synchronize()
