"""One exception tree for everything a client can be told.

::

    TrioshedError (500)                  base: .status, .message, .headers
    ├── BadRequest (400)                 malformed JSON, wrong option types, unsafe model names
    │   └── ContextTooLong               the prompt does not fit the context: each protocol's words
    ├── Unauthorized (401)               TRIOSHED_API_KEY set and the bearer token is missing/wrong
    ├── Forbidden (403)                  a change to a read-only store (an Ollama store), a store
    │                                    symlink pointing outside it (TRIOSHED_ALLOW_SYMLINKS)
    ├── ModelNotFound (404)              no such model in the store
    ├── Conflict (409)                   a store change that would break another model
    ├── PayloadTooLarge (413)
    ├── UnsupportedMediaType (415)       a body that says it is not JSON
    ├── TooManyRequests (429, Retry-After) an API key's limit (concurrent, queued, per minute)
    ├── QueueFull (503, Retry-After)     the pending queue holds TRIOSHED_MAX_QUEUE requests
    ├── LoadCooldown (503, Retry-After)  the model failed to load recently; retried after a back-off
    ├── EventStreamsBusy (503, Retry-After)  GET /api/events already streams to its most pages
    ├── OutOfFiles (503, Retry-After)    the process has no file descriptor left (EMFILE/ENFILE)
    ├── InsufficientMemory (507)         the model cannot fit even with every other model unloaded
    │   ├── PinnedModelsInTheWay         it would fit only by evicting models pinned in models.toml
    │   ├── ContextOutOfMemory           the request needs a larger context than fits in memory
    │   ├── SmallerContextPreferred      (the planner's) a smaller automatic context would not split or evict
    │   └── LoadOutOfMemory              llama.cpp ran out of memory loading the smallest context allowed
    ├── RemoteUnavailable (503)          the model fits only with an RPC server that is down
    ├── DraftUnusable (500)              models.toml's draft model is missing, unreadable, or its
    │                                    vocabulary differs from the target's
    ├── ModelUnreadable (500)            a model's file cannot be read: not a GGUF, damaged, gone
    │                                    (the message names the model; its path is only logged)
    ├── RunnerError (500)                a runner failed
    │   ├── LoadFailed                   llama-server exited or timed out before it was ready
    │   ├── RunnerCrashed                llama-server exited while serving (the next request reloads);
    │                                    a request it had not begun to answer runs again, once, on a
    │                                    new runner, so a client sees this only mid-stream or when the
    │                                    second runner dies too (RunnerCrashed.again names both)
    │   └── RunnerStalled (504)          llama-server sent nothing for TRIOSHED_STREAM_IDLE_TIMEOUT
    ├── NotSupported (501)               Ollama routes trioshed does not serve (push, create); a
    │                                    pulled model llama-server cannot serve (no GGUF, split)
    ├── UpstreamError (502)              llama-server answered with an error status
    ├── RegistryError (502)              a pull's registry is unreachable, refuses, or sends
    │                                    something invalid (a wrong digest, too many bytes)
    ├── InsufficientStorage (507)        no disk space for a pull's download
    └── ShuttingDown (503)

Each message says what happened and what to do. Trio/httpx/OS errors are translated where they
arise (runner, scheduler), never re-raised raw to an HTTP client.
"""

from __future__ import annotations

from collections.abc import Mapping


