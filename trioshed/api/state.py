"""What the HTTP routes share: settings, the model store, the scheduler, model facts."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trioshed.activity import RecentRequests
from trioshed.config import Settings
from trioshed.core.model import RPC_LIBRARY, ModelSpec, RunnerOptions
from trioshed.core.runner_options import runner_options
from trioshed.errors import DraftUnusable, TrioshedError
from trioshed.fleet.node import Fleet
from trioshed.keys import ApiKey
from trioshed.logtail import LogTail
from trioshed.models.create import Creator
from trioshed.models.gguf_meta import GGUFMetadata, unreadable
from trioshed.models.header_cache import header_of, read_header, writes_text
from trioshed.models.stores import Stores
from trioshed.models.writer import StoreWriter
from trioshed.runner.command import parse_model_args
from trioshed.runner.slots import WarmReturns
from trioshed.scheduler import Scheduler
from trioshed.scheduler.events import Timeline
from trioshed.trace import RequestTrace
from trioshed.usage.keysync import KeySync
from trioshed.usage.recorder import UsageRecorder

if TYPE_CHECKING:  # imported by the first pull: with its HTTP client, memory an idle server never needs
    from trioshed.models.pull import Puller


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
    #: the shared store's keys read on this node (serve() runs it; None without a store)
    key_sync: KeySync | None = None
    #: re-read the keys file (the gate installs it; SIGHUP calls it)
    reload_keys: Callable[[], object] | None = None
    keys: tuple[ApiKey, ...] = ()  # the API keys in force (the gate's, reloaded on SIGHUP)
    #: the one writer of the store's manifests and blob deletions (serve() runs its task)
    writer: StoreWriter = field(default_factory=StoreWriter)
    fleet: Fleet | None = None  # the other nodes (TRIOSHED_FLEET_SECRET; trioshed.fleet)
    _puller: Puller | None = None
    _creator: Creator | None = None

    def puller(self) -> Puller:
        """The server's one :class:`Puller` (concurrent pulls of a blob share its download),
        writing into the first folder store's ``pulled/``."""
        if self._puller is None:
            from trioshed.models.pull import Puller

            self._puller = Puller(self.store.pull_root, writer=self.writer)
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
            self._creator = Creator(self.store, self.writer)
        return self._creator

    def runner_options(self, model: ModelSpec, overrides: dict[str, Any], need: int = 0, *, embedding: bool = False) -> RunnerOptions:
        """The runner options for a request (:func:`trioshed.core.runner_options.runner_options`):
        this gathers what they depend on, the model's header (through the one cache), its
        ``models.toml`` args as parsed and its draft model resolved in the store."""
        try:
            header: GGUFMetadata | None = header_of(model)  # cached: a dict look-up
        except (OSError, ValueError):
            header = None  # unreadable: the estimator and the load report that
        return runner_options(
            self.settings, model, overrides, need=need, header=header,
            writes_text=header is None or writes_text(header), args=parse_model_args(model.args),
            draft=self._draft_path(model), backends=self.backends, embedding=embedding,
        )  # fmt: skip

    @property
    def backends(self) -> tuple[str, ...]:
        """The device libraries a runner may use: system memory's, the GPUs' and, with
        TRIOSHED_RPC_SERVERS, the RPC servers' (flash attention follows them,
        :func:`trioshed.core.runner_options.flash_attention`)."""
        devices = getattr(self.scheduler, "devices", None)
        libraries = {d.library for d in getattr(devices, "gpus", ())}
        if self.settings.rpc_servers:
            libraries.add(RPC_LIBRARY)
        return ("cpu", *sorted(libraries))

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
        """The GGUF header, read in a worker thread the first time (gemma3: ~40 ms), then cached
        (:mod:`trioshed.models.header_cache`)."""
        try:
            return await read_header(spec)
        except (OSError, ValueError) as exc:  # the client learns the model and the problem only
            raise unreadable(spec.name, spec.path, exc) from None
