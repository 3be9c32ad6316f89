"""What the HTTP routes share: settings, the model store, the scheduler, model facts."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import trio

from trioshed.activity import RecentRequests
from trioshed.api.limits import check_runner_options
from trioshed.config import Settings
from trioshed.core.context import FLOOR, automatic_context, clamp
from trioshed.core.model import MiB, ModelSpec, RunnerOptions
from trioshed.core.speculation import OFF
from trioshed.errors import BadRequest, DraftUnusable, TrioshedError
from trioshed.keys import ApiKey
from trioshed.logtail import LogTail
from trioshed.models.capabilities import generates
from trioshed.models.create import Creator
from trioshed.models.gguf_meta import GGUFMetadata, cached_metadata, read_metadata, unreadable
from trioshed.models.stores import Stores
from trioshed.runner.slots import WarmReturns
from trioshed.scheduler import Scheduler
from trioshed.scheduler.events import Timeline
from trioshed.trace import RequestTrace
from trioshed.usage.recorder import UsageRecorder

if TYPE_CHECKING:  # imported by the first pull: with its HTTP client, memory an idle server never needs
    from trioshed.models.pull import Puller

@functools.lru_cache(maxsize=64)
def _writes_text(header: GGUFMetadata) -> bool:
    """:func:`generates` once per header read, not per request (it scans the tensor names)."""
    return generates(header.fields, (t.name for t in header.tensors))


_RUNNER_FIELDS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread"}


@dataclass
class AppState:
    settings: Settings
    store: Stores
    scheduler: Scheduler
    warm: WarmReturns | None = None  # saved slots (warm returns), for /metrics
    started: float = field(default_factory=time.time)
    log_tail: LogTail | None = None  # the last log lines, for the status page (serve() installs one)
    event_streams: int = 0  # GET /api/events streams open now
    recent: RecentRequests = field(default_factory=RecentRequests)  # the status page's activity
    timeline: Timeline = field(default_factory=Timeline)  # the status page's last hour (serve() samples it)
    #: usage per key and model, and the token budgets' ledger (serve() runs its writer)
    usage: UsageRecorder | None = None
    #: re-read the keys file (the gate installs it; SIGHUP calls it)
    reload_keys: Callable[[], object] | None = None
    keys: tuple[ApiKey, ...] = ()  # the API keys in force (the gate's, reloaded on SIGHUP)
    _puller: Puller | None = None
    _creator: Creator | None = None
    #: headers by the file's identity as the spec was resolved (path, size, mtime): the hot
    #: routes ask two or three times per request, each a realpath and a stat otherwise
    _meta: dict[tuple[str, int, float], GGUFMetadata] = field(default_factory=dict)

    def puller(self) -> Puller:
        """The server's one :class:`Puller` (concurrent pulls of a blob share its download),
        writing into the first folder store's ``pulled/``."""
        if self._puller is None:
            from trioshed.models.pull import Puller

            self._puller = Puller(self.store.pull_root)
        return self._puller

    def request_finished(self, trace: RequestTrace, duration: float) -> None:
        """A request's answer ended: usage per key (trioshed.usage: a list append here), the
        status page's activity list and tokens per second."""
        if self.usage is not None:
            self.usage.record_trace(trace)
        if self.recent.add(trace, duration) is not None and trace.model and trace.eval_tokens:
            end = time.time()
            generating = trace.eval_seconds or max(0.0, duration - (trace.queue_wait or 0.0))
            self.timeline.add_tokens(trace.model, trace.eval_tokens, end - generating, end)

    def creator(self) -> Creator:
        """The server's one :class:`Creator` (creates write one at a time)."""
        if self._creator is None:
            self._creator = Creator(self.store)
        return self._creator

    def runner_options(self, model: ModelSpec, overrides: dict[str, Any], need: int = 0) -> RunnerOptions:
        """The runner options for a request: settings, then the model's defaults, then the request.

        ``num_ctx`` set by none of them is automatic: the bucket of ``need`` (an upper bound on
        the request's tokens, prompt and output; ``trioshed.core.context``). Either way it is
        clamped to the model's trained context, and ``num_batch`` to ``num_ctx``.
        """
        s = self.settings
        header = self._header(model)
        options = RunnerOptions(
            num_ctx=s.context_length or FLOOR,
            num_parallel=model.num_parallel or s.num_parallel,
            num_thread=s.num_thread,
            kv_cache_type=s.kv_cache_type,
            flash_attention=s.flash_attention or s.batch_invariant,
            cache_ram_mib=s.cache_ram // MiB,
            swa_full=s.kv_cache_budget > 0,  # warm returns: a restored SWA slot is reused only so
            extra_args=model.args,
            speculation=self._speculation(model, header),
            draft=self._draft_path(model),
            batch_invariant=s.batch_invariant,
        )
        if "--cache-ram" in model.args:  # models.toml's own size wins, and is the one counted
            at = model.args.index("--cache-ram")
            with contextlib.suppress(IndexError, ValueError):
                options = replace(
                    options, cache_ram_mib=max(0, int(model.args[at + 1])),
                    extra_args=model.args[:at] + model.args[at + 2 :],
                )  # fmt: skip
        merged = {k: v for k, v in model.defaults if k in _RUNNER_FIELDS}
        merged.update({k: v for k, v in overrides.items() if k in _RUNNER_FIELDS and v is not None})
        check_runner_options(merged)
        try:
            options = replace(options, **merged)  # type: ignore[arg-type]
        except TypeError as exc:
            raise BadRequest(f"invalid runner option: {exc}") from None
        trained = self.trained_context(model, header)
        if not s.context_length and "num_ctx" not in merged:
            options = replace(options, num_ctx=automatic_context(need, trained, s.context_max))
        if options.num_ctx < 4:
            options = replace(options, num_ctx=4)
        return clamp(options, trained)

    @staticmethod
    def _header(spec: ModelSpec) -> GGUFMetadata | None:
        """The model's GGUF header (None: unreadable; the estimator and the load report that).
        Read once per file as it is now (cached: a stat), ~40 ms the first time for gemma3."""
        try:
            return cached_metadata(spec.path) or read_metadata(spec.path)
        except (OSError, ValueError):
            return None

    def _speculation(self, spec: ModelSpec, header: GGUFMetadata | None) -> str:
        """The model's speculation setting, else the server's; off for a model that writes no
        text (embedding, rerank): nothing to draft."""
        speculation = spec.speculation or self.settings.speculation
        if speculation == OFF or header is None:  # an unreadable file: the load reports it
            return speculation
        return speculation if _writes_text(header) else OFF

    @staticmethod
    def trained_context(spec: ModelSpec, header: GGUFMetadata | None) -> int:
        """The model's trained context (0: unknown, its ``header`` unreadable).

        ``models.toml`` args that scale RoPE themselves (``--rope-scaling``, ``--rope-scale``,
        ``--yarn-orig-ctx``) are the user's word: ``--rope-scale N`` multiplies the trained
        context by N, the others lift the limit (0)."""
        if header is None:
            return 0
        args = spec.args
        if "--rope-scale" in args:
            try:
                return int(header.context_length * float(args[args.index("--rope-scale") + 1]))
            except (IndexError, ValueError):
                return 0
        if "--rope-scaling" in args or "--yarn-orig-ctx" in args:
            return 0
        return header.trained_context

    def _draft_path(self, model: ModelSpec) -> str:
        """The GGUF file of ``model``'s draft model ("" = none), resolved in the store now."""
        if not model.draft:
            return ""
        try:
            return self.store.resolve(model.draft).path
        except TrioshedError as exc:
            raise DraftUnusable(
                f"model '{model.short_name}': its draft model '{model.draft}' cannot be used: {exc.message}; "
                "fix draft in models.toml"
            ) from None

    async def metadata(self, spec: ModelSpec) -> GGUFMetadata:
        """The GGUF header, read in a worker thread the first time (gemma3: ~40 ms), then cached."""
        key = (spec.path, spec.size, spec.modified)
        meta = self._meta.get(key)
        if meta is not None:
            return meta
        meta = cached_metadata(spec.path)
        if meta is None:
            try:
                meta = await trio.to_thread.run_sync(read_metadata, spec.path)
            except (OSError, ValueError) as exc:  # the client learns the model and the problem only
                raise unreadable(spec.name, spec.path, exc) from None
        if spec.size and spec.modified:  # a spec that knows its file (resolved, not made up)
            if len(self._meta) >= 1024:
                self._meta.clear()
            self._meta[key] = meta
        return meta
