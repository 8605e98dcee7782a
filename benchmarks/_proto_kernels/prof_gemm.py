import time, numpy as np, torch, numba
torch.set_num_threads(2); numba.set_num_threads(2)
from bitserve.kernels.cpu import ternary as K
from bitserve.kernels.cpu import backend as B
from gemv2 import bench

def chunked(a, w, scale, m, chunk_bytes, orient):
    kp = a.shape[1]
    rows = max(16, chunk_bytes // (4 * kp))
    buf = torch.empty(min(rows, m), kp)
    if orient == 0:
        out_t = torch.empty(m, a.shape[0])
        for r0 in range(0, m, rows):
            ch = buf[: min(rows, m - r0)]
            K.decode_values_f32(w, r0, scale, ch.numpy())
            torch.mm(ch, a.t(), out=out_t[r0:r0 + ch.shape[0]])
        return out_t.t().contiguous()
    out = torch.empty(a.shape[0], m)
    for r0 in range(0, m, rows):
        ch = buf[: min(rows, m - r0)]
        K.decode_values_f32(w, r0, scale, ch.numpy())
        out[:, r0:r0 + ch.shape[0]] = torch.mm(a, ch.t())
    return out

rng = np.random.default_rng(0)
for M, Kd in [(2560, 2560), (2560, 6912), (6912, 2560)]:
    vals = torch.from_numpy(rng.integers(-1, 2, size=(M, Kd)).astype(np.int8))
    w = K.pack_ternary(vals).numpy()
    ones = np.ones((1, 1), np.float32)
    for T in (16, 64, 256):
        a = torch.randn(T, Kd).round()
        res = []
        full = torch.empty(M, Kd)
        ms = bench(K.decode_values_f32, w, 0, ones, full.numpy(), n=5); res.append(f"decode_all {ms[0]:.2f}")
        ms = bench(lambda: torch.mm(a, full.t()), n=5); res.append(f"mm_all {ms[0]:.2f}")
        for cb in (1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22):
            for o in (0, 1):
                ms = bench(chunked, a, w, ones, M, cb, o, n=5); res.append(f"c{cb >> 10}k/o{o} {ms[0]:.2f}")
        x = torch.randn(T, Kd); W = torch.randn(M, Kd)
        ms = bench(lambda: torch.nn.functional.linear(x, W), n=5); res.append(f"torch {ms[0]:.2f}")
        print(M, Kd, T, " | ".join(res), flush=True)
