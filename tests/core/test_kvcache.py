"""Warm returns without a llama-server: the pure decisions (``trioshed.core.kvcache``), the store
on disk (``trioshed.runner.slotstore``: budget, commit, corruption, crash leftovers), and the
save bound against an in-process fake llama-server that never answers a save."""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from trioshed.core.estimate import estimate
from trioshed.core.estimate_kv import kv_cells
from trioshed.core.kvcache import (
    BLOCK,
    HASH_BYTES,
    CacheKey,
    FileIdentity,
    SavedSlot,
    TokenChain,
    choose_restore,
    common_prefix,
    entry_name,
    plan_room,
    sample_ranges,
    slot_file_tokens,
)
from trioshed.core.model import MiB, ModelSpec, Placement, RunnerOptions
from trioshed.runner.client import UpstreamPool
from trioshed.runner.command import build_command
from trioshed.runner.slots import RunnerSlots, WarmReturns, save_before_stop
from trioshed.runner.slotstore import STALE_AFTER, SlotStore, file_identity

MODEL = FileIdentity("/m/a.gguf", 100, 1, "00000000")


def slot_file(tokens: list[int], payload: bytes = b"kv" * 100) -> bytes:
    """A file in llama.cpp's slot format: magic 'ggsq', version 2, token count, tokens, state."""
    return struct.pack(f"<III{len(tokens)}i", 0x67677371, 2, len(tokens), *tokens) + payload


def entry(name: str, tokens: tuple[int, ...] = (), *, key: str = "k", size: int = 10, used: float = 0.0) -> SavedSlot:
    return SavedSlot(name, key, TokenChain.of(tokens), size, 0, used, used)


# -- pure ------------------------------------------------------------------------------------


def test_slot_file_tokens_reads_the_header_and_refuses_other_files() -> None:
    tokens = slot_file_tokens(slot_file([2, 818, 7]))
    assert tokens.tolist() == [2, 818, 7] and tokens.itemsize == 4
    with pytest.raises(ValueError, match="magic"):
        slot_file_tokens(b"nonsense" * 4)
    with pytest.raises(ValueError, match="version 3"):
        slot_file_tokens(struct.pack("<III", 0x67677371, 3, 0))
    with pytest.raises(ValueError, match="cut short"):
        slot_file_tokens(slot_file([1, 2, 3])[:16])


def test_the_key_changes_with_everything_a_slot_file_depends_on() -> None:
    base = CacheKey(MODEL)
    variants = [
        replace(base, model=replace(MODEL, sample="00000001")),  # same size and time, other bytes
        replace(base, model=replace(MODEL, mtime_ns=2)),
        replace(base, adapters=(MODEL,)),
        replace(base, projector=MODEL),
        replace(base, kv_cache_type="q8_0"),
        replace(base, flash_attention=True),
        replace(base, swa_full=True),
    ]
    ids = {base.id, *(v.id for v in variants)}
    assert len(ids) == 1 + len(variants) and all(len(i) == 16 for i in ids)
    assert CacheKey(MODEL).id == base.id


def test_sample_ranges_cover_a_small_file_and_sample_a_large_one() -> None:
    assert sample_ranges(1000) == ((0, 1000),)
    assert sample_ranges(10 * MiB, 64) == ((0, 64), (5 * MiB - 32, 64), (10 * MiB - 64, 64))


def test_choose_restore_takes_the_longest_shared_prefix_of_the_same_key_that_fits() -> None:
    prompt = list(range(100))
    entries = [
        entry("short", tuple(range(40)), used=5),
        entry("long", (*range(80), 999), used=1),
        entry("other-key", tuple(range(100)), key="x"),
        entry("too-big", (*range(100), *(5,) * 200)),  # more tokens than the slot holds
    ]
    match = choose_restore(entries, "k", 256, prompt, min_tokens=32)
    assert match is not None and (match.entry.name, match.reused) == ("long", 80)
    assert choose_restore(entries, "k", 256, list(range(20)), min_tokens=32) is None  # too little shared
    assert choose_restore(entries, "k", 256, [7] * 100, min_tokens=32) is None
    tie = [entry("old", tuple(range(50)), used=1), entry("new", tuple(range(50)), used=2)]
    chosen = choose_restore(tie, "k", 256, prompt, min_tokens=32)
    assert chosen is not None and chosen.entry.name == "new"


