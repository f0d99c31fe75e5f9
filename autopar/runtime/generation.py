"""Text generation on the mesh: one prefill plan, one decode plan, a static KV cache.

    gen = autopar.compile_for_generation(model, mesh=(1, 4), max_batch=2, max_cache_len=32)
    tokens = gen.generate(input_ids, max_new_tokens=8)                      # greedy
    tokens = gen.generate(input_ids, 8, do_sample=True, top_k=20, generator=g)

    step        input_ids               cache_position     plan
    prefill     (max_batch, prefill_len)  arange(prefill_len)  1
    decode      (max_batch, 1)            [position]           2   (every later token)

1. Two input signatures, so exactly two plans of one ParallelModule (kv_cache.CachedLM
   around the model): decode is planned first, so the solver picks the parameter and
   cache layouts for the step that runs once per token; prefill keeps them (pinned).
2. Every prompt runs through the one prefill plan: rows are padded to max_batch (copies
   of row 0) and columns to prefill_len (token 0) on the right. The padding's keys and
   values land at positions after the prompt, which the causal mask hides from every
   real token, and decode overwrites them one position at a time before any real token
   could attend to them; so the real rows' tokens are the unpadded model's.
3. Each step's logits come back whole on every rank (the plan's outputs are replicated),
   so every rank picks the same token: argmax, or a draw from its own torch.Generator,
   which the caller seeds alike on every rank. At the end every rank's tokens are
   compared (one all-gather) and a difference is raised, never returned.
4. A request the cache cannot hold is refused before any step runs (CacheLimitError,
   naming the dim and the limit), so no cache is left half-written by a bad request.
   The ranks agree on the request first (one all-gather): one that any rank refuses,
   or that differs between ranks, raises on every rank, never a hang.
Generation runs for max_new_tokens tokens; it does not stop at an end-of-sequence token.
Every row of a call is one prompt of the call's length: no attention_mask, no left
padding (a mask with zeros is refused).
"""

from __future__ import annotations

import contextlib

from typing import Callable, Optional

import torch
import torch.distributed as dist

from autopar.core.errors import CacheLimitError, InputMismatchError, ProcessGroupError
from autopar.core.plan_book import PlanBook
from autopar.runtime.kv_cache import CacheShape, CachedLM

__all__ = ["CacheLimitError", "Generator", "check_sampling", "next_tokens"]  # CacheLimitError: also importable from here

