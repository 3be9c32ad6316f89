"""The coding agents people put in front of local models, run unchanged against a trioshed.

Claude Code (``claude -p``, Anthropic's ``/v1/messages``), Codex CLI (``codex exec``: OpenAI's
``/v1/responses`` as a configured provider, and ``--oss`` as Ollama, which also checks
``/api/version`` and ``/api/tags``) and opencode (``opencode run``, OpenAI's
``/v1/chat/completions`` through its ``@ai-sdk/openai-compatible`` provider), each as a user
would configure it for a local server: a base URL and a model name, nothing else changed (no
model alias, no tool turned off).

:func:`agent_command` gives the command line and a closed environment (``PATH``, ``HOME`` and
the client's own settings only, so a developer's keys, proxies or configuration never leak in)
and writes each client's configuration files into its own home. Each client is kept from
talking to anything but the server by its own switches:

* Claude Code: ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`` (auto-update, telemetry, error
  reporting, feature flags), with ``DISABLE_AUTOUPDATER``, ``DISABLE_TELEMETRY`` and
  ``DISABLE_ERROR_REPORTING`` spelled out too. Without them it resolves Anthropic's hosts at start.
* Codex: ``check_for_update_on_startup = false``, ``[analytics] enabled = false``,
  ``[feedback] enabled = false`` and ``[features] plugins = false``: the plugin marketplace is
  otherwise synced at start from github.com (``openai/plugins``) and chatgpt.com.
* opencode: ``OPENCODE_DISABLE_AUTOUPDATE``, ``OPENCODE_DISABLE_MODELS_FETCH`` (the
  models.dev catalogue), ``OPENCODE_DISABLE_LSP_DOWNLOAD``, ``OPENCODE_DISABLE_DEFAULT_PLUGINS``,
  ``autoupdate: false`` and ``share: "disabled"``; and its global config folder is laid out as
  an installed one (a ``node_modules`` folder and a ``package-lock.json`` naming
  ``@opencode-ai/plugin``), because opencode otherwise runs ``npm install @opencode-ai/plugin``
  there in the background at every start (no switch turns that off).

:func:`outside_connections` reads an ``strace -e trace=connect,sendto,sendmsg,sendmmsg`` log and
returns every address a process tried to reach that is not on the loopback network (a DNS query
counts: it goes to the resolver), which is how the tests check the switches.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AGENTS", "AgentCommand", "agent_command", "answer_of", "outside_connections"]

#: The runs, by name: the client and the protocol it speaks to trioshed.
AGENTS = {
    "claude": "Claude Code, /v1/messages",
    "codex": "Codex CLI, /v1/responses (a configured provider)",
    "codex-oss": "Codex CLI --oss, Ollama (/api/version, /api/tags, /v1/responses)",
    "opencode": "opencode, /v1/chat/completions",
}


@dataclass(frozen=True)
class AgentCommand:
    """One agent run: ``argv`` in ``cwd`` with exactly ``env``."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path


def _base_env(home: Path, path: str) -> dict[str, str]:
    return {
        "PATH": path,
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
    }


def _codex_config(home: Path, base_url: str, *, provider: bool) -> Path:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    lines = [
        "check_for_update_on_startup = false",
        *(['model_provider = "trioshed"'] if provider else []),
        "[analytics]",
        "enabled = false",
        "[feedback]",
        "enabled = false",
        "[features]",
        "plugins = false",
    ]
    if provider:
        lines += [
            "[model_providers.trioshed]",
            'name = "trioshed"',
            f"base_url = {json.dumps(base_url + '/v1')}",
            'wire_api = "responses"',
        ]
    (codex_home / "config.toml").write_text("\n".join(lines) + "\n")
    return codex_home


def _opencode_config(home: Path, base_url: str, model: str) -> Path:
    global_dir = home / ".config" / "opencode"
    (global_dir / "node_modules").mkdir(parents=True, exist_ok=True)
    (global_dir / "package-lock.json").write_text(
        json.dumps({"packages": {"": {"dependencies": {"@opencode-ai/plugin": "*"}}}})
    )
    config = home / "opencode.json"
    config.write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "provider": {"trioshed": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "trioshed",
            "options": {"baseURL": base_url + "/v1"},
            "models": {model: {"name": model}},
        }},
        "model": f"trioshed/{model}",
    }, indent=1))  # fmt: skip
    return config


def agent_command(name: str, *, bin_dir: Path, home: Path, base_url: str, model: str, prompt: str,
                  path: str = "/usr/local/bin:/usr/bin:/bin") -> AgentCommand:
    """The command for agent ``name`` (a key of :data:`AGENTS`) against trioshed at ``base_url``
    (``http://host:port``), with ``bin_dir`` holding the clients' executables (``node_modules/
    .bin``) and ``home`` an empty folder that becomes the client's home; writes its config there."""
    home.mkdir(parents=True, exist_ok=True)
    work = home / "work"
    work.mkdir(exist_ok=True)
    env = _base_env(home, f"{bin_dir}:{path}")
    if name == "claude":
        env |= {
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": "trioshed",  # any key: a trioshed without keys takes every request
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }
        argv = [str(bin_dir / "claude"), "-p", prompt, "--model", model]
    elif name in ("codex", "codex-oss"):
        oss = name == "codex-oss"
        env["CODEX_HOME"] = str(_codex_config(home, base_url, provider=not oss))
        argv = [str(bin_dir / "codex"), "exec", "--skip-git-repo-check", "-m", model]
        if oss:
            env["CODEX_OSS_BASE_URL"] = base_url + "/v1"
            argv += ["--oss", "--local-provider", "ollama"]
        argv.append(prompt)
    elif name == "opencode":
        env |= {
            "OPENCODE_CONFIG": str(_opencode_config(home, base_url, model)),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        }
        argv = [str(bin_dir / "opencode"), "run", "--model", f"trioshed/{model}", prompt]
    else:
        raise ValueError(f"unknown agent {name!r}; known: {', '.join(AGENTS)}")
    return AgentCommand(name, argv, env, work)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def answer_of(stdout: str) -> str:
    """The last line an agent printed, without terminal colour codes and blanks around it."""
    lines = [line.strip() for line in _ANSI.sub("", stdout).splitlines()]
    return next((line for line in reversed(lines) if line), "")


_ADDRESS = re.compile(
    r'sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), (?:sin_addr=inet_addr\("([^"]+)"\)|[^}]*?inet_pton\(AF_INET6, "([^"]+)")'
)


_SENDING = re.compile(r"\b(?:connect|sendto|sendmsg|sendmmsg)\(")


def outside_connections(trace: str) -> list[str]:
    """``host:port`` for every IPv4/IPv6 address that a ``connect``/``send*`` call of an strace log
    went to and that is not loopback, in order, each once (a ``bind`` is no traffic; Unix sockets
    and netlink are not addresses)."""
    seen: list[str] = []
    sending = (line for line in trace.splitlines() if _SENDING.search(line))
    for match in (m for line in sending for m in _ADDRESS.finditer(line)):
        port, v4, v6 = match.groups()
        host = v4 or v6 or ""
        loopback = host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")
        where = f"{host}:{port}"
        if not loopback and where not in seen:
            seen.append(where)
    return seen