def test_the_index_holds_a_chain_of_block_hashes_not_every_token() -> None:
    tokens = list(range(1000, 1000 + 10 * BLOCK + 5))
    held = TokenChain.of(tokens)
    assert (held.n, held.blocks, held.tail.tolist()) == (len(tokens), 10, tokens[-5:])
    assert len(held.chain) == 10 * HASH_BYTES  # 0.5 bytes a token, not 4
    assert TokenChain.of(tokens).chain == held.chain and TokenChain.of(tokens[:80]).chain == held.chain[: 5 * HASH_BYTES]

    def shared(saved: list[int], prompt: list[int]) -> int:
        return TokenChain.of(saved).shared(TokenChain.of(prompt), prompt)

    # Chained: a block equal in tokens but after one that differs does not count.
    other_start = [7, *tokens[1:]]
    assert shared(other_start, tokens) == 0 and TokenChain.of(other_start).chain[-HASH_BYTES:] != held.chain[-HASH_BYTES:]
    # Exact when the whole file is shared (its partial last block compared token by token)...
    assert shared(tokens, tokens) == len(tokens)
    assert shared(tokens, [*tokens, 1, 2, 3]) == len(tokens)
    assert shared(tokens, [*tokens[:-2], -1, -1]) == len(tokens) - 2
    # ...and otherwise to the block: short of the exact count by less than a block.
    for cut in (BLOCK * 3, BLOCK * 3 + 1, BLOCK * 4 - 1):
        diverging = [*tokens[:cut], -1, *tokens[cut + 1 :]]
        assert shared(tokens, diverging) == BLOCK * 3 == shared(diverging, tokens)
    assert shared(tokens, tokens[: BLOCK * 2 + 7]) == BLOCK * 2  # a prompt's partial block is not compared
    assert shared([], tokens) == 0 and shared(tokens[:5], tokens) == 5


def test_choose_restore_counts_to_the_block_and_still_prefers_longer_then_newer() -> None:
    prompt = list(range(200))
    entries = [
        entry("diverges-in-block-5", (*range(5 * BLOCK + 3), *[-1] * BLOCK), used=9),  # 83 shared: counted as 80
        entry("diverges-in-block-6", (*range(6 * BLOCK + 1), *[-1] * BLOCK), used=1),  # 97 shared: counted as 96
        entry("too-big", tuple(range(200))),
    ]
    match = choose_restore(entries, "k", 150, prompt, min_tokens=32)
    assert match is not None and (match.entry.name, match.reused) == ("diverges-in-block-6", 96)
    same_block = [
        entry("older", (*range(5 * BLOCK + 9), *[-1] * BLOCK), used=1),
        entry("newer", (*range(5 * BLOCK + 3), *[-1] * BLOCK), used=2),
    ]
    match = choose_restore(same_block, "k", 150, prompt, min_tokens=32)
    assert match is not None and (match.entry.name, match.reused) == ("newer", 80)  # equal to the block: the newer


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_plan_room_evicts_least_recently_used_first() -> None:
    files = [entry("a", size=40, used=3), entry("b", size=40, used=1), entry("c", size=40, used=2)]
    assert plan_room(files, 200, 50) == ()
    assert plan_room(files, 150, 50) == ("b",)
    assert plan_room(files, 100, 50) == ("b", "c")
    assert plan_room(files, 100, 101) is None  # larger than the whole budget: not saved


def test_entry_names_are_stable_per_key_and_tokens() -> None:
    assert entry_name("k", [1, 2]) == entry_name("k", [1, 2]) != entry_name("k", [1, 3])
    assert entry_name("k", [1, 2]).startswith("k-")


def test_swa_full_and_the_prompt_cache_are_in_the_estimate(gemma_model: Path) -> None:
    from trioshed.models.gguf_meta import read_metadata

    meta = read_metadata(gemma_model)
    plain = RunnerOptions(num_ctx=4096)
    full = replace(plain, swa_full=True, cache_ram_mib=256)
    assert set(kv_cells(meta, full)) == {4096} and min(kv_cells(meta, plain)) < 4096
    a, b = estimate(meta, plain), estimate(meta, full)
    assert b.kv > a.kv and b.prompt_cache == 256 * MiB and a.prompt_cache == 0
    assert b.cpu_total == a.cpu_total + (b.kv - a.kv) + (b.compute_full - a.compute_full) + 256 * MiB
    # llama-server -v, b10068, -c 4096: compute 54.3 MB without --swa-full, 60.6 MB with it
    # (the window's mask grows to full size); KV 28.3 and 75.5 MB, equal to the estimate.
    assert b.compute_full - a.compute_full == 3 * 1024 * 512 * 4  # the mask: 1024 -> 4096 cells
    assert (a.kv, b.kv) == (28311552, 75497472)


