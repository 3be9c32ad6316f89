"""How large a runner's context is: the model's trained context, the automatic size, the clamp (pure).

A runner never runs past the context its model was trained on (llama.cpp extrapolates RoPE
beyond it and answers badly; a BERT model's position table simply ends there). The trained
context is ``<arch>.context_length``, or longer where the GGUF declares RoPE scaling
(``<arch>.rope.scaling.type`` linear or yarn with a ``factor`` > 1): then
``original_context_length * factor``, as llama.cpp's YaRN models (Qwen2.5 at 32,768 x 4) declare.

**The automatic context** (no ``TRIOSHED_CONTEXT_LENGTH``, no ``num_ctx`` in ``models.toml``, none
in the request) is chosen per request from what it needs: an upper bound on its prompt's tokens
(never fewer tokens than UTF-8 bytes of its text, plus the chat template's own text) plus its
output budget, rounded up to a bucket (4,096, 8,192, 16,384… doubling), at least
:data:`FLOOR` and at most the trained context and ``TRIOSHED_CONTEXT_MAX``. A request that fits
a loaded runner's context is served by it (a larger runner serves a smaller request); one that
does not reloads the model at its bucket. Buckets keep the number of distinct sizes, and so of
reloads, small: at most ``log2(trained / FLOOR) + 1`` sizes per model.

**When it does not fit.** The bound is only a bound (it counts every byte as a token; a real
tokenizer makes three to four times fewer). Where the bound's bucket does not fit the memory the
placement can give (the planner's 507), would put layers in system memory where a smaller one
keeps them all on the GPUs, would evict loaded models where the smallest fits beside them, or
llama.cpp runs out of memory loading it (its own words: ``failed to allocate``,
``vk::OutOfDeviceMemoryError``, ``out of memory``), the load is tried at the next smaller bucket
(:func:`smaller_context`), and so on down to :data:`FLOOR`, or to the bucket of the request's
exact count where a runner has counted it. The request is then counted exactly with that runner
(:class:`Shrunk` says why it is smaller): a prompt it holds is served; one it does not grows the
runner to the bucket of its count where the larger size only spilled or evicted, and gets a 507
naming the tokens and the memory where every size between was found not to fit.
A ``num_ctx`` set by the user is never lowered: it loads as set, or fails.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trioshed.core.model import RunnerOptions

#: llama.cpp pads a context to a multiple of this many cells.
CTX_PAD = 256

#: The smallest automatic context: what every runner got before sizes were automatic, and what
#: Ollama gives on machines with less than 24 GiB of GPU memory.
FLOOR = 4096

#: Tokens a chat template adds per message at most, beyond the template's own text (role
#: markers, separators): generous for every template seen (gemma3: 5, llama3: 5, qwen: 5).
PER_MESSAGE = 16


def trained_context(
    context_length: int, *, scaling_type: str = "", factor: float = 0.0, original: int = 0
) -> int:
    """The context the model was trained for, from its GGUF keys (0: unknown)."""
    base = max(0, int(context_length))
    if scaling_type in ("linear", "yarn", "longrope") and factor > 1.0:
        scaled = int((original or base) * factor)
        return max(base, scaled)
    return base


def bucket(tokens: int) -> int:
    """The smallest bucket holding ``tokens``: FLOOR, 2*FLOOR, 4*FLOOR…"""
    size = FLOOR
    while size < tokens:
        size *= 2
    return size


def automatic_context(need: int, trained: int, cap: int = 0) -> int:
    """The automatic ``num_ctx`` for a request needing ``need`` tokens: its bucket, within the
    trained context (0: unknown, no limit) and ``cap`` (TRIOSHED_CONTEXT_MAX; 0: none)."""
    size = bucket(need)
    limit = trained if trained > 0 else size
    if cap > 0:
        limit = min(limit, max(cap, 4))
    return max(4, min(size, limit))


@dataclass(frozen=True)
class Shrunk:
    """Where an automatic context was made smaller than the request asked."""

    asked: int  # the num_ctx the request asked for
    tried: int  # the last num_ctx that was not taken
    why: str  # why not, in a few words (the memory it needed, or llama.cpp's failure)
    #: whether that size would fit, only with layers in system memory: a request the smaller
    #: runner does not hold may still grow to it (else every size between was found not to fit)
    fits_larger: bool = False


def smaller_context(num_ctx: int, floor: int) -> int | None:
    """The next automatic size below ``num_ctx`` to try after ``num_ctx`` did not fit: the largest
    bucket smaller than it, at least ``floor`` (0: the size was set by the user, never lowered);
    None when nothing smaller is allowed (the request fails)."""
    if floor <= 0 or num_ctx <= floor:
        return None
    size = bucket(num_ctx) // 2  # bucket(n) is the smallest at least n: half of it is below n
    while size >= num_ctx:  # (below FLOOR, where buckets do not reach)
        size //= 2
    return max(floor, size)


#: How llama.cpp b10068 says an allocation failed (a buffer, the KV cache, a compute graph; the
#: Vulkan backend's ``vk::OutOfDeviceMemoryError``; CUDA's and Metal's own words).
_OUT_OF_MEMORY = (
    "failed to allocate",
    "out of memory",
    "outofdevicememory",
    "unable to allocate",
)


def out_of_memory(message: str) -> str:
    """The line of a failed load's output that says it ran out of memory (a smaller context may
    fit), at most 200 characters; "" when none does."""
    for line in message.splitlines():
        text = line.lower()
        if any(words in text for words in _OUT_OF_MEMORY):
            return line.strip()[:200]
    return ""


def clamp(options: RunnerOptions, trained: int) -> RunnerOptions:
    """``options`` within the model: ``num_ctx`` at most the trained context (0: unknown, kept),
    ``num_batch`` at most ``num_ctx`` (llama.cpp's micro-batch is at most the batch)."""
    num_ctx = min(options.num_ctx, trained) if trained > 0 else options.num_ctx
    num_batch = min(options.num_batch, num_ctx)
    if (num_ctx, num_batch) == (options.num_ctx, options.num_batch):
        return options
    return replace(options, num_ctx=num_ctx, num_batch=num_batch)


def tokens_upper_bound(text_bytes: int, messages: int = 1, template_bytes: int = 0, output: int = 0) -> int:
    """At most how many tokens a request's prompt and answer take: a tokenizer never makes more
    tokens than UTF-8 bytes (byte fallback is one token per byte, at worst), a template adds at
    most its own text and a few markers per message; plus the output budget asked for."""
    return max(0, text_bytes) + max(0, template_bytes) + PER_MESSAGE * max(1, messages) + max(0, output)


def slot_context(options: RunnerOptions) -> int:
    """The context of one of a runner's slots as llama.cpp sizes it: ``num_ctx x num_parallel``
    cells padded to 256, shared out per slot (``trioshed.core.estimate`` counts the same)."""
    n_ctx = _pad(options.kv_cells)
    return _pad(n_ctx // options.num_parallel) if options.num_parallel > 1 else n_ctx


def _pad(n: int, to: int = CTX_PAD) -> int:
    return -(-n // to) * to
