"""Modelfiles, parsed as Ollama parses them, and the pieces of a create request checked (pure).

A Modelfile is a list of instructions, one per line, case-insensitive::

    # a comment
    FROM llama3.2            # a model, a registry name, a GGUF file or a folder of them
    PARAMETER num_ctx 8192   # repeated for a list (stop)
    TEMPLATE \"\"\"{{ .Prompt }}\"\"\"
    SYSTEM "You are terse."
    ADAPTER ./lora.gguf
    MESSAGE user Hello
    LICENSE \"\"\"MIT\"\"\"
    REQUIRES 0.6.0

A value is the rest of the line, a ``"…"`` string (``\\"`` and ``\\\\`` escaped) or a
``\"\"\"…\"\"\"`` block that may span lines. Every error names its line (:class:`ModelfileError`,
a 400).

:func:`parameter_value` types a ``PARAMETER`` as Ollama's options are typed (an unknown name or a
bad value is a 400); :func:`check_template` accepts what Ollama's Go-template parser accepts (and a
Jinja template, whose blocks must balance); :func:`render` writes the Modelfile that creates a
model again (what ``/api/show`` answers as ``modelfile``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from trioshed.errors import BadRequest

INSTRUCTIONS = ("from", "parameter", "template", "system", "adapter", "message", "license", "requires")
ROLES = ("system", "user", "assistant")

#: Ollama's options (``api.Options`` and ``api.Runner``) and their types.
PARAMETER_TYPES: dict[str, type] = {
    **dict.fromkeys(("num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "seed", "num_predict",
                     "top_k", "repeat_last_n", "mirostat"), int),
    **dict.fromkeys(("top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
                     "frequency_penalty", "tfs_z", "mirostat_tau", "mirostat_eta"), float),
    **dict.fromkeys(("use_mmap", "use_mlock", "numa", "low_vram", "vocab_only", "penalize_newline", "f16_kv",
                     "logits_all"), bool),
    "stop": list,
}


class ModelfileError(BadRequest):
    """A Modelfile that cannot be used (400); the message names the line."""


@dataclass(frozen=True)
class Command:
    name: str  # lower case: "from", "parameter", ...
    args: str  # the value (unquoted); for "parameter" and "message": "KEY VALUE" split in key/value
    line: int
    key: str = ""  # the parameter's name or the message's role


def parse(text: str) -> list[Command]:
    """The instructions of a Modelfile, in order. Needs a ``FROM``."""
    commands: list[Command] = []
    lines = text.replace("\r\n", "\n").split("\n")
    i = 0
    while i < len(lines):
        number = i + 1
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if "\t" in word:
            word, _, more = word.partition("\t")
            rest = more + " " + rest
        name = word.lower()
        if name not in INSTRUCTIONS:
            raise ModelfileError(
                f"line {number}: unknown instruction {word[:40]!r}: command must be one of "
                + ", ".join(f'"{c}"' for c in INSTRUCTIONS)
            )
        rest = rest.strip()
        key = ""
        if name in ("parameter", "message"):
            key, _, rest = rest.partition(" ")
            rest = rest.strip()
            if not key or not rest:
                what = "PARAMETER needs a name and a value" if name == "parameter" else "MESSAGE needs a role and a text"
                raise ModelfileError(f"line {number}: {what}")
            key = key.lower() if name == "message" else key
            if name == "message" and key not in ROLES:
                raise ModelfileError(f'line {number}: message role must be one of "system", "user", or "assistant"')
        value, i = _value(rest, lines, i, number)
        if name in ("from", "adapter", "requires") and not value:
            raise ModelfileError(f"line {number}: {name.upper()} needs a value")
        commands.append(Command(name, value, number, key))
    if not any(c.name == "from" for c in commands):
        raise ModelfileError("no FROM line")
    return commands


def _value(rest: str, lines: list[str], i: int, number: int) -> tuple[str, int]:
    """The value starting at ``rest`` (line ``number``); a triple-quoted one may take more lines."""
    if rest.startswith('"""'):
        body = rest[3:]
        while '"""' not in body:
            if i >= len(lines):
                raise ModelfileError(f'line {number}: unterminated """ string')
            body += "\n" + lines[i]
            i += 1
        value, _, after = body.partition('"""')
        if after.strip():
            raise ModelfileError(f'line {number}: unexpected text after the closing """')
        return value, i
    if rest.startswith('"'):
        out = []
        j = 1
        while j < len(rest):
            c = rest[j]
            if c == "\\" and j + 1 < len(rest) and rest[j + 1] in '"\\':
                out.append(rest[j + 1])
                j += 2
                continue
            if c == '"':
                if rest[j + 1 :].strip():
                    raise ModelfileError(f'line {number}: unexpected text after the closing "')
                return "".join(out), i
            out.append(c)
            j += 1
        raise ModelfileError(f'line {number}: unterminated " string')
    return rest, i


