"""The state of a ``trioshed run`` chat and the slash commands that change or show it, with
``ollama run``'s words: ``/set``, ``/unset``, ``/show``, ``/load``, ``/save`` and their help.

A :class:`Session` is what the next request is made of: the model, the conversation, the system
message, the parameters (the request's ``options``), format and think. Commands print what
Ollama prints and return; none of them ends the chat. The server does the rest as Ollama's does:
a model's own messages (a saved conversation, a Modelfile's ``MESSAGE`` lines) are put before
each request's by the server, so the session only remembers them (:attr:`Session.loaded`) to
show them and to save them again.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trioshed.cli.client import error_of
from trioshed.cli.format import show_text
from trioshed.models.modelfile import PARAMETER_TYPES

if TYPE_CHECKING:
    import httpx

CHAT_HELP = """Available Commands:
  /set            Set session variables
  /unset          Unset session variables
  /show           Show model information
  /load <model>   Load a session or model
  /save <model>   Save your current session
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use \"\"\" to begin a multi-line message.
"""

IMAGES_HELP = "Use /path/to/file to include .jpg, .png, or .webp images.\n"

SET_HELP = """Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set history           Enable history
  /set nohistory         Disable history
  /set wordwrap          Enable wordwrap
  /set nowordwrap        Disable wordwrap
  /set format json       Enable JSON mode
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats
  /set think             Enable thinking
  /set nothink           Disable thinking

