import time, os, numpy as np, numba as nb, torch, sys
from numba import njit, prange
torch.set_num_threads(2)
nb.set_num_threads(2)
from gemv2 import bench
from round2 import decode_row16, scr_1d

I32 = np.int32

@njit(parallel=True, nogil=True, cache=True)
def tr_1d(w, qp, out):
    M, Kb = w.shape
    T, Kp = qp.shape
    ng = Kb // 32
    RB = 16
    nrb = (M + RB - 1) // RB
    for rb in prange(nrb):
        buf = np.empty(Kp, qp.dtype)
        for r in range(rb * RB, min(M, rb * RB + RB)):
            decode_row16(w, r, ng, buf)
            for t in range(T):
                qt = qp[t]
                acc = np.int32(0)
                for k in range(Kp):
                    acc = np.int32(acc + np.int32(buf[k]) * np.int32(qt[k]))
                out[t, r] = acc

@njit(parallel=True, nogil=True, cache=True)
def tr_t2(w, qp, out):
    M, Kb = w.shape
    T, Kp = qp.shape
    ng = Kb // 32
    RB = 16
    nrb = (M + RB - 1) // RB
    for rb in prange(nrb):
        buf = np.empty(Kp, qp.dtype)
        for r in range(rb * RB, min(M, rb * RB + RB)):
            decode_row16(w, r, ng, buf)
            t = 0
            while t + 2 <= T:
                q0 = qp[t]; q1 = qp[t + 1]
                a0 = np.int32(0); a1 = np.int32(0)
                for k in range(Kp):
                    c = np.int32(buf[k])
                    a0 = np.int32(a0 + c * np.int32(q0[k]))
                    a1 = np.int32(a1 + c * np.int32(q1[k]))
                out[t, r] = a0; out[t + 1, r] = a1
                t += 2
            while t < T:
                qt = qp[t]
                acc = np.int32(0)
                for k in range(Kp):
                    acc = np.int32(acc + np.int32(buf[k]) * np.int32(qt[k]))
                out[t, r] = acc
                t += 1

@njit(parallel=True, nogil=True, cache=True)
def tr_r2t2(w, qp, out):
    # 2 rows x 2 tokens register block
    M, Kb = w.shape
    T, Kp = qp.shape
    ng = Kb // 32
    RB = 16
    nrb = (M + RB - 1) // RB
    for rb in prange(nrb):
        b0 = np.empty(Kp, qp.dtype)
        b1 = np.empty(Kp, qp.dtype)
        r = rb * RB
        rend = min(M, rb * RB + RB)
        while r < rend:
            two = r + 1 < rend
            decode_row16(w, r, ng, b0)
            if two:
                decode_row16(w, r + 1, ng, b1)
            else:
                b1[:] = 0
            t = 0
            while t < T:
                q0 = qp[t]
                q1 = qp[t + 1] if t + 1 < T else qp[t]
                a00 = np.int32(0); a01 = np.int32(0); a10 = np.int32(0); a11 = np.int32(0)
                for k in range(Kp):
                    c0 = np.int32(b0[k]); c1 = np.int32(b1[k])
                    x0 = np.int32(q0[k]); x1 = np.int32(q1[k])
                    a00 = np.int32(a00 + c0 * x0)
                    a01 = np.int32(a01 + c0 * x1)
                    a10 = np.int32(a10 + c1 * x0)
                    a11 = np.int32(a11 + c1 * x1)
                out[t, r] = a00
                if two:
                    out[t, r + 1] = a10
                if t + 1 < T:
                    out[t + 1, r] = a01
                    if two:
                        out[t + 1, r + 1] = a11
                t += 2
            r += 2

@njit(parallel=True, nogil=True, cache=True)
def tr_fused(w, qp, out):
    M, Kb = w.shape
    T = qp.shape[0]
    ng = Kb // 32
    for r in prange(M):
        for t in range(T):
            acc = np.int32(0)
            qt = qp[t]
            for g in range(ng):
                bb = g * 32
                bq = g * 128
                for m in range(32):
                    b = np.int32(w[r, bb + m])
                    acc = np.int32(acc + (b & 3) * np.int32(qt[bq + m]) + ((b >> 2) & 3) * np.int32(qt[bq + 32 + m])
                                  + ((b >> 4) & 3) * np.int32(qt[bq + 64 + m]) + (b >> 6) * np.int32(qt[bq + 96 + m]))
            out[t, r] = acc

@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def f32_1d(w, qp, out):
    M, Kb = w.shape
    T, Kp = qp.shape
    ng = Kb // 32
    RB = 16
    nrb = (M + RB - 1) // RB
    for rb in prange(nrb):
        buf = np.empty(Kp, np.float32)
        for r in range(rb * RB, min(M, rb * RB + RB)):
            decode_row16(w, r, ng, buf)
            for t in range(T):
                qt = qp[t]
                acc = np.float32(0)
                for k in range(Kp):
                    acc += buf[k] * qt[k]
                out[t, r] = acc

def main():
    rng = np.random.default_rng(0)
    for M, K in [(2560, 2560), (2560, 6912), (6912, 2560), (640, 2560)]:
        t = rng.integers(-1, 2, size=(M, K)).astype(np.int8)
        codes = (t + 1).astype(np.uint8).reshape(M, K // 4, 4)
        w = (codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)).astype(np.uint8)
        for T in (1, 8, 64):
            q = rng.integers(-128, 128, size=(T, K)).astype(np.int8)
            qp = q.reshape(T, K // 128, 32, 4).transpose(0, 1, 3, 2).reshape(T, K).copy()
            ref = q.astype(np.int64) @ t.astype(np.int64).T
            A = q.astype(np.int64).sum(1)[:, None]
            out = np.zeros((T, M), np.int32)
            res = []
            qp16 = qp.astype(np.int16)
            for name, f, args in [("scr_1d", scr_1d, (w, qp16, out)), ("tr16", tr_1d, (w, qp16, out)), ("tr8", tr_1d, (w, qp, out)),
                                  ("t2_16", tr_t2, (w, qp16, out)), ("r2t2_16", tr_r2t2, (w, qp16, out)), ("fused8", tr_fused, (w, qp, out))]:
                out[:] = 0
                ms = bench(f, *args, n=10)
                ok = np.array_equal(out.astype(np.int64) - A, ref)
                res.append(f"{name} {ms[0]:.2f}/{ms[1]:.2f}{'' if ok else ' WRONG'}")
            outf = np.zeros((T, M), np.float32)
            ms = bench(f32_1d, w, qp.astype(np.float32), outf, n=10)
            ok = np.array_equal(outf.astype(np.int64) - A, ref)
            res.append(f"f32 {ms[0]:.2f}/{ms[1]:.2f}{'' if ok else ' WRONG'}")
            x = torch.randn(T, K); W = torch.randn(M, K)
            ms = bench(lambda: torch.nn.functional.linear(x, W), n=10)
            res.append(f"torch {ms[0]:.2f}/{ms[1]:.2f}")
            print(M, K, T, " | ".join(res), flush=True)

if __name__ == "__main__":
    main()
