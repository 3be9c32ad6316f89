"""Warm returns on a runner: save its slots before it stops, restore one before a request.

:class:`WarmReturns` is process-wide (the store, the save bound, the counters); each ready
runner gets a :class:`RunnerSlots` (``LlamaServer.slots``) holding its cache key. The calls to
llama-server, as b10068 answers them (checked against the binary, ``tests/e2e/test_warm_returns.py``):

- ``GET /slots``: one object per slot; ``id_task`` appears once a task has run in it,
  ``is_processing`` while one runs.
- ``POST /slots/{id}?action=save`` with ``{"filename": NAME}`` (a bare name inside
  ``--slot-save-path``; a path is 400 "Invalid filename"): 200 ``{"id_slot", "filename",
  "n_saved" (tokens), "n_written" (bytes), "timings": {"save_ms"}}``. An empty slot saves
  0 tokens (a 20-byte file).
- ``POST /slots/{id}?action=restore`` with ``{"filename": NAME}``: 200 ``{"n_restored",
  "n_read", "timings": {"restore_ms"}}``; 400 "Unable to restore slot, no available space in KV
  cache or invalid slot save file" for a missing, cut or foreign-shaped file, or one with more
  tokens than the slot's context. The runner then serves as if nothing happened.
- ``POST /tokenize`` ``{"content", "add_special": true, "parse_special": true}`` gives the tokens
  ``/completion`` and the chat endpoints compute for a prompt (``add_special`` false drops the
  BOS and matches nothing); ``POST /apply-template`` renders a chat body's messages.

Save: in the runner's exit path (``open_llama_server``), before the child is stopped, for every
unload (keep-alive expiry, eviction, reload, shutdown), inside ``move_on_after(save_timeout,
shield=True)``: an unload never waits longer. A save cut by the bound leaves a ``partial-`` file,
deleted at once (and by the store's next ``open`` if trioshed dies first).

An adapter group's runner (:mod:`trioshed.core.adapters`) computes each slot under the
adapters its last request applied: a slot is saved under the key of those adapters (its
``params.lora`` in ``GET /slots``) and restored only for a request that applies the same ones.
llama-server clears a slot whose next request brings another ``lora`` list than its last (a
fresh slot's is empty) and a restore does not set it: the slot is first given the request's list
by a request of one prompt token and no output (``id_slot``), then restored (measured on
b10068: 93 of 94 prompt tokens reused, the same answer; unprimed, all 94 computed again).

Restore: :meth:`RunnerSlots.restore_for`, called by the HTTP edge just before it sends a
generation to the runner (``trioshed.api.pipeline.upstream``), while the runner still has a slot that no
task has used (a runner just loaded; with one slot, its first request). A restore that fails is
logged and counted; the request proceeds.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import trio

from trioshed.core.adapters import scales_of, selects
from trioshed.core.kvcache import (
    MIN_MATCH_TOKENS,
    CacheKey,
    FileIdentity,
    SavedSlot,
    choose_restore,
)
from trioshed.runner.client import ConnectionFailed, UpstreamPool
from trioshed.runner.slotstore import SlotStore, file_identity

log = logging.getLogger(__name__)

__all__ = ["MEDIA_NOTE", "RunnerSlots", "WarmReturns", "WarmStats", "cache_key"]

#: What a runner with a projector says of its warm returns: llama-server (b10068) answers a save
#: of a slot holding image or audio tokens 501 ("a pure-text prefix is supported"), so such a
#: slot is skipped, quietly and counted (``saves_skipped``), and its text-only slots are saved.
MEDIA_NOTE = "text-only slots are saved; a slot holding image or audio tokens is not (llama-server saves only pure text)"


@dataclass(frozen=True)
class WarmStats:
    """Running totals of warm returns (``/metrics``: ``trioshed_kv_*``)."""

    saves: int = 0
    save_failures: int = 0
    saves_skipped: int = 0  # over the disk budget, or cut by TRIOSHED_KV_SAVE_TIMEOUT
    restores: int = 0
    restore_failures: int = 0
    hits: int = 0
    misses: int = 0
    bytes_on_disk: int = 0
    files: int = 0
    save_seconds: float = 0.0
    restore_seconds: float = 0.0


def cache_key(model: Any, kv_cache_type: str, flash_attention: bool, swa_full: bool) -> CacheKey:
    """The key of a runner of ``model`` (a ModelSpec): reads the files' identities (blocking).
    A runner that selects adapters per request (an adapter group's) keys each slot by the
    adapters applied to it (:meth:`RunnerSlots.key_for`): its own key names none."""
    fixed = () if selects(model) else tuple(model.adapters)
    return CacheKey(
        model=file_identity(model.path),
        adapters=tuple(file_identity(a) for a in fixed),
        projector=file_identity(model.projector) if model.projector else None,
        kv_cache_type=kv_cache_type,
        flash_attention=flash_attention,
        swa_full=swa_full,
        scales=scales_of(model) if fixed else (),
    )


def applied_key(key: CacheKey, loaded: tuple[FileIdentity, ...], lora: object) -> CacheKey | None:
    """The key of a slot of an adapter group's runner that ran with ``lora`` (the request's
    list, or the slot's as ``GET /slots`` shows it): ``key`` with the adapters applied, by their
    files, at their scales. None when the list does not say (no list: the global scales)."""
    if not isinstance(lora, list) or not lora:
        return None
    applied: dict[int, float] = {}
    for item in lora:
        if not isinstance(item, dict) or not isinstance(item.get("id"), int) or not isinstance(item.get("scale"), int | float):
            return None
        if item["scale"] != 0 and 0 <= item["id"] < len(loaded):
            applied[item["id"]] = applied.get(item["id"], 0.0) + float(item["scale"])
    chosen = sorted((loaded[i], scale) for i, scale in applied.items())  # FileIdentity orders by path
    return replace(key, adapters=tuple(f for f, _ in chosen), scales=tuple(s for _, s in chosen))


class WarmReturns:
    """The process's saved slots: one store, one bound on saves, the counters."""

    def __init__(self, store: SlotStore, save_timeout: float, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.save_timeout = save_timeout
        self._clock = clock
        self._counts: dict[str, int] = {}
        self._seconds = {"save": 0.0, "restore": 0.0}

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    async def open(self) -> None:
        """Index the folder (and delete what a crash left), in a worker thread."""
        if self.enabled:
            await trio.to_thread.run_sync(self.store.open)

    def statistics(self) -> WarmStats:
        files = self.store.entries()
        return WarmStats(
            **self._counts,
            bytes_on_disk=sum(e.size for e in files),
            files=len(files),
            save_seconds=self._seconds["save"],
            restore_seconds=self._seconds["restore"],
        )

    def _count(self, name: str) -> None:
        self._counts[name] = self._counts.get(name, 0) + 1

    async def attach(
        self, model: Any, options: Any, kv_cache_type: str, pool: UpstreamPool, *, bytes_per_token: int = 0
    ) -> RunnerSlots | None:
        """The warm-return state of a runner just loaded, or None when the feature is off or
        the model's files cannot be read."""
        if not self.enabled:
            return None
        def identities() -> tuple[CacheKey, tuple[FileIdentity, ...]]:
            key = cache_key(model, kv_cache_type, options.flash_attention, options.swa_full)
            return key, tuple(file_identity(a) for a in model.adapters) if selects(model) else ()

        try:
            key, loaded = await trio.to_thread.run_sync(identities)
        except OSError as exc:
            log.warning("warm returns: off for %s: %s", model.name, exc)
            return None
        slots = RunnerSlots(self, key, model.name, options.num_ctx, pool, bytes_per_token, loaded=loaded)
        if model.projector:
            slots.note = MEDIA_NOTE
        return slots


class RunnerSlots:
    """One runner's warm returns: its key, and whether a slot is still unused."""

    def __init__(
        self, warm: WarmReturns, key: CacheKey, model: str, n_ctx_slot: int, pool: UpstreamPool, bytes_per_token: int,
        *, loaded: tuple[FileIdentity, ...] = (),
    ) -> None:  # fmt: skip
        self.warm = warm
        self.key = key
        self.key_id = key.id
        #: An adapter group's runner: the files of its adapters by id (each slot is keyed by
        #: those applied to it); empty for any other runner (one key for every slot).
        self.loaded = loaded
        self.model = model
        self.n_ctx_slot = n_ctx_slot
        self.bytes_per_token = bytes_per_token
        self._pool = pool
        self._open = True  # a slot may still be unused: restores are looked for
        self._restored: set[int] = set()
        self._lock = trio.Lock()
        #: A word on what is saved (a runner with a projector: :data:`MEDIA_NOTE`), for /api/ps.
        self.note = ""
        self._media_said = False

    # -- restore ---------------------------------------------------------------------------

    def key_for(self, lora: object = None) -> CacheKey | None:
        """The key of a slot that runs a request with ``lora`` (its ``lora`` list; None for a
        runner that loaded no adapters): this runner's own, or, on an adapter group's runner,
        the one naming the adapters applied (None: the list does not say which)."""
        if not self.loaded:
            return self.key
        return applied_key(self.key, self.loaded, lora)

    def may_restore(self, path: str, lora: object = None) -> bool:
        """Whether a request to ``path`` (with ``lora``) may find a slot to restore (else
        :meth:`restore_for` is not worth a wait): a slot still unused, something saved under the
        key of the adapters it applies."""
        if not self._open or path.endswith(("/embedding", "/embeddings")):
            return False
        key = self.key_for(lora)
        return key is not None and self.warm.store.has_key(key.id)

    async def restore_for(self, path: str, body: dict[str, Any] | bytes, lora: object = None) -> SavedSlot | None:
        """Before ``body`` goes to ``path`` (with ``lora``, the request's adapters on this
        runner): restore the saved slot whose tokens it continues, computed under the same
        adapters, into an unused slot. Returns the restored file's entry, or None.

        Cheap once every slot has been used (an attribute check). Never raises for llama-server
        or disk trouble: a failed restore is logged, counted, and the request proceeds.
        """
        if not self.may_restore(path, lora):
            return None
        async with self._lock:
            if not self._open:
                return None
            try:
                return await self._restore_for(body, lora)
            except (ConnectionFailed, OSError, ValueError, KeyError, TypeError) as exc:
                self._open = False  # logged once: this runner looks for no more restores
                self.warm._count("restore_failures")
                log.warning("warm returns: restore for %s failed, computing the prompt instead: %s", self.model, exc)
                return None

    async def _restore_for(self, body: dict[str, Any] | bytes, lora: object = None) -> SavedSlot | None:
        if isinstance(body, bytes):
            body = json.loads(body)
        if not isinstance(body, dict) or not (isinstance(body.get("prompt"), str | list) or isinstance(body.get("messages"), list)):
            return None  # not a generation
        slot = await self._unused_slot()
        if slot is None:
            self._open = False
            return None
        tokens = await self._prompt_tokens(body)
        if tokens is None:
            return None
        store = self.warm.store
        key = self.key_for(lora)
        if key is None:
            return None
        match = choose_restore(store.entries(), key.id, self.n_ctx_slot, tokens, MIN_MATCH_TOKENS)
        if match is None:
            self.warm._count("misses")
            return None
        self.warm._count("hits")
        started = time.perf_counter()
        if not await trio.to_thread.run_sync(store.verify, match.entry):
            self.warm._count("restore_failures")
            return None
        if self.loaded and not await self._prime(slot, tokens[:1], lora):
            return None
        status, raw = await self._pool.post(
            f"/slots/{slot}?action=restore", json.dumps({"filename": f"{match.entry.name}.bin"}).encode()
        )
        if status != 200:
            self.warm._count("restore_failures")
            log.warning(
                "warm returns: llama-server did not restore %s into %s slot %d (%d: %s); computing the prompt instead",
                match.entry.name, self.model, slot, status, raw[:200].decode("utf-8", "replace"),
            )  # fmt: skip
            return None
        elapsed = time.perf_counter() - started
        self._restored.add(slot)
        self.warm._count("restores")
        self.warm._seconds["restore"] += elapsed
        await trio.to_thread.run_sync(store.touch, match.entry.name, self.warm._clock())
        log.info(
            "warm returns: restored %d tokens of %s into slot %d in %.0f ms (%d reused by this prompt)",
            match.entry.n_tokens, self.model, slot, elapsed * 1000, match.reused,
        )  # fmt: skip
        return match.entry

    async def _prime(self, slot: int, tokens: list[int], lora: object) -> bool:
        """Make ``slot``'s adapter list ``lora`` before a restore into it: llama-server clears
        a slot whose next request brings another list than its last (a fresh slot's is empty),
        and a restore does not set it, so a slot restored unprimed would be computed again."""
        body = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "lora": lora, "cache_prompt": False}
        status, raw = await self._pool.post("/completion", json.dumps(body).encode())
        if status != 200:
            self.warm._count("restore_failures")
            log.warning("warm returns: could not set %s slot %d's adapters (%d: %s); computing the prompt instead",
                        self.model, slot, status, raw[:200].decode("utf-8", "replace"))  # fmt: skip
            return False
        return True

    async def _slots(self) -> list[dict[str, Any]]:
        status, raw = await self._pool.get("/slots")
        if status != 200:
            raise ValueError(f"GET /slots answered {status}")
        slots = json.loads(raw)
        if not isinstance(slots, list):
            raise ValueError("GET /slots did not answer a list")
        return slots

    async def _unused_slot(self) -> int | None:
        """An idle slot no task has used and nothing was restored into, if any."""
        for s in await self._slots():
            sid = int(s["id"])
            if not s.get("is_processing") and "id_task" not in s and sid not in self._restored:
                return sid
        return None

    async def _prompt_tokens(self, body: dict[str, Any]) -> list[int] | None:
        """The tokens llama-server will compute for ``body``'s prompt (None: not a prompt)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            if not isinstance(body.get("messages"), list):
                return None
            status, raw = await self._pool.post("/apply-template", json.dumps(body).encode())
            if status != 200:
                return None
            prompt = json.loads(raw)["prompt"]
        status, raw = await self._pool.post(
            "/tokenize", json.dumps({"content": prompt, "add_special": True, "parse_special": True}).encode()
        )
        if status != 200:
            return None
        tokens = json.loads(raw)["tokens"]
        return [int(t) for t in tokens]

    # -- save ------------------------------------------------------------------------------

    async def save_all(self) -> int:
        """Save every idle slot that holds at least ``MIN_MATCH_TOKENS`` tokens; returns how
        many were kept. The caller bounds it (``WarmReturns.save_timeout``)."""
        kept = 0
        try:
            slots = await self._slots()
        except (ConnectionFailed, ValueError, KeyError) as exc:
            log.info("warm returns: cannot list %s's slots to save them: %s", self.model, exc)
            return 0
        for s in slots:
            held = int(s.get("n_prompt_tokens") or 0) + sum(int(n.get("n_decoded") or 0) for n in s.get("next_token") or ())
            if s.get("is_processing") or "id_task" not in s or held < MIN_MATCH_TOKENS:
                continue
            params = s.get("params")
            key = self.key_for(params.get("lora") if isinstance(params, dict) else None)
            if key is None:
                continue  # an adapter group's slot whose adapters it does not say: not kept
            if await self._save(int(s["id"]), held, key.id):
                kept += 1
        return kept

    async def _save(self, slot: int, held: int, key_id: str) -> bool:
        store = self.warm.store
        if not await trio.to_thread.run_sync(store.make_room, held * self.bytes_per_token, abandon_on_cancel=True):
            self.warm._count("saves_skipped")
            log.info("warm returns: not saving %s slot %d: ~%d bytes exceed the disk budget", self.model, slot, held * self.bytes_per_token)
            return False
        temp = store.temp_name()
        started = time.perf_counter()
        committed = False  # once the commit thread has it, the file is the thread's
        try:
            status, raw = await self._pool.post(f"/slots/{slot}?action=save", json.dumps({"filename": temp}).encode())
            if status == 501 and b"image/audio" in raw:  # a slot holding media: never saved
                self.warm._count("saves_skipped")
                if not self._media_said:
                    self._media_said = True
                    log.info("warm returns: not saving %s's slots holding image or audio tokens (llama-server saves only pure text)", self.model)
                return False
            if status != 200:
                self.warm._count("save_failures")
                log.warning("warm returns: llama-server did not save %s slot %d (%d: %s)", self.model, slot, status, raw[:200])
                return False
            committed = True
            # Abandoned (not waited for) when the bound strikes: the commit finishes on its own.
            entry = await trio.to_thread.run_sync(
                store.commit, temp, key_id, self.warm._clock(), abandon_on_cancel=True
            )
            if entry is None:
                self.warm._count("saves_skipped")
                return False
            elapsed = time.perf_counter() - started
            self.warm._count("saves")
            self.warm._seconds["save"] += elapsed
            log.info(
                "warm returns: saved %d tokens of %s slot %d (%d bytes) in %.0f ms",
                entry.n_tokens, self.model, slot, entry.size, elapsed * 1000,
            )  # fmt: skip
            return True
        except ConnectionFailed as exc:
            self.warm._count("save_failures")
            log.warning("warm returns: saving %s slot %d failed: %s", self.model, slot, exc)
            return False
        except trio.Cancelled:
            self.warm._count("saves_skipped")
            log.info("warm returns: saving %s slot %d took longer than TRIOSHED_KV_SAVE_TIMEOUT; not kept", self.model, slot)
            raise
        finally:
            if not committed:
                store.discard(temp)  # one unlink; also done by the next open() if we die first


async def save_before_stop(slots: RunnerSlots | None, exited: bool) -> None:
    """The runner's last act before its child is stopped: save the slots within the bound.

    Cancellation: shielded, so it runs inside an unload's cancelled scope, but never longer than
    ``save_timeout``."""
    if slots is None or exited:
        return
    timeout = slots.warm.save_timeout
    with trio.move_on_after(timeout if timeout > 0 else math.inf, shield=True):
        await slots.save_all()
