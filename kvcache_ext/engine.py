"""Continuous batching over python_ref models with a :class:`~kvcache_ext.paged.PagedKVCache`.

Each :meth:`Engine.step` admits waiting requests, then runs every running request one piece further
in one forward pass: the decoding requests (one token each) and the requests still reading their
prompts (a chunk of at most ``chunk_size`` tokens each, of any lengths) together, so that the step
reads every weight once; more passes only where one would need more positions than the model has.
The rows of a pass are right-padded to its longest piece and the cache protocol's ``counts`` say how
many tokens of each row are real: the model runs its products on the real tokens alone
(``python_ref/packed_rows.py``), the padding is neither stored nor attended, and the paged cache
attends each decoding row with its one query (not a chunk's). The cache gives each row its own
positions, and the model computes logits only at each row's last new token. A request that finishes
frees its blocks at once; a request added between steps joins at the next one.

A waiting request whose prompt starts with full blocks that a running request is still computing
waits until they are stored: then it takes them from the prefix cache instead of computing them too.

When the pool runs out of blocks, the newest running request is preempted: its blocks are freed and
it goes back to the front of the queue, keeping the tokens it generated, to be recomputed when
readmitted (cheaply, where the prefix cache still holds its full blocks).

The engine remembers every request until its output is collected: :meth:`Engine.generate` collects
its own; users of :meth:`Engine.step`, :meth:`Engine.stream` or :meth:`Engine.add_request` call
:meth:`Engine.pop_finished`, else a long-running engine keeps every finished request's tokens.
A request finishes at one of its stop tokens (``"stop"``), at its ``max_new_tokens`` (``"length"``),
cancelled (:meth:`Engine.cancel`, ``"cancelled"``) or in a step that raised (``"error"``, see
:class:`StepFailedError`); :meth:`Engine.result` tells which, and how much of its prompt it reused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from python_ref.generate import check_top_p, choose_next_token

from .linear import path_row_bounds
from .paged import PagedKVCache, PoolExhaustedError


# What changes between the Engine's decode passes, dynamic from the first compilation on: the rows
# (the tensors' first dimension and PagedStep's count), the tables' width and the longest row's length,
# as torch.compile names them (sources: compile_decode's arguments `tokens` and `cache`, a PagedStep).
DYNAMIC_IN_A_DECODE_PASS = ",".join(
    ["L['tokens']:0", "L['cache'].batch_size", "L['cache'].seq_length", "L['cache'].block_tables:1"]
    + [f"L['cache'].{name}:0" for name in ("positions", "block_tables", "lengths_before", "lengths_after")]
)


def compile_decode(model) -> Callable[[torch.Tensor, object], torch.Tensor]:
    """``model(tokens, cache)`` under ``torch.compile`` as every compiled decode step runs it: inductor,
    the whole model in one graph with the cache's ops in it (``fullgraph``), rounding to bfloat16 or
    float16 where eager does (``emulate_precision_casts``: without it, intermediate values kept in
    float32 moved a greedy token of an int4-weight model in the tests)."""

    def decode(tokens: torch.Tensor, cache) -> torch.Tensor:
        return model(tokens, cache)

    return torch.compile(decode, fullgraph=True, options={"emulate_precision_casts": True})


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch's CPU ops on this thread alone, then restore the thread count. The Engine chooses
    its tokens so: sampling a row is a dozen vocabulary-wide elementwise ops (128,256 values each for
    Llama 3), too short to gain from a second thread (16 rows: 7.7-9.7 ms on two threads, 8.5-9.4 on
    one; Intel Xeon), and in a server, where the event loop and the clients share the cores, each
    op's parallel region waited for a descheduled thread (`kvcache-ext serve`, 16 clients: 145-146
    output tokens/s sampling on two threads, 152-158 on one; docs/server.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(eq=False)  # requests are compared by identity
class _Request:
    request_id: int  # -1 until queued
    tokens: list[int]  # the prompt, then the generated tokens
    prompt_length: int
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None
    stop_ids: frozenset[int]  # the tokens that end it (generated, then it stops)
    computed: int = 0  # tokens whose keys/values the cache holds
    cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache
    admitted: bool = False  # it was admitted once (and may have been preempted since)
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"; None while it runs or waits

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestResult:
    """What :meth:`Engine.result` tells of a request: its generated ``tokens`` so far, its prompt's
    length, ``cached_tokens`` (prompt tokens taken from the prefix cache, pool or tier, instead of
    computed, when it was first admitted: OpenAI's ``usage.prompt_tokens_details.cached_tokens``; 0
    before), and ``finish_reason``: ``"stop"`` (it generated one of its stop tokens, the last of
    ``tokens``), ``"length"`` (``max_new_tokens`` generated), ``"cancelled"``, ``"error"`` (a step it
    was in raised), or None while it waits or runs."""

    request_id: int
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepFailedError(RuntimeError):
    """A forward pass of :meth:`Engine.step` raised (the cause is ``__cause__``). The requests of that
    pass, ``failed``, are finished with ``finish_reason="error"`` and their blocks freed; ``events``
    are the tokens the step chose before (delivered nowhere else); the engine serves the others on."""

    def __init__(self, failed: list[int], events: list[tuple[int, int]], cause: BaseException):
        super().__init__(f"a forward pass failed ({type(cause).__name__}: {cause}); requests {failed} failed with it")
        self.failed, self.events = failed, events


class Engine:
    """Serves many generation requests at once on ``model`` (a python_ref GPT-2, Llama or MLA model)
    with ``cache``; each request's tokens are those ``python_ref.generate`` gives it alone (greedy, or
    sampled with the request's own generator). The cache must hold what the model stores
    (``model.kv_shape``: layers, KV heads, head width; a latent cache's ``value_dim``, ``model.value_dim``).
    An MLA model (absorbed form) is served by a latent cache, ``PagedKVCache(..., head_dim=kv_lora_rank
    + qk_rope_head_dim, value_dim=kv_lora_rank)``, which keeps one latent row per token for all heads.

    ``chunk_size``: the most prompt tokens a request reads per step. ``max_batch_size``: the most
    requests running at once (None: as many as the pool holds). ``eos_id``: a request that generates
    it stops there (each request may have stop tokens of its own too, ``add_request(stop_ids=...)``).
    ``prefix_caching``: whether a prompt takes the cached blocks of an earlier
    prompt with the same start (False computes every prompt in full: the baseline that shows what
    prefix caching saves).

    ``compile_decode_passes``: the decode passes (one new token in every row) run under
    ``torch.compile`` (:func:`compile_decode`); a step that reads prompt chunks too runs eagerly,
    its decoding rows in the same pass (one read of the weights beats a compiled pass and an eager
    one). The pool's bookkeeping stays out of the graph: the cache begins each step eagerly (blocks
    reserved, block tables made) and the compiled model runs on the step's
    :class:`~kvcache_ext.paged.PagedStep`. The rows, the tables' width and the lengths are dynamic,
    so two compilations serve every pass: the first pass of one row and the first of several compile
    (10-17 s each for a 4-layer 1B model on a 2-core CPU, bench/engine_decode.py). The tokens are the
    eager engine's.

    A cache with a ``window`` serves sliding-window models: each request's blocks that leave its
    window return to the pool, so a request holds at most ``ceil((window - 1 + chunk_size) /
    block_size) + 1`` blocks however long its prompt and output, and only that must fit the pool.
    """

    def __init__(
        self,
        model,
        cache: PagedKVCache,
        chunk_size: int = 64,
        max_batch_size: int | None = None,
        eos_id: int | None = None,
        prefix_caching: bool = True,
        compile_decode_passes: bool = False,
    ):
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be a positive int or None, got {max_batch_size!r}")
        if eos_id is not None and (not isinstance(eos_id, int) or isinstance(eos_id, bool)):
            raise TypeError(f"eos_id must be an int token id or None, got {eos_id!r}")
        for name, flag in (("prefix_caching", prefix_caching), ("compile_decode_passes", compile_decode_passes)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if cache.pool.sequences:
            raise ValueError("the cache must hold no sequences: the engine names them by its request ids")
        shape = getattr(model, "kv_shape", None)  # what the model's layers store, where it says
        held = dict(num_layers=cache.num_layers, kv_heads=cache.kv_heads, head_dim=cache.head_dim)
        if shape is not None and shape != held:
            raise ValueError(
                f"the cache holds {cache.kv_heads} KV heads of {cache.head_dim} values in {cache.num_layers} layers; "
                f"the model stores {shape['kv_heads']} of {shape['head_dim']} in {shape['num_layers']}"
            )
        if cache.value_dim is not None and cache.value_dim != getattr(model, "value_dim", None):
            raise ValueError(
                f"a latent cache (value_dim={cache.value_dim}) holds rows whose first value_dim columns are the "
                "values: it serves a model that stores such rows (python_ref's MLA model in its absorbed form, "
                f"value_dim = kv_lora_rank), and this model's value_dim is {getattr(model, 'value_dim', None)}"
            )
        self.model, self.cache = model.eval(), cache
        self.chunk_size, self.max_batch_size, self.eos_id = chunk_size, max_batch_size, eos_id
        self.prefix_caching = prefix_caching
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # in order of admission
        self._requests: dict[int, _Request] = {}
        self._next_id = 0
        self.preemptions = 0  # how often a request was preempted so far
        self.reused_tokens = 0  # prompt tokens taken from the prefix cache (pool or tier) instead of computed
        self.prompt_tokens_computed = 0  # prompt positions fed to the model (again after a preemption)
        self._compiled_pass = compile_decode(self.model) if compile_decode_passes else None

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        top_p: float | None = None,
        stop_ids: Iterable[int] = (),
    ) -> int:
        """Queue a request; it joins the batch at the next :meth:`step`. Returns its id.
        ``temperature``, ``top_k``, ``top_p``, ``generator``: as for ``python_ref.generate`` (0:
        greedy; a generator of its own makes a sampled request's tokens its own, whatever else runs).
        ``stop_ids``: tokens that end this request (as well as the engine's ``eos_id``)."""
        request = self._checked_request(prompt, max_new_tokens, temperature, top_k, generator, top_p, stop_ids)
        return self._enqueue([request])[0]

    def _checked_request(self, prompt, max_new_tokens, temperature, top_k, generator, top_p, stop_ids) -> _Request:
        prompt = list(prompt)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"prompt must be a non-empty sequence of int token ids, got {prompt!r}")
        vocab = self.model.cfg.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {prompt}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        check_top_p(top_p)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        stop_ids = frozenset(stop_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_ids):
            raise ValueError(f"stop_ids must be token ids in [0, {vocab}), got {sorted(stop_ids, key=repr)}")
        if self.eos_id is not None:
            stop_ids |= {self.eos_id}
        # The last generated token is never fed back: the model reads prompt + max_new_tokens - 1.
        fed = len(prompt) + max_new_tokens - 1
        if fed > self.model.cfg.context_length:
            raise ValueError(
                f"the model has {self.model.cfg.context_length} positions: a prompt of {len(prompt)} tokens "
                f"with max_new_tokens={max_new_tokens} needs {fed}"
            )
        pool = self.cache.pool
        needed = pool.max_blocks_held(fed, self.chunk_size)
        if needed > pool.num_blocks:
            window = "" if pool.window is None else f" with a window of {pool.window} and chunks of {self.chunk_size}"
            raise ValueError(
                f"the request needs room for {fed} tokens, {needed} blocks at once{window}; the whole pool holds "
                f"{pool.num_blocks * pool.block_size} ({pool.num_blocks} blocks)"
            )
        request = _Request(-1, prompt, len(prompt), max_new_tokens, temperature, top_k, top_p, generator, stop_ids)
        if max_new_tokens == 0:
            request.finish_reason = "length"
        return request

    def _enqueue(self, requests: list[_Request]) -> list[int]:
        """Queue requests already checked, numbering them."""
        for request in requests:
            request.request_id = self._next_id
            self._next_id += 1
            self._requests[request.request_id] = request
            if not request.done:
                self._waiting.append(request)
        return [request.request_id for request in requests]

    def output(self, request_id: int) -> list[int]:
        """The tokens request ``request_id`` has generated so far."""
        return list(self._request(request_id).generated)

    def is_finished(self, request_id: int) -> bool:
        return self._request(request_id).done

    def result(self, request_id: int) -> RequestResult:
        """What request ``request_id`` has generated so far, how much of its prompt it reused, and
        why it finished (if it has); see :class:`RequestResult`."""
        r = self._request(request_id)
        return RequestResult(r.request_id, list(r.generated), r.prompt_length, r.cached_tokens, r.finish_reason)

    def cancel(self, request_id: int) -> None:
        """Stop request ``request_id`` (waiting or running) now: its blocks return to the pool and it
        finishes with ``finish_reason="cancelled"``, its tokens so far kept until collected. A request
        already finished is left as it is. Call it between steps, as every other method."""
        request = self._request(request_id)
        if request.done:
            return
        if request in self._running:
            self.cache.free(request_id)
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        request.finish_reason = "cancelled"

    def warm_up(self) -> None:
        """Runs now what the first decode passes would compile (with ``compile_decode_passes``; else
        there is nothing to do): a request of two tokens alone, then two at once, then one more than
        each row bound of the model's layers at once (:func:`~kvcache_ext.linear.path_row_bounds`:
        past one, a layer takes another product, a graph of its own) where ``max_batch_size`` allows,
        each asking for two new tokens, then forgotten (their blocks freed, the counters as they were;
        other finished requests not collected yet stay). A server calls it before it listens, so that
        no client waits for a compilation. Refused while requests run or wait. A pool too small to run
        a pass's requests at once, or a stop token first, leaves that pass to compile later."""
        if self._compiled_pass is None:
            return
        if self._running or self._waiting:
            raise RuntimeError("warm_up() runs before the first request: requests are running or waiting")
        counters = self.preemptions, self.reused_tokens, self.prompt_tokens_computed
        row_counts = [1, 2] + [
            bound + 1
            for bound in path_row_bounds(self.model)
            if bound >= 2 and (self.max_batch_size is None or bound < self.max_batch_size)
        ]
        for rows in row_counts:
            prompts = [[k % 2, (k + 1) % 2] for k in range(rows)]
            ids = [self.add_request(prompt, 2) for prompt in prompts]
            while not all(self.is_finished(request_id) for request_id in ids):
                self.step()
            for request_id in ids:
                del self._requests[request_id]
        self.preemptions, self.reused_tokens, self.prompt_tokens_computed = counters

    def pop_finished(self) -> dict[int, list[int]]:
        """The generated tokens of every finished request not collected yet, by request id (in id
        order); the engine forgets them (``output``/``is_finished`` then raise KeyError for them).
        Unfinished requests stay."""
        finished = {request_id: r.generated for request_id, r in self._requests.items() if r.done}
        for request_id in finished:
            del self._requests[request_id]
        return finished

    def _request(self, request_id: int) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(
                f"no request {request_id!r}: never added, or finished and collected (generate, pop_finished)"
            ) from None

    def prefix_stats(self) -> dict:
        """What the prefix cache saved so far, per tier: ``"pool"`` (blocks found in the pool:
        ``hits``, ``tokens_reused``), with a host tier ``"host"``, with a disk tier ``"disk"`` (their
        :class:`~kvcache_ext.prefix_tiers.TierStats`: hits, tokens reused, bytes read and written,
        seconds loading and storing, files rejected and evicted, and ``enabled``)."""
        pool = self.cache.pool
        stats = {"pool": {"hits": pool.reused_blocks, "tokens_reused": pool.reused_blocks * pool.block_size}}
        if self.cache.host_tier is not None:
            stats["host"] = self.cache.host_tier.stats.as_dict()
        if self.cache.disk_tier is not None:
            stats["disk"] = {**self.cache.disk_tier.stats.as_dict(), "enabled": self.cache.disk_tier.enabled}
        return stats

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        """Requests admitted (holding blocks) and not finished."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued, not admitted yet (or preempted and waiting to be readmitted)."""
        return len(self._waiting)

    # -- running ---------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], **sampling
    ) -> list[list[int]]:
        """The continuation of each prompt (generated tokens only), served together.
        ``max_new_tokens``: one for all, or one per prompt; ``sampling``: ``temperature``, ``top_k``,
        ``top_p``, ``stop_ids`` (for all) and ``generators`` (one per prompt), as :meth:`add_request`
        takes them."""
        request_ids = self._add_all(prompts, max_new_tokens, **sampling)
        while self.has_unfinished:
            self.step()
        return [self._requests.pop(request_id).generated for request_id in request_ids]

    def stream(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], **sampling
    ) -> Iterator[tuple[int, int]]:
        """Like :meth:`generate`, yielding ``(request_id, token)`` as each token is chosen; request ids
        are consecutive, in the order of ``prompts``. The engine keeps the finished requests until
        :meth:`pop_finished` collects them."""
        self._add_all(prompts, max_new_tokens, **sampling)
        while self.has_unfinished:
            yield from self.step()

    @torch.inference_mode()
    def step(self) -> list[tuple[int, int]]:
        """Admit waiting requests, run every running one a piece further; returns the tokens chosen,
        as ``(request_id, token)`` in order. Finished requests are kept until :meth:`pop_finished`.
        A forward pass that raises fails its requests and raises :class:`StepFailedError`."""
        self._admit()
        events = []
        for group in self._passes(list(self._running)):
            try:
                events += self._forward(group)
            except Exception as error:
                failed = [r for r in group if r in self._running]
                self.cache.abort_step()
                for request in failed:
                    self.cache.free(request.request_id)
                    self._running.remove(request)
                    request.finish_reason = "error"
                raise StepFailedError([r.request_id for r in failed], events, error) from error
        return events

    def _pending(self, request: _Request) -> int:
        """Tokens of ``request`` the next pass feeds: its pending tokens, at most ``chunk_size``."""
        return min(len(request.tokens) - request.computed, self.chunk_size)

    def _passes(self, running: list[_Request]) -> list[list[_Request]]:
        """The forward passes of a step: one for every row (the model packs the padding out of its
        products), unless it would need more positions than the model has: a pass needs its largest
        cached length plus its longest piece within them (attention runs every row as long as its
        longest piece), so rows are taken by cached length, shortest first, and a pass closes when
        the next row would not fit."""
        context = self.model.cfg.context_length
        passes = []
        current, deepest, longest = [], 0, 0
        for request in sorted(running, key=lambda r: r.computed):
            pending = self._pending(request)
            if current and max(deepest, request.computed) + max(longest, pending) > context:
                passes.append(current)
                current, deepest, longest = [], 0, 0
            current.append(request)
            deepest, longest = max(deepest, request.computed), max(longest, pending)
        if current:
            passes.append(current)
        return passes

    def _add_all(
        self, prompts, max_new_tokens, temperature=0.0, top_k=None, generators=None, top_p=None, stop_ids=()
    ) -> list[int]:
        counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        generators = [None] * len(prompts) if generators is None else list(generators)
        for name, values in (("max_new_tokens", counts), ("generators", generators)):
            if len(values) != len(prompts):
                raise ValueError(f"{name} must be one per prompt ({len(prompts)}), got {len(values)}")
        # Every request is checked before the first is queued: a refused call queues nothing.
        return self._enqueue(
            [
                self._checked_request(prompt, count, temperature, top_k, generator, top_p, stop_ids)
                for prompt, count, generator in zip(prompts, counts, generators)
            ]
        )

    def _admit(self) -> None:
        # Admit a request only if the free blocks hold all its tokens so far (a windowed cache: the
        # blocks of its window and a chunk), a block to grow into, and a block for each running
        # request; else it would just preempt others (or be preempted) before its prompt is read.
        # Alone, a request always fits (add_request checks).
        free = self.cache.pool.num_free_blocks
        for request in list(self._waiting):
            if self.max_batch_size is not None and len(self._running) >= self.max_batch_size:
                break
            if self.prefix_caching and self._prefix_in_flight(request):
                continue  # admitted once a running request has stored (and registered) the prefix
            wanted = self.cache.pool.max_blocks_held(len(request.tokens), self.chunk_size) + 1
            if self._running and free < wanted + len(self._running):
                break
            self._waiting.remove(request)
            request.computed = self.cache.add_sequence(
                request.request_id, request.tokens if self.prefix_caching else None
            )
            self.reused_tokens += request.computed
            if not request.admitted:  # readmitted after a preemption, it may reuse its own blocks: not counted
                request.cached_tokens = min(request.computed, request.prompt_length)
                request.admitted = True
            self._running.append(request)
            free -= wanted

    def _prefix_in_flight(self, request: _Request) -> bool:
        """Whether a running request is still computing a full block that ``request`` could reuse:
        requests with a common system prompt arriving together would otherwise all compute it."""
        block_size = self.cache.block_size
        first_block = request.tokens[:block_size]
        if len(request.tokens) <= block_size:
            return False  # add_sequence leaves at least one token to compute: nothing to reuse
        for other in self._running:
            if other.computed >= len(other.tokens) - 1 or other.tokens[:block_size] != first_block:
                continue
            common = 0
            while common < min(len(request.tokens) - 1, len(other.tokens)) and (
                request.tokens[common] == other.tokens[common]
            ):
                common += 1
            if common // block_size * block_size > other.computed:
                return True
        return False

    def _forward(self, group: list[_Request]) -> list[tuple[int, int]]:
        """One forward pass over ``group``: each request's next piece (its pending tokens, at most
        ``chunk_size``), right-padded to the longest."""
        group = [r for r in group if r in self._running]  # an earlier pass of this step may have preempted some
        while group:
            counts = [self._pending(r) for r in group]
            new_tokens = [r.tokens[r.computed : r.computed + count] for r, count in zip(group, counts)]
            longest = max(counts)
            padded = torch.tensor([tokens + [0] * (longest - len(tokens)) for tokens in new_tokens])
            self.cache.schedule([r.request_id for r in group], new_tokens)
            step_counts = torch.tensor(counts)
            try:
                if self._compiled_pass is not None and longest == 1:
                    logits = self._compiled_decode(padded.to(self.cache.device))
                else:
                    logits = self.model(
                        padded.to(self.cache.device), self.cache, counts=step_counts, logits_at=step_counts - 1
                    )
                break
            except PoolExhaustedError:  # raised before the pass changed anything
                victim = max(self._running, key=lambda r: r.request_id)  # the newest request
                self._preempt(victim)
                group = [r for r in group if r is not victim]
        else:
            return []
        events = []
        last_logits = logits[:, 0]  # (rows, vocab): each row's last new token
        with _one_thread():
            for row, (request, count) in enumerate(zip(group, counts)):
                self.prompt_tokens_computed += max(
                    0, min(request.computed + count, request.prompt_length) - request.computed
                )
                request.computed += count
                if request.computed < len(request.tokens):
                    continue  # more of the prompt to read
                token = int(
                    choose_next_token(
                        last_logits[row : row + 1].float(),
                        request.temperature,
                        request.top_k,
                        request.generator,
                        request.top_p,
                    )
                )
                request.tokens.append(token)
                events.append((request.request_id, token))
                if token in request.stop_ids:
                    request.finish_reason = "stop"
                elif len(request.generated) >= request.max_new_tokens:
                    request.finish_reason = "length"
                if request.done:
                    self.cache.free(request.request_id)
                    self._running.remove(request)
        return events

    def _compiled_decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """A decode pass (``tokens`` ``(rows, 1)``) through the compiled model: logits ``(rows, 1, vocab)``."""
        positions = self.cache.start_step(1)  # PoolExhaustedError here, with nothing changed, as in eager
        with torch.compiler.config.patch(dynamic_sources=DYNAMIC_IN_A_DECODE_PASS):
            logits = self._compiled_pass(tokens, self.cache.step_view(positions))
        self.cache.finish_step()
        return logits

    def _preempt(self, request: _Request) -> None:
        self.cache.free(request.request_id)
        self._running.remove(request)
        request.computed = 0
        self._waiting.appendleft(request)
        self.preemptions += 1
