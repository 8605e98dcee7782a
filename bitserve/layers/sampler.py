"""Batched sampler: one row of logits per request → one chosen token id (and logprobs) per row.

Torch on the logits' device (numpy only turns id lists into tensors); the only host sync is the
final `.tolist()`. Imports no scheduling code: the runner builds one `SamplingRequestState` a row.

Per row, in this order (vLLM's order, except that min-p runs last, after top-p):
  0. logprobs, if requested, come from the RAW distribution, log_softmax(logits) before any step
     below (vLLM's default `logprobs_mode="raw_logprobs"`, which is what OpenAI reports); then the
     caller's `constrain` (the runner's grammar masks, structured/masks.py) sets -inf in place;
  1. min_tokens: while fewer than `min_tokens` tokens were generated, stop_token_ids and EOS
     (unless `ignore_eos`) get -inf;
  2. logit_bias is added;
  3. penalties: repetition over prompt + output tokens (positive logits divided by r, the others
     multiplied by r, as llama.cpp / vLLM / HF), then presence and frequency over OUTPUT tokens
     only (OpenAI: logit -= presence * (count > 0) + frequency * count);
  4. greedy rows (temperature < 1e-5 or top_k == 1) take argmax (ties → lowest id) and stop here;
  5. temperature; 6. top-k (ties at the k-th value are kept); 7. top-p: the smallest set of most
     likely tokens whose mass reaches p, on the distribution renormalised after top-k;
  8. min-p: keep p_i >= min_p * p_max; 9. draw from what is left by inverse CDF, one uniform per row.

Seeds: a row with a seed draws its uniform from its own generator (`make_generator`, kept by the
runner), and every step above is row-local, so the same seed, params, model and history give the
same tokens whatever else shares the batch. Rows without a seed share the sampler's generator.
NOTE: inverse CDF rather than vLLM's exponential race (argmax p_i / E_i): the race draws
vocab_size random numbers per row, which alone cost ~75 ms on one CPU core for 64 x 49152 logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bitserve.core.step_outputs import TokenLogprobs
from bitserve.sampling_params import SamplingParams

TokenIds = Sequence[int] | torch.Tensor

# Top-p on CPU looks for its cut-off among this many most likely tokens first (a partial top-k is
# far cheaper than sorting the vocabulary) and sorts only rows whose cut-off lies further out.
TOP_P_NUM_CANDIDATES = 256
# Inverse-CDF sampling sums the probabilities in blocks of this many tokens (see _inverse_cdf_sample).
CDF_BLOCK_SIZE = 1024


@dataclass(slots=True)
class SamplingRequestState:
    """One row of the batch, built by the runner each step.

    `prompt_token_ids` / `output_token_ids` may be Python sequences or 1-D integer CPU tensors (a
    runner may keep the prompt as a tensor rather than convert it every step). `generator` is the
    request's own generator from `make_generator(params.seed)`, kept by the runner across steps;
    a sampled row with a seed must have one. `eos_token_ids` (the model's EOS ids) serve only
    `min_tokens`.
    """

    params: SamplingParams
    prompt_token_ids: TokenIds
    output_token_ids: TokenIds
    generator: torch.Generator | None = None
    eos_token_ids: Sequence[int] = ()


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # [num_rows]
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked; else one entry per row


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The generator of one seeded request (None without a seed); the runner keeps it across steps."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def row_uniform(generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """The one U[0, 1) draw [1] float64 a sampled row with a seed takes from its generator per step (the
    speculative runner replays these to keep a seeded stream in step: runner/speculative.py)."""
    return torch.rand(1, dtype=torch.float64, device=device, generator=generator)


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits f32 [num_rows, vocab] -> the first index of each row's maximum (a NaN counts as the
    maximum), int64 [num_rows]. On CPU through NumPy: torch's CPU argmax reduces a row with one scalar
    loop (121 µs for 49,152 logits, 288 µs for 128,256, against NumPy's 8 and 12 µs on the 2-vCPU EPYC):
    0.12 ms of a SmolLM2 decode step of ~7.4 ms."""
    if logits.device.type == "cuda":
        from bitserve.kernels.cuda.argmax import argmax_rows  # NOTE: deferred: imports triton

        return argmax_rows(logits)  # torch's CUDA argmax reduces a row in one block: 28 µs for 128,256
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    return torch.from_numpy(np.argmax(logits.numpy(), axis=-1).astype(np.int64, copy=False))


class Sampler:
    """Picks the next token of every row of a [num_rows, vocab_size] float logits batch.

    `seed` seeds the generator shared by rows without a seed of their own (None: fresh entropy).
    NOTE: `logits` is scratch space: a contiguous float32 input is modified in place.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRequestState],
        constrain: Callable[[torch.Tensor], None] | None = None,
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} must be [num_rows={len(rows)}, vocab_size]")
        logits = logits.float().contiguous()  # no copy when already float32 and contiguous
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            # [num_logprob_rows, vocab_size], before any processing (see the module docstring)
            raw_logprobs = _select_rows(logits, logprob_rows).log_softmax(dim=-1)
        if constrain is not None:
            constrain(logits)
        _apply_min_tokens(logits, rows)
        _apply_logit_bias(logits, rows)
        _apply_penalties(logits, rows)
        token_ids = self._choose(logits, rows)  # [num_rows] int64
        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids.tolist(), logprobs=None)  # the only host sync
        logprob_tensors = _gather_logprobs(raw_logprobs, token_ids, rows, logprob_rows)
        token_id_list = token_ids.tolist()  # the only host sync; what follows copies finished work
        logprobs = _build_logprobs(logprob_tensors, token_id_list, rows, logprob_rows)
        return SamplerOutput(token_ids=token_id_list, logprobs=logprobs)

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRequestState]) -> torch.Tensor:
        """Greedy rows → argmax; the others → temperature, top-k, top-p, min-p, inverse CDF."""
        sampled_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not sampled_rows:
            return _argmax_rows(logits)
        if len(sampled_rows) == len(rows):
            return self._sample(logits, rows)
        token_ids = _argmax_rows(logits)  # [num_rows]; sampled rows are overwritten below
        index = _index_tensor(sampled_rows, logits.device)
        token_ids[index] = self._sample(logits[index], [rows[i] for i in sampled_rows])
        return token_ids

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRequestState]) -> torch.Tensor:
        """logits [num_sampled, vocab_size], modified in place → sampled ids [num_sampled]."""
        vocab_size = logits.shape[1]
        temperatures = [row.params.temperature for row in rows]
        if any(t != 1.0 for t in temperatures):
            logits.div_(_value_tensor(temperatures, torch.float32, logits.device).unsqueeze(1))
        # A top_k at or above the vocabulary size keeps every token: such rows skip top-k.
        top_k = {i: row.params.top_k for i, row in enumerate(rows) if 0 < row.params.top_k < vocab_size}
        _apply_to_rows(logits, top_k, torch.int64, _mask_top_k)
        probs = logits.softmax(dim=-1)  # [num_sampled, vocab_size]; masked tokens are exactly 0
        top_p = {i: row.params.top_p for i, row in enumerate(rows) if row.params.top_p < 1.0}
        _apply_to_rows(probs, top_p, torch.float32, _top_p_masker(top_p, rows))
        min_p = {i: row.params.min_p for i, row in enumerate(rows) if row.params.min_p > 0.0}
        _apply_to_rows(probs, min_p, torch.float32, _mask_min_p)
        return _inverse_cdf_sample(probs, self._uniforms(rows, logits.device))

    def _uniforms(self, rows: Sequence[SamplingRequestState], device: torch.device) -> torch.Tensor:
        """One U[0, 1) float64 per row [num_sampled]: a seeded row's from its own generator."""
        unseeded_rows = [i for i, row in enumerate(rows) if row.generator is None]
        for i in unseeded_rows:
            if rows[i].params.seed is not None:
                raise ValueError("a sampled row with a seed needs its generator: make_generator(seed)")
        shared = torch.rand(
            len(unseeded_rows), dtype=torch.float64, device=device, generator=self._shared_generator(device)
        )
        if len(unseeded_rows) == len(rows):
            return shared
        uniforms = torch.empty(len(rows), dtype=torch.float64, device=device)
        for i, row in enumerate(rows):
            if row.generator is not None:
                uniforms[i : i + 1] = row_uniform(row.generator, device)
        if unseeded_rows:
            uniforms[_index_tensor(unseeded_rows, device)] = shared
        return uniforms

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator


# ---------------------------------------------------------------------------------------------
# Tensor builders: Python lists become CPU tensors, then one non-blocking copy to the device.


def _to_device(cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)


def _value_tensor(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _to_device(torch.tensor(values, dtype=dtype), device)


def _index_tensor(indices: Sequence[int], device: torch.device) -> torch.Tensor:
    return _to_device(torch.tensor(indices, dtype=torch.int64), device)


def _select_rows(tensor: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
    if len(indices) == tensor.shape[0]:
        return tensor
    return tensor[_index_tensor(indices, tensor.device)]


def _apply_to_rows(
    tensor: torch.Tensor,
    values_by_row: dict[int, float] | dict[int, int],
    dtype: torch.dtype,
    mask_fn: Callable[[torch.Tensor, torch.Tensor, float], None],
) -> None:
    """mask_fn(part, values [num_listed, 1], max value) on the listed rows only (in place if all)."""
    if not values_by_row:
        return
    values = list(values_by_row.values())
    column = _value_tensor(values, dtype, tensor.device).unsqueeze(1)  # [num_listed, 1]
    if len(values) == tensor.shape[0]:
        mask_fn(tensor, column, max(values))
        return
    index = _index_tensor(list(values_by_row), tensor.device)
    part = tensor[index]  # [num_listed, vocab_size], a copy
    mask_fn(part, column, max(values))
    tensor[index] = part


# ---------------------------------------------------------------------------------------------
# Truncation. Each keeps at least the most likely token of every row.


def _mask_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: float) -> None:
    """Keep logits >= the row's k-th largest; top_k [rows, 1] in 1..vocab_size-1."""
    top_values = logits.topk(int(max_k), dim=-1).values  # [rows, max_k], descending
    kth_value = top_values.gather(1, top_k - 1)  # [rows, 1]
    logits.masked_fill_(logits < kth_value, -math.inf)


def _top_p_threshold(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probability of the last kept token [rows, 1]; sorted_probs [rows, n] descending.

    A token is kept while the mass of the tokens before it is below p, so the first one always is.
    """
    mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)  # exclusive prefix sums
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True)  # [rows, 1], >= 1
    return sorted_probs.gather(1, num_kept - 1)


def _top_p_masker(
    top_p: dict[int, float], rows: Sequence[SamplingRequestState]
) -> Callable[[torch.Tensor, torch.Tensor, float], None]:
    """_mask_top_p with its candidate count: a top-k below TOP_P_NUM_CANDIDATES bounds the nucleus."""
    top_ks = [rows[i].params.top_k for i in top_p]
    num_candidates = TOP_P_NUM_CANDIDATES
    if top_ks and all(0 < k <= TOP_P_NUM_CANDIDATES for k in top_ks):
        num_candidates = max(top_ks)
    return lambda probs, column, max_value: _mask_top_p(probs, column, num_candidates)


def _mask_top_p(probs: torch.Tensor, top_p: torch.Tensor, num_candidates: int) -> None:
    """Zero the tokens outside each row's nucleus; probs [rows, vocab_size] sum to 1, top_p [rows, 1]."""
    num_candidates = min(num_candidates, probs.shape[1])
    if probs.device.type != "cpu" or num_candidates == probs.shape[1]:
        threshold = _top_p_threshold(probs.sort(dim=-1, descending=True).values, top_p)
        probs.masked_fill_(probs < threshold, 0.0)
        return
    # CPU: a partial top-k (far cheaper than sorting the vocabulary) settles every row whose
    # candidates reach p; only the others are sorted. Reading is_short needs no device sync on CPU.
    candidates = probs.topk(num_candidates, dim=-1).values  # [rows, num_candidates], descending
    threshold = _top_p_threshold(candidates, top_p)  # [rows, 1], right wherever candidates reach p
    is_short = (candidates.sum(dim=-1, keepdim=True) < top_p).squeeze(1)  # [rows]
    short_rows = is_short.nonzero().squeeze(1)
    if short_rows.numel():
        full_sort = probs[short_rows].sort(dim=-1, descending=True).values
        threshold[short_rows] = _top_p_threshold(full_sort, top_p[short_rows])
    probs.masked_fill_(probs < threshold, 0.0)


def _mask_min_p(probs: torch.Tensor, min_p: torch.Tensor, max_min_p: float) -> None:
    """Zero p_i < min_p * p_max; probs [rows, vocab_size], min_p [rows, 1] in (0, 1]."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p  # [rows, 1]
    probs.masked_fill_(probs < threshold, 0.0)


def _inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first id whose cumulative mass exceeds u * total; probs [rows, vocab_size] >= 0.

    Two levels give float64 accuracy for about one pass over probs (a float64 cumsum over the
    vocabulary is slow on CPU): block masses pick the block, a float64 cumsum inside it the token.
    Zero-probability tokens are never chosen: the search takes the first strictly greater sum.
    """
    num_rows, vocab_size = probs.shape
    block = CDF_BLOCK_SIZE
    num_full = vocab_size // block
    block_mass = probs[:, : num_full * block].unflatten(-1, (num_full, block)).sum(dim=-1)  # [rows, num_full]
    if vocab_size % block:
        block_mass = torch.cat([block_mass, probs[:, num_full * block :].sum(dim=-1, keepdim=True)], dim=1)
    block_mass = block_mass.double()  # [rows, num_blocks]
    block_cdf = block_mass.cumsum(dim=-1)
    targets = uniforms.unsqueeze(1) * block_cdf[:, -1:]  # [rows, 1]
    chosen = torch.searchsorted(block_cdf, targets, right=True).clamp_max_(block_cdf.shape[1] - 1)
    chosen_mass = block_mass.gather(1, chosen)  # [rows, 1], > 0: the cdf rises across the chosen block
    mass_before = block_cdf.gather(1, chosen) - chosen_mass
    # Where u falls inside the block, as a fraction kept below 1 so that a token of it is found.
    fraction = ((targets - mass_before) / chosen_mass).clamp_(0.0, 1.0 - 2.0**-40)
    ids = chosen * block + torch.arange(block, device=probs.device)  # [rows, block]
    inner = probs.gather(1, ids.clamp_max(vocab_size - 1)).double() * (ids < vocab_size)
    inner_cdf = inner.cumsum(dim=-1)  # [rows, block]
    offset = torch.searchsorted(inner_cdf, fraction * inner_cdf[:, -1:], right=True)
    return (chosen * block + offset.clamp_max_(block - 1)).squeeze(1)


# ---------------------------------------------------------------------------------------------
# Logit processors that can change the argmax (they run for greedy rows too).


def _check_vocab(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Internal invariant, not user-input validation (anything raised in a step kills the engine):
    admission (`SamplingParams.validate_for_vocab`, in LLM and AsyncEngine) refused stop / logit_bias
    ids outside the tokenizer's vocabulary, and the logits [rows, vocab_size] cover that vocabulary."""
    assert not token_ids or max(token_ids) < vocab_size, f"{param}: id {max(token_ids)} >= {vocab_size}"


def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRequestState]) -> None:
    """Ban stop ids (and EOS unless ignore_eos) while fewer than min_tokens tokens were generated."""
    row_index: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) >= params.min_tokens:
            continue
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.extend(row.eos_token_ids)
        _check_vocab(stop_ids, logits.shape[1], "stop_token_ids")
        row_index.extend([i] * len(stop_ids))
        token_ids.extend(stop_ids)
    if not row_index:
        return
    device = logits.device
    index = (_index_tensor(row_index, device), _index_tensor(token_ids, device))
    logits.index_put_(index, torch.tensor(-math.inf, device=device))


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRequestState]) -> None:
    """logits[row, id] += bias for each (id, bias) of the row's params.logit_bias."""
    row_index: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids, values = zip(*row.params.logit_bias, strict=True)
            _check_vocab(ids, logits.shape[1], "logit_bias")
            row_index.extend([i] * len(ids))
            token_ids.extend(ids)
            biases.extend(values)
    if not row_index:
        return
    device = logits.device
    index = (_index_tensor(row_index, device), _index_tensor(token_ids, device))
    logits.index_put_(index, _value_tensor(biases, torch.float32, device), accumulate=True)