def parameter_value(name: str, value: object, *, line: int | None = None) -> object:
    """A parameter typed as Ollama's option ``name`` is typed; text (a Modelfile) is converted."""
    where = f"line {line}: " if line is not None else ""
    kind = PARAMETER_TYPES.get(name)
    if kind is None:
        raise BadRequest(f"{where}unknown parameter '{str(name)[:60]}'")
    if kind is list:
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in items):
            raise BadRequest(f"{where}invalid value for parameter '{name}': expected text")
        return list(items)
    if isinstance(value, str):
        text = value.strip()
        try:
            if kind is bool:
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return text.lower() in ("true", "1")
            return kind(text) if kind is float else int(text)
        except ValueError:
            raise BadRequest(f"{where}invalid {'integer' if kind is int else kind.__name__} value for parameter '{name}': {text[:60]!r}") from None
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise BadRequest(f"{where}invalid value for parameter '{name}': {json.dumps(value)[:60]}")


def parameters_of(commands: list[Command]) -> dict[str, object]:
    """The ``PARAMETER`` lines as typed values (``stop`` gathered into a list)."""
    out: dict[str, object] = {}
    for c in commands:
        if c.name != "parameter":
            continue
        value = parameter_value(c.key, c.args, line=c.line)
        if isinstance(value, list):
            existing = out.setdefault(c.key, [])
            assert isinstance(existing, list)
            existing.extend(value)
        else:
            out[c.key] = value
    return out


# -- as a create request ---------------------------------------------------------------------

#: A ``FROM``/``ADAPTER`` value that names a blob: ``@sha256:<hex>``, or a path ending in
#: ``sha256-<hex>`` (what ``/api/show`` writes): only the digest is used, never the path.
BLOB_IN_PATH = re.compile(r"(?:^@?|[/\\])sha256[-:]([0-9a-f]{64})$")


def request_fields(commands: list[Command]) -> dict[str, Any]:
    """A Modelfile's instructions as ``/api/create``'s JSON fields (``FROM``/``ADAPTER`` values as
    written: a path is the client's to upload)."""
    out: dict[str, Any] = {}
    froms = [c for c in commands if c.name == "from"]
    out["from"] = froms[0].args
    extra = [c.args for c in froms[1:]]
    if extra:
        out["_more_from"] = extra
    adapters = [c.args for c in commands if c.name == "adapter"]
    if adapters:
        out["_adapters"] = adapters
    for name in ("template", "system"):
        values = [c.args for c in commands if c.name == name]
        if values:
            out[name] = values[-1]
    licenses = [c.args for c in commands if c.name == "license"]
    if licenses:
        out["license"] = licenses
    params = parameters_of(commands)
    if params:
        out["parameters"] = params
    messages = [{"role": c.key, "content": c.args} for c in commands if c.name == "message"]
    if messages:
        out["messages"] = messages
    requires = [c.args for c in commands if c.name == "requires"]
    if requires:
        out["requires"] = requires[-1]
    return out


def server_fields(text: str) -> dict[str, Any]:
    """The ``modelfile`` field's text on the server: only digests and model names are usable."""
    fields = request_fields(parse(text))
    files: dict[str, str] = {}
    for value in fields.pop("_more_from", []):
        match = BLOB_IN_PATH.search(value.strip())
        if not match:
            raise BadRequest(f"FROM {value[:80]!r}: a second FROM must name an uploaded blob (@sha256:<hex>)")
        files[f"sha256-{match.group(1)}.gguf"] = f"sha256:{match.group(1)}"
    adapters: dict[str, str] = {}
    for value in fields.pop("_adapters", []):
        match = BLOB_IN_PATH.search(value.strip())
        if not match:
            raise BadRequest(f"ADAPTER {value[:80]!r} is a file path, which the server does not read: upload it "
                             "(POST /api/blobs/sha256:<hex>) and name it as ADAPTER @sha256:<hex>, or use 'trioshed create -f'")  # fmt: skip
        adapters[f"sha256-{match.group(1)}.gguf"] = f"sha256:{match.group(1)}"
    if files:
        fields["files"] = files
    if adapters:
        fields["adapters"] = adapters
    return fields


# -- templates --------------------------------------------------------------------------------