def test_the_command_line_sets_the_prompt_cache_and_swa_full() -> None:
    spec = ModelSpec("m", "/m.gguf")
    argv = build_command("llama-server", spec, RunnerOptions(cache_ram_mib=512, swa_full=True), Placement(0), port=1, slot_save_path="/kv")
    assert argv[argv.index("--cache-ram") + 1] == "512" and "--swa-full" in argv
    assert argv[argv.index("--slot-save-path") + 1] == "/kv"
    plain = build_command("llama-server", spec, RunnerOptions(), Placement(0), port=1)
    assert plain[plain.index("--cache-ram") + 1] == "0" and "--swa-full" not in plain and "--slot-save-path" not in plain


# -- the store on disk -----------------------------------------------------------------------


def save(store: SlotStore, tokens: list[int], *, key: str = "k", now: float = 0.0, payload: bytes = b"kv" * 100) -> SavedSlot | None:
    """What a save does: llama-server writes the temporary file, trioshed commits it."""
    temp = store.temp_name()
    (store.folder / temp).write_bytes(slot_file(tokens, payload))
    return store.commit(temp, key, now)


def test_commit_renames_into_place_and_reopening_finds_it(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", 10_000)
    store.open()
    saved = save(store, [1, 2, 3], now=5.0)
    assert saved is not None and saved.n_tokens == 3 and saved.name == entry_name("k", [1, 2, 3])
    assert sorted(p.name for p in store.folder.iterdir()) == [f"{saved.name}.bin", f"{saved.name}.json"]
    assert saved.checksum == zlib.crc32(store.path_of(saved.name).read_bytes())
    assert (store.folder.stat().st_mode & 0o777) == 0o700
    again = SlotStore(tmp_path / "kv", 10_000)
    again.open()
    assert again.entries() == [saved] and again.bytes_on_disk() == saved.size
    assert save(store, [], now=6.0) is None  # an empty slot is not kept
    assert len(list(store.folder.iterdir())) == 2


def test_the_budget_holds_while_saves_fill_it(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", 1000)
    store.open()
    sizes = []
    for i in range(10):  # 424 bytes each: room for two
        saved = save(store, [i] * 3, now=float(i), payload=b"kv" * 200)
        assert saved is not None
        sizes.append(saved.size)
        assert store.bytes_on_disk() <= 1000
        on_disk = sum(p.stat().st_size for p in store.folder.glob("*.bin"))
        assert on_disk == store.bytes_on_disk()
    assert [e.tokens.tail[0] for e in sorted(store.entries(), key=lambda e: e.used_at)] == [8, 9]
    store.touch(sorted(store.entries(), key=lambda e: e.used_at)[0].name, 100.0)  # 8 used again
    save(store, [10] * 3, now=101.0, payload=b"kv" * 200)
    assert sorted(e.tokens.tail[0] for e in store.entries()) == [8, 10]  # 9 was the least recently used
    assert save(store, [11] * 3, payload=b"x" * 2000, now=102.0) is None  # larger than the budget
    assert not list(store.folder.glob("partial-*"))
    assert not store.make_room(1001) and store.make_room(0)


def test_whether_a_key_has_files_follows_every_change_of_the_index(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", 1000)
    store.open()
    assert not store.has_key("a")
    first = save(store, [1] * 3, key="a", now=1.0, payload=b"kv" * 200)
    save(store, [2] * 3, key="b", now=2.0, payload=b"kv" * 200)
    assert first is not None and store.has_key("a") and store.has_key("b")
    save(store, [1] * 3, key="a", now=3.0, payload=b"kv" * 200)  # the same conversation again: replaced
    store.touch(first.name, 4.0)
    save(store, [3] * 3, key="b", now=5.0, payload=b"kv" * 200)  # room for two: b's older file goes
    assert store.has_key("a") and store.has_key("b")
    save(store, [4] * 3, key="c", now=6.0, payload=b"kv" * 200)  # a's file goes, the least recently used
    assert not store.has_key("a") and store.has_key("b") and store.has_key("c")
    store.remove(next(e.name for e in store.entries() if e.key_id == "c"))
    assert not store.has_key("c")
    reopened = SlotStore(tmp_path / "kv", 1000)
    reopened.open()
    assert [reopened.has_key(k) for k in "abc"] == [False, True, False]


def test_a_corrupt_file_fails_verification_and_is_deleted(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", 10_000)
    store.open()
    saved = save(store, [1, 2, 3])
    assert saved is not None and store.verify(saved)
    path = store.path_of(saved.name)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert not store.verify(saved)
    assert store.entries() == [] and list(store.folder.iterdir()) == []


def test_open_deletes_what_a_crash_left_and_unreadable_sidecars(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    store = SlotStore(folder, 10_000)
    store.open()
    kept = save(store, [1, 2, 3])
    assert kept is not None
    old = os.stat(folder).st_mtime - STALE_AFTER - 10
    (folder / "partial-dead.bin").write_bytes(b"half a save")  # a save cut by a crash
    (folder / "k-orphan.bin").write_bytes(slot_file([4]))  # renamed, sidecar never written
    for name in ("partial-dead.bin", "k-orphan.bin"):
        os.utime(folder / name, (old, old))
    (folder / "partial-young.bin").write_bytes(b"another trioshed saving now")
    (folder / "k-bad.json").write_text("{not json")
    (folder / "k-bad.bin").write_bytes(slot_file([5]))
    (folder / "k-junk.json").write_text(json.dumps({"key": "k", "size": 3, "crc32": 0, "saved_at": 0, "used_at": 0}))
    (folder / "k-junk.bin").write_bytes(b"not a slot file")
    reopened = SlotStore(folder, 10_000)
    reopened.open()
    assert [e.name for e in reopened.entries()] == [kept.name]
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{kept.name}.bin", f"{kept.name}.json", "partial-young.bin"])


def test_reopening_with_a_smaller_budget_evicts(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", 10_000)
    store.open()
    for i in range(3):
        save(store, [i], now=float(i))
    smaller = SlotStore(tmp_path / "kv", 300)  # 216 bytes each: room for one
    smaller.open()
    assert [e.name for e in smaller.entries()] == [entry_name("k", [2])]


def test_file_identity_tells_same_sized_files_apart(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"\0" * 300_000 + b"A")
    b.write_bytes(b"\0" * 300_000 + b"B")
    os.utime(b, ns=(os.stat(a).st_atime_ns, os.stat(a).st_mtime_ns))
    ia, ib = file_identity(str(a)), file_identity(str(b))
    assert (ia.size, ia.mtime_ns) == (ib.size, ib.mtime_ns) and ia.sample != ib.sample


# -- the save bound, against a fake llama-server ---------------------------------------------


async def _fake_llama_server(listeners: list[trio.SocketListener], record: list[str]) -> None:
    """Answers ``GET /slots`` with one used slot and never answers a save."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = await stream.receive_some()
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
                while len(data) < length:
                    data += await stream.receive_some()
                data = data[length:]
                line = head.split(b"\r\n")[0].decode()
                record.append(line)
                if line.startswith("GET /slots"):
                    body = json.dumps([{"id": 0, "is_processing": False, "id_task": 3, "n_prompt_tokens": 500}]).encode()
                    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                else:
                    await trio.sleep_forever()  # a save that never ends (a stuck disk)

    await trio.serve_listeners(handle, listeners)


async def test_an_unload_never_waits_on_a_save_longer_than_the_bound(tmp_path: Path) -> None:
    """Real sockets, so the real clock (simulated time would jump while the kernel connects)."""
    store = SlotStore(tmp_path / "kv", 1_000_000)
    store.open()
    bound = 0.5
    warm = WarmReturns(store, save_timeout=bound)
    record: list[str] = []
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(_fake_llama_server, listeners, record)
        pool = UpstreamPool(listeners[0].socket.getsockname()[1])
        slots = RunnerSlots(warm, CacheKey(MODEL), "m", 4096, pool, bytes_per_token=100)
        started = trio.current_time()
        with trio.fail_after(10), trio.CancelScope() as unload:
            unload.cancel()  # the save runs in an unload's cancelled scope, shielded
            await save_before_stop(slots, exited=False)
        assert bound <= trio.current_time() - started < bound + 2
        await pool.aclose()
        nursery.cancel_scope.cancel()
    assert record[0] == "GET /slots HTTP/1.1" and record[1].startswith("POST /slots/0?action=save ")
    stats = warm.statistics()
    assert (stats.saves, stats.saves_skipped, stats.files) == (0, 1, 0)
    assert list(store.folder.iterdir()) == []


async def test_a_save_over_the_budget_is_not_asked_for(tmp_path: Path) -> None:
    """The slot's size is estimated from its tokens first: no request when it cannot fit."""
    store = SlotStore(tmp_path / "kv", 1000)
    store.open()
    warm = WarmReturns(store, save_timeout=5.0)
    record: list[str] = []
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(_fake_llama_server, listeners, record)
        pool = UpstreamPool(listeners[0].socket.getsockname()[1])
        slots = RunnerSlots(warm, CacheKey(MODEL), "m", 4096, pool, bytes_per_token=100)  # 500 tokens: 50 kB
        with trio.fail_after(10):
            await save_before_stop(slots, exited=False)
        await pool.aclose()
        nursery.cancel_scope.cancel()
    assert record == ["GET /slots HTTP/1.1"]
    assert warm.statistics().saves_skipped == 1
