import time, numpy as np, numba as nb, torch, sys
from numba import njit, prange
torch.set_num_threads(2)

@njit(parallel=True, nogil=True, cache=True)
def gemv_v1(w, qp, out):
    M, Kb = w.shape
    ng = Kb // 32
    for r in prange(M):
        acc = np.int32(0)
        for g in range(ng):
            bb = g * 32
            bq = g * 128
            for m in range(32):
                b = np.int32(w[r, bb + m])
                acc += (b & 3) * np.int32(qp[bq + m]) + ((b >> 2) & 3) * np.int32(qp[bq + 32 + m]) \
                     + ((b >> 4) & 3) * np.int32(qp[bq + 64 + m]) + (b >> 6) * np.int32(qp[bq + 96 + m])
        out[r] = acc

@njit(parallel=True, nogil=True, cache=True)
def gemv_v3(w, qp, out):
    # rows in blocks of 4 per prange iteration, 4 accumulators
    M, Kb = w.shape
    ng = Kb // 32
    for rb in prange(M // 4):
        r0 = rb * 4
        a0 = np.int32(0); a1 = np.int32(0); a2 = np.int32(0); a3 = np.int32(0)
        for g in range(ng):
            bb = g * 32
            bq = g * 128
            for m in range(32):
                x0 = np.int32(qp[bq + m]); x1 = np.int32(qp[bq + 32 + m]); x2 = np.int32(qp[bq + 64 + m]); x3 = np.int32(qp[bq + 96 + m])
                b = np.int32(w[r0, bb + m])
                a0 += (b & 3) * x0 + ((b >> 2) & 3) * x1 + ((b >> 4) & 3) * x2 + (b >> 6) * x3
                b = np.int32(w[r0 + 1, bb + m])
                a1 += (b & 3) * x0 + ((b >> 2) & 3) * x1 + ((b >> 4) & 3) * x2 + (b >> 6) * x3
                b = np.int32(w[r0 + 2, bb + m])
                a2 += (b & 3) * x0 + ((b >> 2) & 3) * x1 + ((b >> 4) & 3) * x2 + (b >> 6) * x3
                b = np.int32(w[r0 + 3, bb + m])
                a3 += (b & 3) * x0 + ((b >> 2) & 3) * x1 + ((b >> 4) & 3) * x2 + (b >> 6) * x3
        out[r0] = a0; out[r0 + 1] = a1; out[r0 + 2] = a2; out[r0 + 3] = a3

@njit(parallel=True, nogil=True, cache=True)
def gemv_lut(w, lut, out):
    # lut int16 [Kb, 256]: for byte position j, value of code-byte c = sum_s code_s(c) * q[4j+s]
    M, Kb = w.shape
    for r in prange(M):
        acc = np.int32(0)
        for j in range(Kb):
            acc += np.int32(lut[j, w[r, j]])
        out[r] = acc

@njit(parallel=True, nogil=True, cache=True)
def gemv_i8(w8, q, out):
    M, K = w8.shape
    for r in prange(M):
        acc = np.int32(0)
        for k in range(K):
            acc += np.int32(w8[r, k]) * np.int32(q[k])
        out[r] = acc

def bench(f, *a, n=30):
    f(*a)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(*a); ts.append(time.perf_counter() - t)
    return min(ts) * 1e3, np.median(ts) * 1e3

def main():
    rng = np.random.default_rng(0)
    for M, K in [(2560, 2560), (2560, 6912), (6912, 2560)]:
        t = rng.integers(-1, 2, size=(M, K)).astype(np.int8)
        q = rng.integers(-128, 128, size=K).astype(np.int8)
        codes = (t + 1).astype(np.uint8).reshape(M, K // 4, 4)
        w = (codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)).astype(np.uint8)
        qp = q.reshape(K // 128, 32, 4).transpose(0, 2, 1).reshape(K).copy()
        allc = np.arange(256)
        cs = np.stack([(allc >> (2 * s)) & 3 for s in range(4)], 1)  # [256, 4]
        lut = (q.reshape(K // 4, 4).astype(np.int32) @ cs.T.astype(np.int32)).astype(np.int16)  # [Kb, 256]
        ref = t.astype(np.int64) @ q.astype(np.int64)
        A = int(q.astype(np.int64).sum())
        out = np.zeros(M, np.int32)
        for name, f, args, sub in [("v1", gemv_v1, (w, qp, out), A), ("v3", gemv_v3, (w, qp, out), A), ("lut", gemv_lut, (w, lut, out), A), ("i8", gemv_i8, (t, q, out), 0)]:
            ms = bench(f, *args)
            got = out.astype(np.int64) - sub
            print(M, K, name, "min %.3f med %.3f ms" % ms, "ok" if np.array_equal(got, ref) else "WRONG", flush=True)
        x = torch.randn(1, K); W = torch.randn(M, K)
        print(M, K, "torch f32", "min %.3f med %.3f ms" % bench(lambda: torch.nn.functional.linear(x, W)))

if __name__ == '__main__':
    main()
