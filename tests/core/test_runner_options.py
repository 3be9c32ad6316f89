"""What a runner is started with (trioshed.core.runner_options), decided without an app, a store
or a scheduler; the models.toml args it reads (trioshed.runner.command.parse_model_args); and the
one GGUF header cache its callers read through (trioshed.models.header_cache)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from trioshed.config import Settings
from trioshed.core.context import FLOOR
from trioshed.core.model import ModelSpec, Placement
from trioshed.core.runner_options import ModelArgs, flash_attention, runner_options, trained_context
from trioshed.core.speculation import MEASURED, NgramDrafting, ngram_drafting
from trioshed.core.views import RunnerState, RunnerView, can_serve
from trioshed.errors import BadRequest
from trioshed.models import gguf_meta
from trioshed.models.gguf_meta import cached_metadata, read_metadata
from trioshed.models.header_cache import header_of, listing_facts, read_header, writes_text
from trioshed.runner.command import NGRAM, build_command, ngram_args, parse_model_args
from trioshed.testing.tiny import write_tiny_model

SPEC = ModelSpec("m:latest", "/m.gguf")


@dataclass(frozen=True)
class Header:
    context_length: int
    trained_context: int


def test_the_settings_are_the_start() -> None:
    options = runner_options(Settings(), SPEC, {})
    assert options.num_ctx == FLOOR and options.num_parallel == 1 and options.kv_cache_type == "f16"
    assert options.flash_attention and not options.batch_invariant  # automatic: on for the CPU
    assert options.cache_ram_mib == 1024 and options.swa_full  # the default cache-ram and warm returns
    assert options.speculation == "ngram" and options.draft == "" and options.extra_args == ()
    tuned = Settings(num_parallel=3, num_thread=7, kv_cache_type="q8_0", flash_attention=True,
                     cache_ram=64 << 20, kv_cache_budget=0, speculation="off")  # fmt: skip
    options = runner_options(tuned, SPEC, {})
    assert (options.num_parallel, options.num_thread, options.kv_cache_type) == (3, 7, "q8_0")
    assert options.flash_attention and options.cache_ram_mib == 64 and not options.swa_full
    assert options.speculation == "off"
    invariant = runner_options(Settings(batch_invariant=True, flash_attention=False), SPEC, {})
    assert invariant.batch_invariant and invariant.flash_attention  # it needs flash attention


def test_flash_attention_is_automatic_per_backend_unless_set() -> None:
    assert flash_attention(None) and flash_attention(None, backends=("cpu", "cuda"))
    assert not flash_attention(None, backends=("cpu", "vulkan"))  # not on every Vulkan device
    assert not flash_attention(None, backends=("cpu", "rpc"))  # an RPC server's backend is unknown
    assert not flash_attention(False) and flash_attention(True, backends=("cpu", "vulkan"))
    assert flash_attention(False, batch_invariant=True)
    assert not runner_options(Settings(flash_attention=False), SPEC, {}).flash_attention
    assert not runner_options(Settings(), SPEC, {}, backends=("cpu", "vulkan")).flash_attention


def test_then_the_models_defaults_then_the_request() -> None:
    spec = ModelSpec("m:latest", "/m.gguf", defaults=(("num_batch", 256), ("num_gpu", 4), ("temperature", 0.1)),
                     num_parallel=2)  # fmt: skip
    options = runner_options(Settings(num_parallel=5), spec, {})
    assert (options.num_batch, options.num_gpu, options.num_parallel) == (256, 4, 2)
    options = runner_options(Settings(), spec, {"num_gpu": 0, "num_batch": None, "top_k": 3})
    assert (options.num_batch, options.num_gpu) == (256, 0)  # None is unset; sampling options do not count


def test_the_automatic_context_within_the_trained_one() -> None:
    long, small = Header(32768, 32768), Header(512, 512)
    settings = Settings()
    assert runner_options(settings, SPEC, {}, header=long).num_ctx == FLOOR
    assert runner_options(settings, SPEC, {}, need=6_000, header=long).num_ctx == 8192
    assert runner_options(settings, SPEC, {}, need=99_000, header=long).num_ctx == 32768
    assert runner_options(settings, SPEC, {}, need=99_000).num_ctx == 131072  # unreadable: no limit known
    assert runner_options(Settings(context_max=16384), SPEC, {}, need=99_000, header=long).num_ctx == 16384
    assert runner_options(settings, SPEC, {"num_ctx": 2048}, need=25_000, header=long).num_ctx == 2048
    clamped = runner_options(settings, SPEC, {"num_ctx": 8192, "num_batch": 2048}, header=small)
    assert (clamped.num_ctx, clamped.num_batch) == (512, 512)
    assert runner_options(settings, SPEC, {"num_ctx": 2}).num_ctx == 4
    # A context set in the settings is not automatic, and still clamped.
    assert runner_options(Settings(context_length=8192), SPEC, {}, need=25_000, header=long).num_ctx == 8192
    assert runner_options(Settings(context_length=8192), SPEC, {}, header=small).num_ctx == 512


def test_rope_args_move_the_trained_context() -> None:
    header = Header(512, 1024)  # the GGUF's own scaling: 1024
    assert trained_context(None) == 0 and trained_context(header) == 1024
    assert trained_context(header, ModelArgs(rope_scale=4.0)) == 2048  # the user's factor, on the base
    assert trained_context(header, ModelArgs(rope_unbounded=True)) == 0
    roped = runner_options(Settings(), SPEC, {"num_ctx": 4096}, header=header, args=ModelArgs(rope_scale=4.0))
    assert roped.num_ctx == 2048


def test_models_toml_args_parsed_where_the_flags_are_spelled() -> None:
    assert parse_model_args(()) == ModelArgs()
    own = parse_model_args(("--top-k", "5", "--cache-ram", "256", "--mlock"))
    assert own == ModelArgs(passed=("--top-k", "5", "--mlock"), cache_ram_mib=256)
    assert parse_model_args(("--cache-ram", "-3")).cache_ram_mib == 0
    assert parse_model_args(("--cache-ram", "lots")) == ModelArgs(passed=("--cache-ram", "lots"))  # kept, not counted
    assert parse_model_args(("--cache-ram",)) == ModelArgs(passed=("--cache-ram",))
    assert parse_model_args(("--rope-scale", "4")).rope_scale == 4.0
    for lifted in (("--rope-scale", "x"), ("--rope-scale",), ("--rope-scale", "inf"), ("--rope-scaling", "yarn"),
                   ("--yarn-orig-ctx", "8192")):  # fmt: skip
        parsed = parse_model_args(lifted)
        assert parsed.rope_unbounded and parsed.rope_scale is None, lifted
    options = runner_options(Settings(), SPEC, {}, args=own)
    assert options.cache_ram_mib == 256 and options.extra_args == ("--top-k", "5", "--mlock")


def test_an_embedding_runner_has_no_prompt_cache_unless_the_models_args_give_it_one() -> None:
    embedding = runner_options(Settings(), SPEC, {}, embedding=True)
    assert embedding.embedding and embedding.cache_ram_mib == 0
    assert "--cache-ram" in (argv := build_command("llama-server", SPEC, embedding, Placement(0), port=1))
    assert argv[argv.index("--cache-ram") + 1] == "0"
    own = runner_options(Settings(), SPEC, {}, args=ModelArgs(cache_ram_mib=256), embedding=True)
    assert own.cache_ram_mib == 256
    # it serves generation too, without a reload for the prompt cache it was started without
    chat = runner_options(Settings(), SPEC, {})
    runner = RunnerView(id=1, model=SPEC, options=embedding, state=RunnerState.READY)
    assert chat.cache_ram_mib == 1024 and can_serve(runner, SPEC, chat)


def test_speculation_the_models_word_and_off_without_text() -> None:
    assert runner_options(Settings(speculation="ngram-mod"), SPEC, {}).speculation == "ngram-mod"
    own = ModelSpec("m:latest", "/m.gguf", speculation="off")
    assert runner_options(Settings(), own, {}).speculation == "off"
    assert runner_options(Settings(), SPEC, {}, writes_text=False).speculation == "off"
    assert runner_options(Settings(), SPEC, {}, draft="/d.gguf").draft == "/d.gguf"


def test_ngram_choice_is_data_and_its_flags_are_the_commands() -> None:
    assert ngram_drafting("off") is None and ngram_drafting("ngram") == MEASURED
    assert ngram_drafting("ngram-mod") == NgramDrafting("ngram-mod")
    with pytest.raises(ValueError, match="unknown speculation"):
        ngram_drafting("draft-simple")
    assert list(NGRAM) == ngram_args("ngram") == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n",
                                                   str(MEASURED.lookup), "--spec-ngram-simple-size-m", str(MEASURED.draft)]  # fmt: skip


@pytest.mark.parametrize(
    ("options", "words"),
    [({"num_ctx": 0}, "num_ctx=0 is out of range"), ({"num_batch": 1}, "num_batch=1 is out of range"),
     ({"num_gpu": 1 << 20}, "num_gpu=1048576"), ({"num_thread": -1}, "num_thread=-1")],
)  # fmt: skip
def test_options_out_of_bounds_are_refused(options: dict[str, object], words: str) -> None:
    """Types are checked where options are parsed (``api.protocols.options``); bounds here."""
    with pytest.raises(BadRequest, match=words):
        runner_options(Settings(), SPEC, options)


def test_one_header_cache_by_the_files_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", context_length=512)
    st = path.stat()
    spec = ModelSpec("m:latest", str(path), size=st.st_size, modified=st.st_mtime)
    header = header_of(spec)
    assert read_metadata(path) is header and cached_metadata(path) is header
    assert writes_text(header) and listing_facts(str(path))[0] == "llama"
    os.remove(path)
    assert header_of(spec) is header  # the identity the store resolved: no system call
    assert cached_metadata(path) is None  # the file as it is now: gone
    real = write_tiny_model(tmp_path / "real.gguf")
    (tmp_path / "link.gguf").symlink_to(real)
    st = real.stat()
    linked = ModelSpec("l:latest", str(tmp_path / "link.gguf"), size=st.st_size, modified=st.st_mtime)
    assert header_of(linked) is read_metadata(real) is read_metadata(tmp_path / "link.gguf")  # one file, one header
    monkeypatch.setattr(gguf_meta, "CACHE_SIZE", 2)  # bounded, oldest out first
    others = [read_metadata(write_tiny_model(tmp_path / f"{i}.gguf")) for i in range(3)]
    assert cached_metadata(tmp_path / "0.gguf") is None and cached_metadata(tmp_path / "2.gguf") is others[2]


async def test_the_event_loop_reads_a_header_in_a_worker_thread(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m.gguf")
    st = path.stat()
    spec = ModelSpec("m:latest", str(path), size=st.st_size, modified=st.st_mtime)
    header = await read_header(spec)
    assert await read_header(spec) is header and header.context_length > 0
    with pytest.raises(FileNotFoundError):
        await read_header(ModelSpec("n:latest", str(tmp_path / "absent.gguf")))
