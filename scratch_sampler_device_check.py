"""Temporary (sampler helper): CPU timings on a quiet box and CUDA checks. Deleted after use."""
import math, random, sys, time
from collections import Counter
import torch
from bitserve.sampling_params import SamplingParams
from bitserve.layers.sampler import Sampler, SamplingRequestState, make_generator, _apply_penalties

S, V = 64, 49152
KINDS = {"greedy": dict(temperature=0), "plain": dict(temperature=0.8),
    "pen_greedy": dict(temperature=0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3),
    "topk40": dict(temperature=0.8, top_k=40), "topp0.9": dict(temperature=0.8, top_p=0.9),
    "minp": dict(temperature=0.8, min_p=0.05), "logprobs5": dict(temperature=0, logprobs=5),
    "llamacpp_defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, seed=1),
    "all": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5, seed=1, logprobs=5, logit_bias={1: 5.0})}

def rows_for(kind, device):
    random.seed(0); rows = []
    for i in range(S):
        p = dict(KINDS[kind]); p["seed"] = i if "seed" in p else None
        p = SamplingParams(**p)
        rows.append(SamplingRequestState(p, [random.randrange(V) for _ in range(512)],
            [random.randrange(V) for _ in range(128)], make_generator(p.seed, device)))
    return rows

def bench(device, threads=None):
    if threads: torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(S, V, generator=g) * 2); base[:, :50] += 8; base = base.to(device)
    s = Sampler(seed=1)
    for kind in KINDS:
        rows = rows_for(kind, device); ts = []
        for _ in range(7):
            l = base.clone()
            if device == "cuda": torch.cuda.synchronize()
            t = time.perf_counter(); s(l, rows); ts.append(time.perf_counter() - t)
        print(f"{device} threads={threads} {kind:18s} median {sorted(ts)[3]*1e3:7.2f} ms  min {min(ts)*1e3:7.2f} ms", flush=True)

def cuda_checks():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 3000, generator=g) * 2
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.2, logit_bias={7: 2.0}, logprobs=3)] * 16
    rows = lambda dev: [SamplingRequestState(p, list(range(i, i + 40)), list(range(i * 3, i * 3 + 10)), None) for i, p in enumerate(params)]
    cpu = Sampler()(logits.clone(), rows("cpu")); gpu = Sampler()(logits.cuda(), rows("cuda"))
    assert cpu.token_ids == gpu.token_ids, (cpu.token_ids, gpu.token_ids)
    for a, b in zip(cpu.logprobs, gpu.logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, seed=77)
    def run(batch_logits, pos, others):
        ps = others[:pos] + [sp] + others[pos:]
        rs = [SamplingRequestState(p, [1, 2], [], make_generator(p.seed, "cuda")) for p in ps]
        out = []
        s = Sampler(seed=pos)
        for _ in range(10):
            out.append(s(batch_logits.clone(), rs).token_ids[pos])
        return out
    target = torch.randn(1, 3000, generator=g).cuda()
    alone = run(target, 0, [])
    others = [SamplingParams(temperature=0), SamplingParams(top_p=0.5), SamplingParams(seed=3, temperature=1.3)]
    for pos in (0, 2, 3):
        b = torch.randn(4, 3000, generator=g).cuda(); b[pos] = target[0]
        assert run(b, pos, others) == alone
    lg = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5]); T = 0.7; N = 4000
    rs = [SamplingRequestState(SamplingParams(temperature=T, seed=i), [], [], make_generator(i, "cuda")) for i in range(N)]
    c = Counter(Sampler()(lg.expand(N, -1).contiguous().cuda(), rs).token_ids)
    exp = torch.softmax(lg.double() / T, -1)
    chi = sum((c[i] - N * float(exp[i])) ** 2 / (N * float(exp[i])) for i in range(6))
    assert chi < 20.52, chi
    print("cuda checks passed; chi2", round(chi, 2), flush=True)

if __name__ == "__main__":
    if torch.cuda.is_available():
        print(torch.cuda.get_device_name(), flush=True); cuda_checks(); bench("cuda")
    bench("cpu", 1); bench("cpu", 2)