def _token_keys(sequences: Sequence[TokenIds], row_indices: Sequence[int], vocab_size: int) -> torch.Tensor:
    """CPU int64 keys row * vocab_size + token_id of every token of sequences[j] (row row_indices[j])."""
    arrays = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in sequences]  # numpy: fast from lists
    if not arrays:
        return torch.empty(0, dtype=torch.int64)
    token_ids = torch.from_numpy(np.concatenate(arrays))  # [num_tokens]
    # Invariant: ids index the vocabulary (admission, frontend/admission.py, checks prompts and the
    # params; the engine only samples inside it); one outside would land in another row's logits.
    assert not token_ids.numel() or (int(token_ids.min()) >= 0 and int(token_ids.max()) < vocab_size)
    lengths = torch.tensor([len(array) for array in arrays])
    return token_ids + torch.repeat_interleave(torch.tensor(row_indices), lengths) * vocab_size


def _per_row(num_rows: int, default: float, values_by_row: dict[int, float]) -> torch.Tensor:
    """A CPU float32 [num_rows] vector: values_by_row where given, default elsewhere."""
    vector = torch.full((num_rows,), default)
    if values_by_row:
        vector[list(values_by_row)] = torch.tensor(list(values_by_row.values()))
    return vector


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRequestState]) -> None:
    """Repetition (prompt + output), then presence and frequency (output only), on rows that have any.

    Sparse: only the logits of tokens that occurred are read and written, through flat keys
    row * vocab_size + token_id made unique on the CPU, so the cost follows the number of tokens,
    not the vocabulary. logits [num_rows, vocab_size] must be contiguous.
    """
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalised:
        return
    num_rows, vocab_size = logits.shape
    device = logits.device
    flat = logits.view(-1)  # [num_rows * vocab_size]
    output_keys = _token_keys([rows[i].output_token_ids for i in penalised], penalised, vocab_size)
    repetition = {i: rows[i].params.repetition_penalty for i in penalised}
    repetition = {i: r for i, r in repetition.items() if r != 1.0}
    if repetition:
        prompt_keys = _token_keys(
            [rows[i].prompt_token_ids for i in repetition], list(repetition), vocab_size
        )
        penalty_by_row = _per_row(num_rows, 1.0, repetition)
        is_repetition_key = penalty_by_row[output_keys // vocab_size] != 1.0
        keys = torch.cat([prompt_keys, output_keys[is_repetition_key]]).unique()  # [num_seen]
        penalty = _to_device(penalty_by_row[keys // vocab_size], device)
        keys = _to_device(keys, device)
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / penalty, values * penalty)
    if output_keys.numel():
        keys, counts = output_keys.unique(return_counts=True)  # [num_distinct], occurrences
        key_rows = keys // vocab_size
        presence = _per_row(num_rows, 0.0, {i: rows[i].params.presence_penalty for i in penalised})
        frequency = _per_row(num_rows, 0.0, {i: rows[i].params.frequency_penalty for i in penalised})
        delta = frequency[key_rows] * counts + presence[key_rows]  # [num_distinct]
        flat.index_put_((_to_device(keys, device),), _to_device(-delta, device), accumulate=True)


# ---------------------------------------------------------------------------------------------
# Logprobs.


def _gather_logprobs(
    raw_logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    rows: Sequence[SamplingRequestState],
    logprob_rows: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw_logprobs [n, vocab_size], token_ids [num_rows] → chosen logprobs [n], ranks [n], top [n, k] x2."""
    chosen = token_ids[_index_tensor(logprob_rows, token_ids.device)].unsqueeze(1)  # [n, 1]
    chosen_logprobs = raw_logprobs.gather(1, chosen)  # [n, 1]
    ranks = (raw_logprobs > chosen_logprobs).sum(dim=-1).add_(1)  # [n]
    max_k = max(rows[i].params.logprobs or 0 for i in logprob_rows)
    top_values, top_ids = raw_logprobs.topk(max_k, dim=-1)  # [n, max_k], descending
    return chosen_logprobs.squeeze(1), ranks, top_values, top_ids


def _build_logprobs(
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    token_id_list: Sequence[int],
    rows: Sequence[SamplingRequestState],
    logprob_rows: Sequence[int],
) -> list[TokenLogprobs | None]:
    """One TokenLogprobs per row that asked (None elsewhere), each cut to its own top count."""
    chosen_list, rank_list, top_value_list, top_id_list = (tensor.tolist() for tensor in tensors)
    result: list[TokenLogprobs | None] = [None] * len(rows)
    for j, i in enumerate(logprob_rows):
        num_top = rows[i].params.logprobs or 0
        top = zip(top_id_list[j][:num_top], top_value_list[j][:num_top], strict=True)
        result[i] = TokenLogprobs(
            token_id=token_id_list[i], logprob=chosen_list[j], rank=rank_list[j], top_logprobs=tuple(top)
        )
    return result
