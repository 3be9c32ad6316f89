"""The command line's shape: every verb with its flags and help (Ollama's where they mean the
same), usage errors as one line with exit status 2, and the settings the flags give.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from trioshed.config import Settings
from trioshed.keys import LIMIT_FIELDS


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """Flags, then ``TRIOSHED_*`` variables, then ``--config FILE``, then the defaults."""
    overrides: dict[str, object] = {}
    if getattr(args, "host", None):
        from trioshed.config_values import parse_host

        overrides["host"], overrides["port"] = parse_host(args.host)
    if getattr(args, "models", None):
        overrides["models"] = Path(args.models).expanduser()
    config = getattr(args, "config", None)
    return Settings.from_env(env, file=Path(config).expanduser() if config else None, **overrides)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, ``Error: ...`` with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"Error: {message} (see `{self.prog} --help`)\n")


CLIENT_EPILOG = """environment:
  TRIOSHED_HOST     the server to ask (default 127.0.0.1:11434)
  TRIOSHED_API_KEY  the bearer key, where the server requires one"""

SERVE_EPILOG = """environment (every setting: docs/settings.md):
  TRIOSHED_HOST               listen address (default 127.0.0.1:11434)
  TRIOSHED_MODELS             model store folder (default ~/.trioshed/models)
  TRIOSHED_KEEP_ALIVE         how long a model stays loaded after its last request (default 5m)
  TRIOSHED_MAX_LOADED_MODELS  most models loaded at once (default 0: 3 per GPU, 3 on CPU)
  TRIOSHED_NUM_PARALLEL       parallel requests per model (default 1)
  TRIOSHED_CONTEXT_LENGTH     default context length (default 0: sized from the request, up to the model's)
  TRIOSHED_API_KEY            require this bearer key
  TRIOSHED_LLAMA_SERVER       the llama-server binary (default: the one make install chose)"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trioshed",
        description="A model-scheduling server for local LLM inference, with Ollama's API and command line.",
        epilog="Run `trioshed COMMAND --help` for a command's flags.",
    )
    parser.add_argument("-v", "--version", action="store_true", help="show the version (and the server's, where it differs)")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND", parser_class=_Parser)
    raw = argparse.RawDescriptionHelpFormatter

    def command(name: str, help: str, *, aliases: tuple[str, ...] = (), epilog: str = CLIENT_EPILOG) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help[0].upper() + help[1:], aliases=list(aliases),
                              epilog=epilog, formatter_class=raw)  # fmt: skip

    p = command("serve", "start the server", aliases=("start",), epilog=SERVE_EPILOG)
    p.add_argument("--host", help="listen address host:port (TRIOSHED_HOST)")
    p.add_argument("--models", metavar="FOLDER", help="model store folder (TRIOSHED_MODELS)")
    p.add_argument(
        "--config", metavar="FILE",
        help="settings file (TOML): keep_alive = \"10m\", max_loaded_models = 2, ... "
             "(flags win over TRIOSHED_* variables, which win over the file)",
    )  # fmt: skip
    p.add_argument("--demo-model", action="store_true", help="put Gemma 3 270M into an empty store (what make serve does)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")

    p = command("show", "show information for a model")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--license", action="store_true", help="show the license of a model")
    p.add_argument("--modelfile", action="store_true", help="show the Modelfile of a model")
    p.add_argument("--parameters", action="store_true", help="show the parameters of a model")
    p.add_argument("--system", action="store_true", help="show the system message of a model")
    p.add_argument("--template", action="store_true", help="show the template of a model")
    p.add_argument("-v", "--verbose", action="store_true", help="show every metadata entry")

    p = command("run", "run a model: answer a prompt, or chat on a terminal")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("prompt", metavar="PROMPT", nargs="*", help="the prompt (standard input, when not a terminal, comes before it)")
    p.add_argument("--format", help='response format: "json" or a JSON schema')
    p.add_argument("--keepalive", metavar="DURATION", help='how long the model stays loaded afterwards ("5m", "1h", 0, -1 for ever)')
    p.add_argument("--verbose", action="store_true", help="show timings for the response")
    p.add_argument("--think", action="store_true", default=None, help="let a thinking model think first")
    p.add_argument("--hidethinking", action="store_true", help="think, but show only the answer")

    p = command("stop", "stop (unload) a running model")
    p.add_argument("model", metavar="MODEL")

    p = command("pull", "pull a model: llama3.2:1b, user/model:tag, hf.co/USER/REPO:QUANT")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--insecure", action="store_true", help="use an insecure registry (no TLS checks; plain HTTP allowed)")

    p = command("create", "create a model from a Modelfile (FROM a GGUF file or folder, or a model; PARAMETER, SYSTEM, ...)")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("-f", "--file", default="Modelfile", help="name of the Modelfile (default: ./Modelfile)")

    p = command("push", "push a model to a registry (host/namespace/model:tag)")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--insecure", action="store_true", help="use an insecure registry (no TLS checks; plain HTTP allowed)")

    command("list", "list models", aliases=("ls",))
    command("ps", "list running models")

    p = command("cp", "copy a model")
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("destination", metavar="DESTINATION")

    p = command("rm", "remove a model")
    p.add_argument("model", metavar="MODEL", nargs="+")

    p = command("usage", "tokens and requests per API key, model and day (TRIOSHED_API_KEY: the key asking)")
    p.add_argument("--key", help="one key's usage (a user key: its own only)")
    p.add_argument("--model", help="one model's usage")
    p.add_argument("--since", help="from this time: YYYY-MM-DD, RFC 3339 or Unix seconds")
    p.add_argument("--until", help="until this time (excluded)")
    p.add_argument("--by", choices=("day", "hour"), default="day")
    p.add_argument("--csv", action="store_true", help="CSV instead of a table")

    p.add_argument("--node", help="one node's usage (default: every node of the team)")

    _keys_parser(command("keys", "manage the API keys of the store (admin; TRIOSHED_API_KEY: the key asking)"))

    p = command("help", "help about any command", epilog="")
    p.add_argument("topic", metavar="COMMAND", nargs="?")
    return parser


def _keys_parser(keys: argparse.ArgumentParser) -> None:
    """``keys``' verbs: create, list, update, revoke, rotate (:mod:`trioshed.cli.keys`)."""
    verbs = keys.add_subparsers(dest="keys_verb", metavar="VERB", required=True, parser_class=_Parser)

    def limits(p: argparse.ArgumentParser) -> None:
        p.add_argument("--role", choices=("user", "admin"))
        p.add_argument("--weight", type=float, help="share of runner slots against other keys")
        p.add_argument("--models", dest="patterns", metavar="PATTERN", nargs="*", help="the models it may use (glob patterns; none: every model)")
        for f in LIMIT_FIELDS:
            p.add_argument(f"--{f.replace('_', '-')}", dest=f, type=int, metavar="N", help="0: no limit")

    p = verbs.add_parser("create", help="a new key; its secret is printed once")
    p.add_argument("name", metavar="NAME")
    limits(p)
    p = verbs.add_parser("list", help="the keys (never a secret)")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p = verbs.add_parser("update", help="change a key's role, weight, models, limits or budgets")
    p.add_argument("name", metavar="NAME")
    limits(p)
    verbs.add_parser("revoke", help="revoke a key on every node").add_argument("name", metavar="NAME")
    verbs.add_parser("rotate", help="a new secret for a key (printed once); the old one stops working").add_argument("name", metavar="NAME")
