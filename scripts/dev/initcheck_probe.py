import torch
a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
c = torch.mm(a, a)          # cuBLAS on sm90 writes its output with TMA stores
torch.cuda.synchronize()
print("sum", c.float().sum().item())
