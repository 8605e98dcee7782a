import time, os, numpy as np, numba as nb, torch, sys
from numba import njit, prange
torch.set_num_threads(2)
nb.set_num_threads(2)
from gemv2 import gemv_v1, gemv_v3, gemv_lut, gemv_i8, bench

@njit(parallel=True, nogil=True, cache=True)
def gemm_fused(w, qp, out):
    M, Kb = w.shape
    T = qp.shape[0]
    ng = Kb // 32
    for r in prange(M):
        for t in range(T):
            acc = np.int32(0)
            for g in range(ng):
                bb = g * 32
                bq = g * 128
                for m in range(32):
                    b = np.int32(w[r, bb + m])
                    acc += (b & 3) * np.int32(qp[t, bq + m]) + ((b >> 2) & 3) * np.int32(qp[t, bq + 32 + m]) \
                         + ((b >> 4) & 3) * np.int32(qp[t, bq + 64 + m]) + (b >> 6) * np.int32(qp[t, bq + 96 + m])
            out[t, r] = acc

@njit(parallel=True, nogil=True, cache=True)
def gemm_scratch(w, qp16, out):
    # decode each row to int16 codes (permuted order), then per-token int16 dots
    M, Kb = w.shape
    T, Kp = qp16.shape
    ng = Kb // 32
    RB = 16
    nrb = (M + RB - 1) // RB
    for rb in prange(nrb):
        buf = np.empty(Kp, np.int16)
        for r in range(rb * RB, min(M, rb * RB + RB)):
            for g in range(ng):
                for m in range(32):
                    b = w[r, g * 32 + m]
                    buf[g * 128 + m] = b & 3
                    buf[g * 128 + 32 + m] = (b >> 2) & 3
                    buf[g * 128 + 64 + m] = (b >> 4) & 3
                    buf[g * 128 + 96 + m] = b >> 6
            for t in range(T):
                acc = np.int32(0)
                for k in range(Kp):
                    acc += np.int32(buf[k]) * np.int32(qp16[t, k])
                out[t, r] = acc

@njit(parallel=True, nogil=True, cache=True)
def gemm_scratch4(w, qp16, out):
    # decode row, then 4 tokens at once (one pass over buf per 4 tokens)
    M, Kb = w.shape
    T, Kp = qp16.shape
    ng = Kb // 32
    RB = 16
    nrb = (M + RB - 1) // RB
    for rb in prange(nrb):
        buf = np.empty(Kp, np.int16)
        for r in range(rb * RB, min(M, rb * RB + RB)):
            for g in range(ng):
                for m in range(32):
                    b = w[r, g * 32 + m]
                    buf[g * 128 + m] = b & 3
                    buf[g * 128 + 32 + m] = (b >> 2) & 3
                    buf[g * 128 + 64 + m] = (b >> 4) & 3
                    buf[g * 128 + 96 + m] = b >> 6
            t = 0
            while t + 4 <= T:
                a0 = np.int32(0); a1 = np.int32(0); a2 = np.int32(0); a3 = np.int32(0)
                for k in range(Kp):
                    c = np.int32(buf[k])
                    a0 += c * np.int32(qp16[t, k]); a1 += c * np.int32(qp16[t + 1, k])
                    a2 += c * np.int32(qp16[t + 2, k]); a3 += c * np.int32(qp16[t + 3, k])
                out[t, r] = a0; out[t + 1, r] = a1; out[t + 2, r] = a2; out[t + 3, r] = a3
                t += 4
            while t < T:
                acc = np.int32(0)
                for k in range(Kp):
                    acc += np.int32(buf[k]) * np.int32(qp16[t, k])
                out[t, r] = acc
                t += 1

@njit(parallel=True, nogil=True, cache=True)
def decode_f32(w, r0, r1, buf):
    # buf [r1-r0, Kp] f32 of t values in permuted order
    Kb = w.shape[1]
    ng = Kb // 32
    for i in prange(r1 - r0):
        r = r0 + i
        for g in range(ng):
            for m in range(32):
                b = np.int32(w[r, g * 32 + m])
                buf[i, g * 128 + m] = np.float32((b & 3) - 1)
                buf[i, g * 128 + 32 + m] = np.float32(((b >> 2) & 3) - 1)
                buf[i, g * 128 + 64 + m] = np.float32(((b >> 4) & 3) - 1)
                buf[i, g * 128 + 96 + m] = np.float32((b >> 6) - 1)

def gemm_sgemm(w, qpf, out, chunk=128):
    M = w.shape[0]
    Kp = qpf.shape[1]
    buf = torch.empty(chunk, Kp)
    bn = buf.numpy()
    for r0 in range(0, M, chunk):
        r1 = min(M, r0 + chunk)
        decode_f32(w, r0, r1, bn)
        torch.mm(qpf, buf[: r1 - r0].t(), out=out[:, r0:r1])

def main():
    rng = np.random.default_rng(0)
    for M, K in [(2560, 2560), (2560, 6912), (6912, 2560)]:
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
            if T == 1:
                o1 = np.zeros(M, np.int32)
                allc = np.arange(256)
                cs = np.stack([(allc >> (2 * s)) & 3 for s in range(4)], 1)
                lut = (q[0].reshape(K // 4, 4).astype(np.int32) @ cs.T.astype(np.int32)).astype(np.int16)
                for name, f, args, sub in [("v1", gemv_v1, (w, qp[0], o1), A[0]), ("v3", gemv_v3, (w, qp[0], o1), A[0]),
                                           ("lut", gemv_lut, (w, lut, o1), A[0]), ("i8", gemv_i8, (t, q[0], o1), 0)]:
                    ms = bench(f, *args)
                    ok = np.array_equal(o1.astype(np.int64) - sub, ref[0])
                    res.append(f"{name} {ms[0]:.2f}/{ms[1]:.2f}{'' if ok else ' WRONG'}")
            qp16 = qp.astype(np.int16)
            for name, f, args in [("fused", gemm_fused, (w, qp, out)), ("scr", gemm_scratch, (w, qp16, out)), ("scr4", gemm_scratch4, (w, qp16, out))]:
                ms = bench(f, *args, n=10)
                ok = np.array_equal(out.astype(np.int64) - A, ref)
                res.append(f"{name} {ms[0]:.2f}/{ms[1]:.2f}{'' if ok else ' WRONG'}")
            qpf = torch.from_numpy(qp.astype(np.float32)); outt = torch.zeros(T, M)
            ms = bench(gemm_sgemm, w, qpf, outt, n=10)
            ok = np.array_equal(outt.numpy().astype(np.int64), ref)
            res.append(f"sgemm {ms[0]:.2f}/{ms[1]:.2f}{'' if ok else ' WRONG'}")
            x = torch.randn(T, K); W = torch.randn(M, K)
            ms = bench(lambda: torch.nn.functional.linear(x, W), n=10)
            res.append(f"torch {ms[0]:.2f}/{ms[1]:.2f}")
            print(M, K, T, " | ".join(res), flush=True)

if __name__ == '__main__':
    main()