# one step of the model: (input_ids (max_batch, S), cache_position (S,)) -> logits (max_batch, S, vocab)
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Generator:
    """Generates with `step` (a ParallelModule over a CachedLM, or a CachedLM itself on one
    device) over a static cache of `shape`, prompts padded to `prefill_len`."""

    def __init__(self, step: Step, shape: CacheShape, prefill_len: int) -> None:
        if type(prefill_len) is not int or not 1 <= prefill_len <= shape.length:
            raise CacheLimitError(f"prefill_len={prefill_len!r} must be an int between 1 and "
                                  f"max_cache_len={shape.length}")
        self.step, self.shape, self.prefill_len = step, shape, prefill_len

    @classmethod
    def single_device(cls, model: torch.nn.Module, max_batch: int, max_cache_len: int,
                      prefill_len: Optional[int] = None) -> "Generator":
        """The same generation on one device, without autopar: the reference."""
        cached = CachedLM(model, max_batch, max_cache_len)
        return cls(cached, cached.shape, max_cache_len if prefill_len is None else prefill_len)

    @property
    def cache_layout(self) -> str:
        """The placements of the cache's key and value buffers ("RS(1)": KV heads split over
        mesh axis 1), or "one device"."""
        specs = getattr(self.step, "state_specs", {})
        return str(specs["key_cache_0"]) if "key_cache_0" in specs else "one device"

    @property
    def plan_book(self) -> PlanBook:
        """The decode and prefill plans: saved with .to_json(path),
        `compile_for_generation(..., plan=path)` makes neither again."""
        return self.step.plan_book

    def prepare(self) -> None:
        """Plan both steps now, decode first (step 1)."""
        for inputs in self.step_inputs():
            self.step(*inputs)

    def step_inputs(self) -> tuple[tuple, tuple]:
        """Example inputs of the two steps, decode first: what prepare runs, and what
        autopar.plan_for_generation traces."""
        return (self._decode_inputs(torch.zeros(self.shape.batch, dtype=torch.long), 0),
                self._prefill_inputs(torch.zeros(self.shape.batch, 1, dtype=torch.long)))

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False,
                 temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None,
                 attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The prompt followed by `max_new_tokens` new tokens, (batch, prompt + new).
        Every rank passes the same request; one that any rank refuses, or that differs
        between ranks, raises the same InputMismatchError on every rank before the
        cache is written. Rows are whole prompts of equal length: an attention_mask is
        accepted only when it is all ones (left-padded batches are refused)."""
        problem = None
        try:
            self.check(input_ids, max_new_tokens, attention_mask)
            check_sampling(do_sample, temperature, top_k)
        except InputMismatchError as e:
            problem = e
        request = None if problem else (tuple(input_ids.shape), max_new_tokens, do_sample, temperature, top_k)
        _agree(problem, request)
        batch, prompt = input_ids.shape
        # every step's inputs follow from the agreed request: a ParallelModule need not agree
        # on each again (a CachedLM on one device has nothing to agree)
        with getattr(self.step, "agreed_by_caller", contextlib.nullcontext)():
            logits = self.step(*self._prefill_inputs(input_ids))[:batch, prompt - 1]
            new = [next_tokens(logits, do_sample, temperature, top_k, generator)]
            for t in range(1, max_new_tokens):
                logits = self.step(*self._decode_inputs(new[-1], prompt + t - 1))[:batch, -1]
                new.append(next_tokens(logits, do_sample, temperature, top_k, generator))
        tokens = torch.cat([input_ids, torch.stack(new, 1)], 1)
        _check_ranks_agree(tokens)
        return tokens

    def check(self, input_ids: torch.Tensor, max_new_tokens: int,
              attention_mask: Optional[torch.Tensor] = None) -> None:
        """Step 4: refuse what the cache cannot hold, naming the dim and the limit, and
        what generation does not do (padded prompts), on this rank alone."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise InputMismatchError(f"input_ids must be a 2-d int64 tensor (batch, prompt length); got "
                                     f"{_describe(input_ids)}")
        if type(max_new_tokens) is not int:
            raise InputMismatchError(f"max_new_tokens={max_new_tokens!r} must be an int (a number of tokens)")
        batch, prompt = input_ids.shape
        # the last new token is returned, never written: the cache holds prompt + new - 1 positions
        limits = [("input_ids dim 0 (batch)", batch, self.shape.batch, "max_batch"),
                  ("input_ids dim 1 (prompt length)", prompt, self.prefill_len, "prefill_len"),
                  ("prompt length + max_new_tokens - 1 (the positions written to the cache)",
                   prompt + max_new_tokens - 1, self.shape.length, "max_cache_len")]
        if batch < 1 or prompt < 1 or max_new_tokens < 1:
            raise InputMismatchError(f"need batch >= 1, prompt length >= 1 and max_new_tokens >= 1; got "
                                     f"batch={batch}, prompt length={prompt}, max_new_tokens={max_new_tokens}")
        for what, value, limit, knob in limits:
            if value > limit:
                raise CacheLimitError(f"{what} = {value} exceeds the cache's limit {knob}={limit}; compile for "
                                      f"generation with {knob} >= {value}, or shorten the request")
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            raise InputMismatchError("an attention_mask with zeros (padded prompts) is not supported: every row is "
                                     "taken as a whole prompt of input_ids' length; generate rows of different "
                                     "lengths in separate calls, unpadded")

    # ---- parts ----------------------------------------------------------------------
    def _prefill_inputs(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2: rows padded with copies of row 0, columns with token 0, on the right."""
        batch, prompt = input_ids.shape
        rows = torch.cat([input_ids, input_ids[:1].expand(self.shape.batch - batch, prompt)], 0)
        padded = torch.zeros(self.shape.batch, self.prefill_len, dtype=torch.long, device=input_ids.device)
        padded[:, :prompt] = rows
        return padded, torch.arange(self.prefill_len, device=input_ids.device)

    def _decode_inputs(self, tokens: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.cat([tokens, tokens[:1].expand(self.shape.batch - tokens.shape[0])], 0)
        return rows[:, None], torch.tensor([position], device=tokens.device)


def next_tokens(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: Optional[int],
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token per row of `logits` (batch, vocab): the argmax, or a draw from the
    softmax of logits / temperature restricted to the top_k largest."""
    if not do_sample:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(do_sample: bool, temperature: float, top_k: Optional[int]) -> None:
    if do_sample and not temperature > 0:
        raise InputMismatchError(f"temperature={temperature} must be > 0 when sampling; use do_sample=False "
                                 "for greedy decoding")
    if top_k is not None and (type(top_k) is not int or top_k < 1):
        raise InputMismatchError(f"top_k={top_k!r} must be an int >= 1 (or None for the whole vocabulary)")


def _agree(problem: Optional[InputMismatchError], request: Optional[tuple]) -> None:
    """One all-gather before any step: a request refused on any rank, or not the same on
    every rank (which would send the ranks into different collectives), raises on all."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if problem is not None:
            raise problem
        return
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (problem, request))
    refused = [p for p, _ in seen if p is not None]
    if refused:
        raise refused[0]  # the lowest refusing rank's error, the same on every rank
    requests = [q for _, q in seen]
    if any(q != requests[0] for q in requests):
        raise InputMismatchError(f"ranks asked for different generations ((input_ids shape, max_new_tokens, "
                                 f"do_sample, temperature, top_k) per rank: {requests}); pass every rank the same "
                                 "request")


def _check_ranks_agree(tokens: torch.Tensor) -> None:
    """Step 3: one all-gather of every rank's tokens (under the process group's timeout)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    seen = [torch.empty_like(tokens) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, tokens.contiguous())
    odd = [r for r, t in enumerate(seen) if not torch.equal(t, seen[0])]
    if odd:
        raise ProcessGroupError(f"ranks {odd} generated other tokens than rank 0; when sampling, seed every rank's "
                                "torch.Generator with the same seed")


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-d {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
