"""A/B of two builds of attention.cpp: CPU time per call at decode shapes, and whether the outputs are bitwise equal.

Run once per build (swap the source in between; the kernel cache keys builds by content):
  python benchmarks/attention_ab.py old.pt            # with the old attention.cpp
  python benchmarks/attention_ab.py new.pt old.pt     # with the new one: times, then "bitwise equal: True/False"
"""
import sys, time, torch
from conveyor.kernels import resolve_backend
torch.manual_seed(0)
torch.set_num_threads(1)
a = resolve_backend(torch.device("cpu"), torch.bfloat16, batch_invariant=True).attention
outs = {}
def case(H, KVH, D, S, ctx, bs=16, reps=3):
    nb = -(-ctx // bs)
    g = torch.Generator().manual_seed(H * 1000 + D + ctx)
    kc = torch.randn(nb * S, bs, KVH, D, generator=g).bfloat16(); vc = torch.randn(nb * S, bs, KVH, D, generator=g).bfloat16()
    tables = torch.tensor([[s * nb + i for i in range(nb)] for s in range(S)], dtype=torch.int32)
    seq = torch.arange(S, dtype=torch.int32); pos = torch.tensor([ctx - 1 - 7 * s for s in range(S)], dtype=torch.int32)
    q = torch.randn(S, H, D, generator=g).bfloat16()
    out = a.paged_attention(q, kc, vc, tables, seq, pos, D ** -0.5, 0, 0.0, None)
    t = time.process_time()
    for _ in range(reps): a.paged_attention(q, kc, vc, tables, seq, pos, D ** -0.5, 0, 0.0, None)
    dt = (time.process_time() - t) / reps
    outs[(H, KVH, D, S, ctx)] = out
    print(f"{H}/{KVH}/{D} S={S} ctx={ctx}: {dt*1e3:.1f} ms cpu")
for c in [(32, 8, 64, 16, 2048), (9, 3, 64, 16, 4096), (16, 2, 128, 8, 2048), (8, 2, 256, 8, 1024), (9, 3, 64, 4, 37), (4, 1, 64, 16, 1000)]:
    case(*c)
torch.save(outs, sys.argv[1])
if len(sys.argv) > 2:
    ref = torch.load(sys.argv[2])
    print("bitwise equal:", all(torch.equal(ref[k], outs[k]) for k in ref))
