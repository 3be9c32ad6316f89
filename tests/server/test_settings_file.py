"""The settings file (``trioshed serve --config FILE``): keys, values, errors, precedence."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import pytest

from trioshed.cli import main, settings_from_args
from trioshed.config import SETTING_NAMES, Settings, load_settings_file

EVERY = """
host = "0.0.0.0:8080"
models = "store"
keep_alive = "10m"
max_loaded_models = 2
num_parallel = 4
max_queue = 64
max_extra_wait = "2s"
load_timeout = 90
sched_spread = true
gpu_overhead = "512MiB"
context_length = 8192
context_max = 65536
num_thread = 2
kv_cache_type = "q8_0"
flash_attention = true
llama_server = "/opt/llama/llama-server"
devices = "cuda:0=24GiB"
origins = ["https://a.example", "https://b.example"]
api_key = "secret"
keys_file = "keys.toml"
rpc_servers = ["10.0.0.2:50052=16GiB", "10.0.0.3:50052"]
rpc_allow_public = false
rpc_probe_interval = "1m"
log_format = "json"
shutdown_timeout = "20s"
stream_idle_timeout = "2m"
stream_batch = "20ms"
stream_batch_from = 4
max_body = "16MiB"
http_idle_timeout = 45
max_connections = 256
allow_symlinks = true
metrics_public = true
kv_cache_dir = "kv"
kv_cache_budget = "2GiB"
kv_save_timeout = "3s"
cache_ram = "256MiB"
vulkan_software = true
fast_routes = false
usage_db = "usage/usage.db"
usage = false
database = "postgresql://trioshed:pw@db.example/trioshed"
node_name = "gpu-1"
budgets_fail_closed = true
speculation = false
batch_invariant = true
peers = ["http://10.0.0.2:11434", "http://10.0.0.3:11434/"]
fleet_secret = "fleet-secret-0123"
fleet_interval = "500ms"
fleet_stale = 3
fleet_url = "http://10.0.0.1:8080/"
fleet_ca = "certs/fleet-ca.pem"
fleet_window = "10s"
keys_stale = "1m"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trioshed.toml"
    path.write_text(text)
    return path


def test_every_setting_can_be_given_in_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, EVERY)
    (tmp_path / "keys.toml").write_text('[[key]]\nname = "alice"\nkey = "alice-secret"\n')
    s = Settings.from_env({}, file=path)
    assert s.keys_file == tmp_path / "keys.toml"  # relative to the file
    assert (s.usage_db, s.usage) == (tmp_path / "usage" / "usage.db", False)
    assert (s.host, s.port, s.models) == ("0.0.0.0", 8080, tmp_path / "store")  # relative to the file
    assert (s.keep_alive, s.max_loaded_models, s.num_parallel, s.max_queue, s.load_timeout) == (600, 2, 4, 64, 90)
    assert (s.sched_spread, s.gpu_overhead, s.context_length, s.num_thread, s.context_max) == (True, 512 * 2**20, 8192, 2, 65536)
    assert (s.kv_cache_type, s.flash_attention, s.llama_server, s.api_key) == ("q8_0", True, "/opt/llama/llama-server", "secret")
    assert s.devices is not None and s.devices[0].total == 24 * 2**30
    assert s.origins == ("https://a.example", "https://b.example")
    assert [(r.address, r.declared) for r in s.rpc_servers] == [("10.0.0.2:50052", 16 * 2**30), ("10.0.0.3:50052", None)]
    assert (s.rpc_allow_public, s.rpc_probe_interval) == (False, 60)
    assert s.log_format == "json"
    assert (s.shutdown_timeout, s.stream_idle_timeout, s.max_body) == (20, 120, 16 * 2**20)
    assert (s.stream_batch, s.stream_batch_from) == (0.02, 4)
    assert (s.http_idle_timeout, s.max_connections, s.allow_symlinks) == (45, 256, True)
    assert (s.kv_cache_dir, s.kv_cache_budget, s.kv_save_timeout, s.cache_ram) == (tmp_path / "kv", 2 * 2**30, 3, 256 * 2**20)
    assert s.max_extra_wait == 2
    assert s.vulkan_software is True
    assert s.fast_routes is False
    assert s.speculation == "off"  # false: no speculation (the default is "ngram")
    assert s.batch_invariant is True
    assert s.metrics_public is True
    assert s.peers == ("http://10.0.0.2:11434", "http://10.0.0.3:11434")
    assert (s.fleet_secret, s.node_name, s.fleet_interval, s.fleet_stale) == ("fleet-secret-0123", "gpu-1", 0.5, 3)
    assert s.fleet_url == "http://10.0.0.1:8080"
    assert (s.fleet_ca, s.fleet_window, s.keys_stale) == (tmp_path / "certs" / "fleet-ca.pem", 10, 60)  # relative to the file
    # the file covers every TRIOSHED_* setting there is
    assert set(load_settings_file(path)) - {"port"} == set(SETTING_NAMES)