_GO_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.DOTALL)
_GO_OPEN = ("if", "range", "with", "define", "block")
_JINJA_TAG = re.compile(r"\{%-?\s*(\w+)(.*?)-?%\}", re.DOTALL)
_JINJA_OPEN = {"if": "endif", "for": "endfor", "macro": "endmacro", "call": "endcall", "filter": "endfilter",
               "set": "endset", "raw": "endraw", "block": "endblock", "generation": "endgeneration"}  # fmt: skip


def check_template(template: str) -> None:
    """A 400 unless ``template`` parses: Go's text/template (as Ollama checks it), or Jinja (a
    template with ``{%`` tags), whose blocks must nest and close."""
    if "{%" in template:
        _check_jinja(template)
        return
    stack: list[str] = []
    rest = template
    for match in _GO_ACTION.finditer(template):
        body = match.group(2).strip()
        if body.startswith("/*"):
            if not body.endswith("*/"):
                raise BadRequest("template error: unclosed comment")
            continue
        if not body:
            raise BadRequest("template error: missing value for command")
        word = body.split()[0].split("(")[0]
        if word in _GO_OPEN:
            if word in ("define", "block") and not re.match(r'^\w+\s+"[^"]*"', body):
                raise BadRequest(f"template error: {word} needs a quoted name")
            stack.append(word)
        elif word == "else":
            if not stack or stack[-1] not in ("if", "range", "with"):
                raise BadRequest("template error: unexpected {{else}}")
        elif word == "end":
            if not stack:
                raise BadRequest("template error: unexpected {{end}}")
            stack.pop()
        if body.count('"') % 2 or body.count("(") != body.count(")"):
            raise BadRequest(f"template error: unterminated or unbalanced action {{{{{body[:40]}}}}}")
    rest = _GO_ACTION.sub("", template)
    if "{{" in rest:
        raise BadRequest("template error: unclosed action")
    if stack:
        raise BadRequest(f"template error: unexpected EOF: {{{{{stack[-1]}}}}} is not closed with {{{{end}}}}")


def _check_jinja(template: str) -> None:
    stack: list[str] = []
    for match in _JINJA_TAG.finditer(template):
        word, args = match.group(1), match.group(2)
        if word == "set" and "=" in args:
            continue  # {% set x = ... %} has no end
        if word in _JINJA_OPEN:
            stack.append(_JINJA_OPEN[word])
        elif word.startswith("end"):
            if not stack or stack[-1] != word:
                raise BadRequest(f"template error: unexpected {{% {word} %}}")
            stack.pop()
        elif word in ("elif", "else") and not stack:
            raise BadRequest(f"template error: unexpected {{% {word} %}}")
    if stack:
        raise BadRequest(f"template error: a block is not closed (expected {{% {stack[-1]} %}})")


# -- rendering ----------------------------------------------------------------------------------


def quote(text: str) -> str:
    """A value as a Modelfile writes it: ``\"\"\"…\"\"\"`` (text with a ``\"\"\"`` as a ``"…"`` string)."""
    if '"""' not in text:
        return f'"""{text}"""'
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def parameter_lines(parameters: dict[str, object] | tuple[tuple[str, object], ...]) -> list[str]:
    """``name value`` per parameter, a list one line per item (Ollama's ``parameters`` text)."""
    items = parameters.items() if isinstance(parameters, dict) else parameters
    lines = []
    for key, value in items:
        for item in value if isinstance(value, list | tuple) else [value]:
            lines.append(f"{key:<30} {json.dumps(item, ensure_ascii=False)}")
    return lines


def render(
    *, name: str, model: list[str], adapters: list[str], template: str = "", system: str = "",
    parameters: tuple[tuple[str, object], ...] = (), messages: list[dict[str, Any]] | None = None,
    licenses: list[str] | None = None, requires: str = "",
) -> str:  # fmt: skip
    """The Modelfile of a model, as ``/api/show`` answers it: created again, it gives the same
    manifest (``FROM`` names its files; on the server a ``…/sha256-<hex>`` path names that blob)."""
    lines = [f"# Modelfile of {name} as trioshed serves it", "# To build a new Modelfile based on this one, replace FROM with:",
             f"# FROM {name}", ""]  # fmt: skip
    lines += [f"FROM {m}" for m in model]
    if template:
        lines.append(f"TEMPLATE {quote(template)}")
    if system:
        lines.append(f"SYSTEM {quote(system)}")
    lines += [f"PARAMETER {line}" for line in parameter_lines(parameters)]
    lines += [f"ADAPTER {a}" for a in adapters]
    for message in messages or []:
        lines.append(f"MESSAGE {message.get('role', 'user')} {quote(str(message.get('content', '')))}")
    lines += [f"LICENSE {quote(text)}" for text in licenses or []]
    if requires:
        lines.append(f"REQUIRES {requires}")
    return "\n".join(lines) + "\n"
