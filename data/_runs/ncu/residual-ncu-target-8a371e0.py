# ncu target (session 64): one residual GEMV plan at 4096 x 28672 (4096 + 256), batch 1, launched 4 times
# (the first compiles); PLAN = "table" (v3, tensor-core build, G = 8, the tuner's pick on the H200) or "split".
import os, sys, torch
sys.path.insert(0, os.getcwd())
from trapetum import residual as R
plans = {"table": dict(kind="table", build="mma", G=8, RB=8, warps=16, ksplit=16, main="shared"),
         "split": dict(kind="split", warps=8, RB=1, ksplit=1)}
t = R.random_residual_tensor(28672, 4096, 4096, 256, seed=0, device="cuda")
g = R.ResidualGemv(t, plan=plans[os.environ["PLAN"]])
x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
for _ in range(4):
    y = g(x)
torch.cuda.synchronize()
print(os.environ["PLAN"], g.plan(1))