"""

UNSET_HELP = """Available Commands:
  /unset parameter <name>   Unset a parameter (back to the model's value)
  /unset system             Unset the system message
  /unset format             Disable formatting

"""

SHOW_HELP = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template

"""

PARAMETERS_HELP = """Available Parameters:
  /set parameter seed <int>             Random number seed
  /set parameter num_predict <int>      Max number of tokens to predict
  /set parameter top_k <int>            Pick from top k num of tokens
  /set parameter top_p <float>          Pick token based on sum of probabilities
  /set parameter min_p <float>          Pick token based on top token probability * min_p
  /set parameter num_ctx <int>          Set the context size
  /set parameter temperature <float>    Set creativity level
  /set parameter repeat_penalty <float> How strongly to penalize repetitions
  /set parameter repeat_last_n <int>    Set how far back to look for repetitions
  /set parameter num_gpu <int>          The number of layers to send to the GPU
  /set parameter stop <string> <string> ...   Set the stop parameters

"""

SHORTCUTS_HELP = """Available keyboard shortcuts:
  Ctrl + a            Move to the beginning of the line (Home)
  Ctrl + e            Move to the end of the line (End)
   Alt + b            Move back (left) one word
   Alt + f            Move forward (right) one word
  Ctrl + k            Delete the sentence after the cursor
  Ctrl + u            Delete the sentence before the cursor
  Ctrl + w            Delete the word before the cursor

  Ctrl + l            Clear the screen
  Ctrl + c            Stop the model from responding
  Ctrl + d            Exit trioshed (/bye)

"""

_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def parameter(name: str, values: list[str]) -> object:
    """``/set parameter NAME VALUE...`` typed as Ollama types it (``stop`` takes every value, the
    others the first); ``ValueError`` with Ollama's message for an unknown name or a bad value."""
    kind = PARAMETER_TYPES.get(name)
    if kind is None:
        raise ValueError(f"unknown parameter '{name}'")
    if kind is list:
        return list(values)
    text = values[0]
    try:
        if kind is bool:
            if text not in _TRUE + _FALSE:
                raise ValueError(text)
            return text in _TRUE
        return float(text) if kind is float else int(text, 10)
    except ValueError:
        what = {bool: "bool", float: "float", int: "int"}[kind]
        raise ValueError(f"invalid {what} value [{' '.join(values)}]") from None


def _go_text(value: object) -> str:
    """A value as Go's ``%v`` prints it in ``/show parameters``: ``[a b]``, ``true``, ``0.7``."""
    if isinstance(value, list):
        return "[" + " ".join(str(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass
class Session:
    """What the next request is made of, and how answers are shown."""

    model: str
    keep_alive: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)  # this chat's turns, sent each time
    loaded: list[dict[str, Any]] = field(default_factory=list)  # the model's own (the server sends them)
    system: str = ""
    options: dict[str, object] = field(default_factory=dict)
    format: str = ""
    think: bool | str | None = None
    hide_thinking: bool = False
    verbose: bool = False
    wordwrap: bool = False
    history: bool = True
    capabilities: list[str] | None = None  # from /api/show; None where it could not be read

    @property
    def vision(self) -> bool:
        return self.capabilities is not None and "vision" in self.capabilities

    def body(self) -> dict[str, Any]:
        """The ``/api/chat`` request for the conversation so far."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages, "stream": True, **self.keep_alive}
        if self.format:
            body["format"] = self.format
        if self.options:
            body["options"] = dict(self.options)
        if self.think is not None:
            body["think"] = self.think
        return body

    def clear(self) -> None:
        """``/clear``: the conversation goes, the system message stays (as Ollama keeps it)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def set_system(self, text: str) -> None:
        """The system message from now on: it replaces a system message just set, else it is
        added to the conversation (as Ollama does; the model's own then no longer applies)."""
        self.system = text
        message = {"role": "system", "content": text}
        if self.messages and self.messages[-1]["role"] == "system":
            self.messages[-1] = message
        else:
            self.messages.append(message)

    def apply_show(self, answer: dict[str, Any]) -> None:
        """What ``/api/show`` says of the model: its capabilities and its own messages."""
        caps = answer.get("capabilities")
        self.capabilities = [str(c) for c in caps] if isinstance(caps, list) else None
        loaded = answer.get("messages")
        self.loaded = [m for m in loaded if isinstance(m, dict)] if isinstance(loaded, list) else []


def command_set(session: Session, words: list[str], rest: str) -> str:
    """``/set ...``: the session changed, and what to print. ``rest`` is the text after
    ``/set system`` as typed (a multi-line one is gathered by the caller)."""
    if len(words) < 2:
        return SET_HELP
    what = words[1]
    flags = {
        "history": ("history", True, ""), "nohistory": ("history", False, ""),
        "wordwrap": ("wordwrap", True, "Set 'wordwrap' mode.\n"), "nowordwrap": ("wordwrap", False, "Set 'nowordwrap' mode.\n"),
        "verbose": ("verbose", True, "Set 'verbose' mode.\n"), "quiet": ("verbose", False, "Set 'quiet' mode.\n"),
    }  # fmt: skip
    if what in flags:
        name, value, said = flags[what]
        setattr(session, name, value)
        return said
    if what == "think":
        level = words[2] if len(words) > 2 else ""
        session.think = level or True
        return f"Set 'think' mode to '{level}'.\n" if level else "Set 'think' mode.\n"
    if what == "nothink":
        session.think = False
        return "Set 'nothink' mode.\n"
    if what == "format":
        if len(words) < 3 or words[2] != "json":
            return "Invalid or missing format. For 'json' mode use '/set format json'\n"
        session.format = "json"
        return "Set format to 'json' mode.\n"
    if what == "noformat":
        session.format = ""
        return "Disabled format.\n"
    if what == "parameter":
        if len(words) < 4:
            return PARAMETERS_HELP
        try:
            session.options[words[2]] = parameter(words[2], words[3:])
        except ValueError as exc:
            return f"Couldn't set parameter: {json.dumps(str(exc))}\n"
        return f"Set parameter '{words[2]}' to '{', '.join(words[3:])}'\n"
    if what == "system":
        if not rest:
            return SET_HELP
        session.set_system(rest)
        return "Set system message.\n"
    return f"Unknown command '/set {what}'. Type /? for help\n"


def command_unset(session: Session, words: list[str]) -> str:
    """``/unset parameter NAME | system | format``: back to the model's own."""
    if len(words) < 2:
        return UNSET_HELP
    what = words[1]
    if what == "parameter":
        if len(words) < 3:
            return UNSET_HELP
        if words[2] not in PARAMETER_TYPES:
            return f"Couldn't unset parameter: {json.dumps(f'unknown parameter {words[2]!r}')}\n"
        session.options.pop(words[2], None)
        return f"Unset parameter '{words[2]}'.\n"
    if what == "system":
        session.system = ""
        session.messages = [m for m in session.messages if m["role"] != "system"]
        return "Unset system message.\n"
    if what == "format":
        session.format = ""
        return "Disabled format.\n"
    return f"Unknown command '/unset {what}'. Type /? for help\n"


def command_show(session: Session, words: list[str], client: httpx.Client) -> str:
    """``/show info | license | modelfile | parameters | system | template``, from ``/api/show``."""
    if len(words) < 2:
        return SHOW_HELP
    response = client.post("/api/show", json={"model": session.model})
    if response.status_code >= 400:
        return f"error: couldn't get model: {error_of(response)}\n"
    answer = response.json()
    what = words[1]
    if what == "info":
        return show_text(answer)
    if what == "license":
        return f"{answer.get('license') or 'No license was specified for this model.'}\n"
    if what == "modelfile":
        return f"{answer.get('modelfile') or ''}\n"
    if what == "parameters":
        lines = str(answer.get("parameters") or "").splitlines()
        out = "Model defined parameters:\n"
        out += "".join(f"  {line}\n" for line in lines) if lines else "  No additional parameters were specified for this model.\n"
        out += "\n"
        if session.options:
            out += "User defined parameters:\n" + "".join(f"  {k:<30} {_go_text(v)}\n" for k, v in session.options.items()) + "\n"
        return out
    if what == "system":
        system = session.system or str(answer.get("system") or "")
        return f"{system}\n\n" if system else "No system message was specified for this model.\n"
    if what == "template":
        return f"{answer.get('template') or 'No prompt template was specified for this model.'}\n"
    return f"Unknown command '/show {what}'. Type /? for help\n"


def command_save(session: Session, words: list[str], client: httpx.Client) -> str:
    """``/save MODEL``: the conversation (the model's own messages, then this chat's), the system
    message and the parameters, as a new model made ``from`` this one through ``/api/create``."""
    if len(words) != 2:
        return "Usage:\n  /save <modelname>\n"
    name = words[1]
    request: dict[str, Any] = {"model": name, "from": session.model, "stream": False}
    if session.system:
        request["system"] = session.system
    if session.options:
        request["parameters"] = dict(session.options)
    messages = [{"role": m["role"], "content": str(m.get("content") or "")} for m in [*session.loaded, *session.messages]]
    if messages:
        request["messages"] = messages
    response = client.post("/api/create", json=request)
    if response.status_code >= 400:
        error = error_of(response)
        if error.startswith("invalid model name"):
            return f"error: The model name '{name}' is invalid\n"
        return f"error: {error}\n"
    return f"Created new model '{name}'\n"


_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """A model's text as it may reach the terminal: control characters (the escape that starts
    every terminal sequence, ``\\r``, backspace, C1 codes) shown in caret or ``\\x`` form instead
    of acting; new lines and tabs kept (``\\r\\n`` as a new line)."""
    if not _CONTROLS.search(text):
        return text
    return _CONTROLS.sub(_shown, text.replace("\r\n", "\n"))


def _shown(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"^{chr(code ^ 0x40)}" if code < 0x80 else f"\\x{code:02x}"  # ESC is ^[, DEL ^?


def transcript(messages: list[dict[str, Any]]) -> str:
    """A model's own conversation as the chat shows it when the model is started: each user
    message after a ``>>>`` prompt, each answer followed by an empty line."""
    out = ""
    for m in messages:
        if m.get("role") == "user":
            out += f">>> {m.get('content') or ''}\n"
        elif m.get("role") == "assistant":
            out += f"{m.get('content') or ''}\n\n"
    return printable(out)
