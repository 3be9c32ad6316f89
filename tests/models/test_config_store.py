"""Settings parsing, the model store, the llama-server command line (pure parts)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from trioshed.config import Settings
from trioshed.config_values import parse_bytes, parse_devices, parse_duration, parse_host
from trioshed.core.model import ModelSpec, Placement, RunnerOptions
from trioshed.errors import BadRequest, ModelNotFound
from trioshed.models.names import split_name
from trioshed.models.store import ModelStore
from trioshed.runner.command import build_command, llama_device_name


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5m", 300), ("1h30m", 5400), ("10s", 10), ("1.5s", 1.5), ("0", 0), (0, 0), (30, 30), ("300", 300),
     ("-1", math.inf), (-1, math.inf), ("-5m", math.inf), ("250ms", 0.25)],
)  # fmt: skip
def test_parse_duration(value: str | int, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["", "soon", "5x", "m5", True, "5m garbage"])
def test_parse_duration_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)  # type: ignore[arg-type]


def test_parse_sizes_devices_hosts() -> None:
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1GB") == 10**9
    devices = parse_devices("cuda:0=24GiB, cuda:1=12GiB")
    assert [(d.id, d.library, d.index, d.total) for d in devices] == [
        ("cuda:0", "cuda", 0, 24 * 2**30), ("cuda:1", "cuda", 1, 12 * 2**30),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="invalid device"):
        parse_devices("gpu0=24GiB")
    assert parse_host("127.0.0.1:11434") == ("127.0.0.1", 11434)
    assert parse_host(":8080") == ("127.0.0.1", 8080)
    assert parse_host("[::1]:9000") == ("::1", 9000)


def test_settings_from_env() -> None:
    s = Settings.from_env({"TRIOSHED_KEEP_ALIVE": "-1", "TRIOSHED_MAX_QUEUE": "3", "TRIOSHED_DEVICES": "cuda:0=8GiB"})
    assert s.keep_alive == math.inf and s.max_queue == 3 and s.devices and s.devices[0].total == 8 * 2**30
    with pytest.raises(ValueError, match="TRIOSHED_MAX_QUEUE"):
        Settings.from_env({"TRIOSHED_MAX_QUEUE": "lots"})
    with pytest.raises(ValueError, match="TRIOSHED_NUM_PARALLEL"):
        Settings.from_env({"TRIOSHED_NUM_PARALLEL": "0"})


def test_store_resolves_names(tmp_path: Path) -> None:
    (tmp_path / "alpha.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("not a model")
    store = ModelStore(tmp_path)
    assert store.resolve("alpha").path == str(tmp_path / "alpha.gguf")
    assert store.resolve("alpha:latest").name == "alpha:latest"
    assert [s.name for s in store.list()] == ["alpha:latest"]
    with pytest.raises(ModelNotFound):
        store.resolve("beta")
    with pytest.raises(ModelNotFound):
        store.resolve("alpha:7b")
    for bad in ("../alpha", "a/b", "..", "", "x:../y"):
        with pytest.raises(BadRequest):
            store.resolve(bad)
    assert split_name("m:q4") == ("m", "q4")


def test_store_models_toml(tmp_path: Path) -> None:
    (tmp_path / "base.gguf").write_bytes(b"GGUF")
    (tmp_path / "lora.gguf").write_bytes(b"GGUF")
    (tmp_path / "models.toml").write_text(
        '[models.tuned]\npath = "base.gguf"\nadapters = ["lora.gguf"]\noptions = { num_ctx = 8192, temperature = 0.2 }\n'
    )
    spec = ModelStore(tmp_path).resolve("tuned")
    assert spec.path == str(tmp_path / "base.gguf") and spec.adapters == (str(tmp_path / "lora.gguf"),)
    assert dict(spec.defaults) == {"num_ctx": 8192, "temperature": 0.2}
    assert {s.name for s in ModelStore(tmp_path).list()} == {"base:latest", "lora:latest", "tuned:latest"}


def test_command_line() -> None:
    spec = ModelSpec("m:latest", "/m.gguf", adapters=("/l.gguf",))
    opts = RunnerOptions(num_ctx=2048, num_parallel=2, num_thread=1, flash_attention=True, kv_cache_type="q8_0")
    split = Placement(29, devices=("cuda:0", "cuda:1"), tensor_split=(0.75, 0.25), main_gpu=0)
    argv = build_command("/bin/llama-server", spec, opts, split, port=1234)
    joined = " ".join(argv)
    for part in ("--ctx-size 4096", "--parallel 2", "--fit off", "--n-gpu-layers 29", "--device CUDA0,CUDA1",
                 "--tensor-split 0.75,0.25", "--threads 1", "--cache-type-k q8_0", "--lora /l.gguf", "--port 1234"):  # fmt: skip
        assert part in joined, part
    cpu = build_command("/bin/llama-server", spec, opts, split, port=1, accounting_only=True)
    assert "--n-gpu-layers 0" in " ".join(cpu) and "--device none" in " ".join(cpu)
    assert llama_device_name("vulkan:2") == "Vulkan2"