class TrioshedError(Exception):
    status: int = 500

    def __init__(self, message: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers: dict[str, str] = dict(headers or {})

    def to_json(self) -> dict[str, str]:
        return {"error": self.message}


class BadRequest(TrioshedError):
    status = 400


class ContextTooLong(BadRequest):
    """The prompt takes ``prompt_tokens``, more than the ``n_ctx`` tokens of context it may use
    (the model's trained context, or less where ``num_ctx`` says so). Each protocol words it its
    own way (``trioshed.api.protocols.errors``); this message is Ollama's."""

    def __init__(self, prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(f"the input length exceeds the context length ({prompt_tokens} tokens > {n_ctx} maximum)")
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx

    def openai_message(self) -> str:
        return (
            f"This model's maximum context length is {self.n_ctx} tokens. However, your messages resulted in "
            f"{self.prompt_tokens} tokens. Please reduce the length of the messages."
        )

    def anthropic_message(self) -> str:
        return f"prompt is too long: {self.prompt_tokens} tokens > {self.n_ctx} maximum"


class Unauthorized(TrioshedError):
    status = 401


class Forbidden(TrioshedError):
    status = 403


class Conflict(TrioshedError):
    status = 409


class NotSupported(TrioshedError):
    status = 501


class ModelNotFound(TrioshedError):
    status = 404

    def __init__(self, name: str) -> None:
        super().__init__(f"model '{name}' not found")
        self.name = name


class PayloadTooLarge(TrioshedError):
    status = 413


class UnsupportedMediaType(TrioshedError):
    status = 415


class TooManyRequests(TrioshedError):
    """An API key reached one of its limits (keys file): the message names the key and the limit."""

    status = 429

    def __init__(self, key: str, limit: str, value: int, retry_after: int = 1) -> None:
        super().__init__(
            f"API key '{key}' reached its limit of {value} {limit}; retry after {retry_after} s "
            "or raise the limit in the keys file (TRIOSHED_KEYS_FILE)",
            headers={"Retry-After": str(retry_after)},
        )
        self.limit = limit


class QueueFull(TrioshedError):
    status = 503

    def __init__(self, retry_after: int = 1) -> None:
        super().__init__(
            "server busy, please try again. maximum pending requests exceeded",
            headers={"Retry-After": str(retry_after)},
        )


class EventStreamsBusy(TrioshedError):
    status = 503

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"{limit} status pages already follow GET /api/events (the most at once); close one, or try again later",
            headers={"Retry-After": "5"},
        )


class OutOfFiles(TrioshedError):
    """The process (or the system) has no file descriptor left for a file it must open: a
    passing condition (many connections at once), so 503 with a retry, never a 500."""

    status = 503

    def __init__(self, what: str) -> None:
        super().__init__(
            f"cannot {what}: trioshed has too many files open; try again shortly, or raise its "
            "open-file limit (LimitNOFILE in the service, ulimit -n)",
            headers={"Retry-After": "5"},
        )


class LoadCooldown(TrioshedError):
    status = 503

    def __init__(self, model: str, retry_after: float, cause: str) -> None:
        seconds = max(1, round(retry_after))
        super().__init__(
            f"model '{model}' failed to load recently ({cause}); retrying in {seconds}s",
            headers={"Retry-After": str(seconds)},
        )
        self.retry_after = retry_after


class InsufficientMemory(TrioshedError):
    status = 507

    def __init__(self, model: str, needed: int, available: int, reason: str = "", *, num_ctx: int = 0) -> None:
        gib = 1024**3
        at = f" at a context of {num_ctx:,} tokens" if num_ctx else ""
        message = (
            f"model '{model}' needs an estimated {needed / gib:.2f} GiB{at} but the largest capacity "
            f"available is {available / gib:.2f} GiB even with every other model unloaded"
        )
        if reason:
            message += f" ({reason})"
        super().__init__(message + "; use a smaller model, quantization or num_ctx")
        self.needed = needed
        self.available = available


class PinnedModelsInTheWay(InsufficientMemory):
    """Room for the model exists only if pinned models (never victims) were unloaded."""

    def __init__(self, model: str, needed: int, pinned: tuple[str, ...]) -> None:
        names = ", ".join(f"'{name}'" for name in pinned)
        TrioshedError.__init__(
            self,
            f"model '{model}' (an estimated {needed / 1024**3:.2f} GiB) would fit only by evicting "
            f"pinned models ({names}), and pinned models are never evicted; unload one "
            "(keep_alive 0), unpin it in models.toml, or use a smaller model or num_ctx",
        )
        self.needed = needed
        self.available = 0
        self.pinned = pinned


class ContextOutOfMemory(InsufficientMemory):
    """An automatic context was made smaller to fit the memory (``trioshed.core.context``), and
    the request, counted exactly, needs more than the largest context that fits: Ollama's
    "model requires more memory than is available", with the tokens and the memory."""

    def __init__(self, model: str, prompt_tokens: int, fits: int, tried: int, cause: str) -> None:
        TrioshedError.__init__(
            self,
            f"model '{model}' requires more memory than is available for this request: its prompt is "
            f"{prompt_tokens:,} tokens, and the largest context that fits is {fits:,} tokens ({tried:,} "
            f"tokens: {cause}); use a shorter prompt, a smaller model or quantization, or unload other models",
        )
        self.needed = 0
        self.available = 0
        self.prompt_tokens = prompt_tokens
        self.fits = fits


class SmallerContextPreferred(InsufficientMemory):
    """The planner's word to the scheduler: an automatic context that would put layers in system
    memory, or evict other models, where a smaller one would not (``reason``). The scheduler
    tries the smaller one; no client sees it (where it cannot, the request is planned at its own
    size)."""

    def __init__(self, model: str, num_ctx: int, reason: str) -> None:
        TrioshedError.__init__(self, f"model '{model}' at a context of {num_ctx:,} tokens {reason}")
        self.needed = 0
        self.available = 0
        self.reason = reason


class LoadOutOfMemory(InsufficientMemory):
    """llama.cpp ran out of memory loading an automatic context, and no smaller size holds the
    request (``line``: llama.cpp's own line saying so, without paths)."""

    def __init__(self, model: str, num_ctx: int, line: str) -> None:
        TrioshedError.__init__(
            self,
            f"model '{model}' requires more memory than is available: it ran out of memory loading a context "
            f"of {num_ctx:,} tokens, the smallest that holds this request ({line!r}); use a shorter prompt, "
            "a smaller model or quantization, or unload other models",
        )
        self.needed = 0
        self.available = 0


class RemoteUnavailable(TrioshedError):
    """The model would fit only with RPC servers (``TRIOSHED_RPC_SERVERS``) that do not answer."""

    status = 503

    def __init__(self, model: str, down: tuple[str, ...], retry_after: int = 10) -> None:
        super().__init__(
            f"model '{model}' fits only with RPC servers that do not answer now: {'; '.join(down)}; "
            "start them again (trioshed checks every few seconds) or use a smaller model",
            headers={"Retry-After": str(retry_after)},
        )
        self.down = down


class DraftUnusable(TrioshedError):
    """A model's draft model (``models.toml``'s ``draft``) cannot serve it: not in the store,
    unreadable, or a vocabulary llama.cpp would refuse. The message names both models."""


class ModelUnreadable(TrioshedError):
    """A model's file is not a GGUF file, is damaged (truncated, replaced) or cannot be opened.

    Clients learn the model and the kind of problem; the path and what the file holds go to
    the log only (:func:`trioshed.models.gguf_meta.unreadable`)."""

    status = 500

    def __init__(self, model: str, problem: str) -> None:
        super().__init__(
            f"cannot read model '{model}': {problem}; check or replace its file (the server log names it)"
        )
        self.model = model


class RunnerError(TrioshedError):
    status = 500


class LoadFailed(RunnerError):
    def __init__(self, message: str, *, returncode: int | None = None, stderr_tail: str = "") -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr_tail = stderr_tail


class RunnerCrashed(RunnerError):
    def __init__(self, model: str, returncode: int | None, stderr_tail: str = "", cause: str = "") -> None:
        message = f"llama-server for model '{model}' exited unexpectedly (code {returncode})"
        if cause:
            message += f": {cause}"
        if stderr_tail:
            message += f"; last output: {stderr_tail[-300:]!r}"
        super().__init__(message + "; the next request reloads it")
        self.returncode = returncode
        self.stderr_tail = stderr_tail

    @classmethod
    def again(cls, model: str, first: RunnerError, second: RunnerError) -> RunnerCrashed:
        """A request's second runner died (or stalled) under it too (the first failure, a death or
        a stall, queued it again). Its status is the second failure's."""
        code = second.returncode if isinstance(second, RunnerCrashed) else None
        error = cls(model, code, second.stderr_tail if isinstance(second, RunnerCrashed) else "")
        error.status = second.status
        error.message = (
            f"llama-server for model '{model}' died twice on this request: it ran again on a new runner "
            f"after the first {_what(first)}, and that one {_what(second, 'too')}; check the "
            "model and the request (the runners' output is in trioshed's log)"
        )
        error.args = (error.message,)
        return error


def _what(failure: RunnerError, too: str = "") -> str:
    """What a runner did to a request: "exited" and what a crash's message says after "exited
    unexpectedly" (the code, the cause, the output), or what a stall's says after its model."""
    if isinstance(failure, RunnerCrashed):
        head, _, rest = failure.message.partition("exited unexpectedly ")
        cause = rest.removesuffix("; the next request reloads it") or head
        return f"exited {too} {cause}" if too else f"exited {cause}"
    _, _, rest = failure.message.partition("' ")
    what = (rest or failure.message).removesuffix("; it is being replaced, please retry")
    return f"{what} {too}" if too else what


class RunnerStalled(RunnerError):
    status = 504

    def __init__(self, model: str, seconds: float) -> None:
        super().__init__(
            f"llama-server for model '{model}' sent nothing for {seconds:g}s "
            "(TRIOSHED_STREAM_IDLE_TIMEOUT); it is being replaced, please retry"
        )


class UpstreamError(TrioshedError):
    """llama-server refused the request; a 4xx from it (bad parameters, prompt too long) keeps
    its status, anything else is a 502."""

    status = 502

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None and 400 <= status < 500:
            self.status = status


class RegistryError(TrioshedError):
    """The registry (or Hugging Face) answered with something a pull cannot use, or could not
    be reached; nothing unverified was kept."""

    status = 502


class InsufficientStorage(TrioshedError):
    """The store's filesystem has no room for what a pull would download."""

    status = 507

    def __init__(self, needed: int, free: int, where: str) -> None:
        super().__init__(
            f"not enough disk space to pull: {needed / 1e9:.2f} GB needed in {where}, "
            f"{free / 1e9:.2f} GB free; free some space (what was downloaded so far is kept and "
            "the next pull resumes from there) or point TRIOSHED_MODELS at a larger disk"
        )
        self.needed = needed
        self.free = free


class ShuttingDown(TrioshedError):
    status = 503

    def __init__(self) -> None:
        super().__init__("trioshed is shutting down", headers={"Retry-After": "5"})