def test_peers_need_the_fleet_secret_and_urls(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs TRIOSHED_FLEET_SECRET"):
        Settings.from_env({"TRIOSHED_PEERS": "http://10.0.0.2:11434"})
    with pytest.raises(ValueError, match=re.escape("TRIOSHED_PEERS='10.0.0.2:11434': invalid node URL")):
        Settings.from_env({"TRIOSHED_PEERS": "10.0.0.2:11434", "TRIOSHED_FLEET_SECRET": "a-fleet-secret-0123"})
    assert "s3cr3t" not in repr(Settings(fleet_secret="s3cr3t"))  # never shown
    with pytest.raises(ValueError, match="fleet_secret = '\\*\\*\\*': use at least 16") as exc:  # nor in an error
        Settings.from_env({}, file=write(tmp_path, 'fleet_secret = "s3cr3t"\n'))
    assert "s3cr3t" not in str(exc.value)


def test_values_as_strings_work_like_the_variables(tmp_path: Path) -> None:
    s = Settings.from_env({}, file=write(tmp_path, 'keep_alive = -1\nmax_queue = "3"\nsched_spread = "yes"\n'))
    assert (s.keep_alive, s.max_queue, s.sched_spread) == (math.inf, 3, True)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keep_alive_seconds = 5", "unknown key 'keep_alive_seconds'"),
        ('TRIOSHED_KEEP_ALIVE = "5m"', "write 'keep_alive', without the TRIOSHED_ prefix"),
        ('keep_alive = "soon"', "keep_alive = 'soon': invalid duration"),
        ("max_loaded_models = -1", "max_loaded_models = -1: must be at least 0"),
        ("num_parallel = 0", "num_parallel = 0: must be at least 1"),
        ("max_queue = 2.5", "max_queue = 2.5: invalid literal"),
        ("max_queue = true", "max_queue = True: invalid literal"),
        ('kv_cache_type = "q2"', "kv_cache_type = 'q2': use one of"),
        ('stream_batch = "2s"', "stream_batch = '2s': must be a duration from 0 (off) to 1s"),
        ('stream_batch = "-1"', "stream_batch = '-1': must be a duration from 0 (off) to 1s"),
        ("stream_batch_from = 0", "stream_batch_from = 0: must be at least 1"),
        ("num_thread = [1]", "num_thread = [1]: must be a string, a number or a boolean"),
        ("[server]\nhost = 1", "unknown key 'server'"),
        ("keep_alive = ", "not valid TOML"),
    ],
)
def test_a_bad_key_or_value_is_an_error_naming_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match="settings file") as excinfo:
        Settings.from_env({}, file=path)
    assert str(excinfo.value).startswith(f"settings file {path}: ") and message in str(excinfo.value)


def test_precedence_flag_then_env_then_file_then_default(tmp_path: Path) -> None:
    path = write(tmp_path, 'host = "127.0.0.1:1111"\nkeep_alive = "1m"\nmax_queue = 7\nmodels = "/from/file"\n')
    parse = argparse.Namespace

    args = parse(command="serve", host=None, models=None, config=str(path))
    s = settings_from_args(args, {})
    assert (s.port, s.keep_alive, s.max_queue, s.models, s.num_parallel) == (1111, 60, 7, Path("/from/file"), 1)

    env = {"TRIOSHED_HOST": "127.0.0.1:2222", "TRIOSHED_KEEP_ALIVE": "2m", "TRIOSHED_MODELS": "/from/env"}
    s = settings_from_args(args, env)
    assert (s.port, s.keep_alive, s.max_queue, s.models) == (2222, 120, 7, Path("/from/env"))  # env over file

    args = parse(command="serve", host=":3333", models="/from/flag", config=str(path))
    s = settings_from_args(args, env)
    assert (s.port, s.keep_alive, s.models) == (3333, 120, Path("/from/flag"))  # flags over env

    assert settings_from_args(parse(command="serve", host=None, models=None, config=None), {}) == Settings()


def test_serve_with_a_bad_settings_file_exits_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "max_loaded_modles = 2\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Error: settings file {path}: unknown key 'max_loaded_modles'")
    assert main(["serve", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read it" in capsys.readouterr().err
