"""``models.toml``: per-model settings, read into an immutable :class:`Catalogue`.

::

    [models."qwen-long"]                 # a name, optionally with a tag ("qwen:32k")
    path = "qwen2.5-7b-q4_k_m.gguf"      # required; relative to the store folder
    aliases = ["qwen", "assistant:v2"]   # more names for the same model (listed in /api/tags)
    adapters = ["my-lora.gguf"]          # LoRA adapters on path (also { path = "b.gguf", scale = 0.5 })
    projector = "mmproj.gguf"            # --mmproj
    options = { temperature = 0.2 }      # default options (a request's own options win)
    num_ctx = 32768                      # default context per slot
    num_parallel = 2                     # slots of this model's runners (else TRIOSHED_NUM_PARALLEL)
    keep_alive = "1h"                    # default keep-alive (a request's own keep_alive wins)
    pinned = true                        # never evicted to make room for another model
    preload = true                       # loaded at start-up, before the first request
    priority = 10                        # planned first when several requests wait for memory
    args = ["--rope-scaling", "yarn", "--yarn-orig-ctx", "32768"]   # see ALLOWED_ARGS
    system = "You are terse."            # default system prompt (a request's own wins)
    speculation = "ngram"                # speculative decoding: off, ngram or an n-gram kind
    draft = "qwen2.5-0.5b"               # a draft model from the store (same vocabulary)

Parsing is pure apart from reading the file (and a stat per model file, to warn about missing
ones): :func:`load_catalogue` returns a new catalogue each time, so re-reading the file (on a
change, or on SIGHUP) is building a new value and swapping it in. An invalid entry is left out
and reported as a :class:`Problem` naming the file, the key and the reason; the rest still loads.
A file that is not valid TOML yields an empty catalogue with one problem.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from trioshed.config_values import parse_duration
from trioshed.core.speculation import OFF, parse_speculation
from trioshed.errors import BadRequest
from trioshed.models.names import full_name

#: llama-server flags a model may add through ``args``, with the number of values each takes.
#: Only flags that change neither what trioshed decides (model, port, context, slots, batch,
#: placement, threads, KV cache type, flash attention, embeddings, adapters, projector, logging)
#: nor the memory it accounts for (ubatch, SWA cache size, repacking, tensor overrides, draft
#: models). Sampling defaults belong in ``options``. Long spellings only.
ALLOWED_ARGS: Mapping[str, int] = MappingProxyType(
    {
        # RoPE / YaRN context extension
        "--rope-scaling": 1,
        "--rope-scale": 1,
        "--rope-freq-base": 1,
        "--rope-freq-scale": 1,
        "--yarn-orig-ctx": 1,
        "--yarn-ext-factor": 1,
        "--yarn-attn-factor": 1,
        "--yarn-beta-slow": 1,
        "--yarn-beta-fast": 1,
        # chat template and reasoning
        "--jinja": 0,
        "--no-jinja": 0,
        "--chat-template": 1,
        "--chat-template-kwargs": 1,
        "--reasoning": 1,
        "--reasoning-format": 1,
        "--reasoning-budget": 1,
        # prompt cache and context handling
        "--context-shift": 0,
        "--no-context-shift": 0,
        "--cache-prompt": 0,
        "--no-cache-prompt": 0,
        "--cache-reuse": 1,
        "--cache-ram": 1,
        "--slot-prompt-similarity": 1,
        # loading and output
        "--mlock": 0,
        "--warmup": 0,
        "--no-warmup": 0,
        "--check-tensors": 0,
        "--spm-infill": 0,
        "--embd-normalize": 1,
        "--image-min-tokens": 1,
        "--image-max-tokens": 1,
    }
)

_ENTRY_KEYS = (
    "path", "aliases", "adapters", "projector", "options", "num_ctx", "num_parallel",
    "keep_alive", "pinned", "preload", "priority", "args", "system", "speculation", "draft",
)  # fmt: skip


@dataclass(frozen=True)
class Problem:
    """Something wrong in the file: ``key`` is the dotted TOML key (``models.qwen.priority``)."""

    file: str
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.reason}"


@dataclass(frozen=True)
class Entry:
    """One valid ``[models.NAME]`` table, with file paths made absolute."""

    name: str  # "name:tag"
    path: str
    aliases: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()
    adapter_scales: tuple[float, ...] = ()  # one per adapter (1.0 unless given)
    projector: str | None = None
    options: tuple[tuple[str, object], ...] = ()  # num_ctx folded in
    num_parallel: int | None = None
    keep_alive: float | None = None
    pinned: bool = False
    preload: bool = False
    priority: int = 0
    args: tuple[str, ...] = ()
    system: str = ""
    speculation: str | None = None  # None: TRIOSHED_SPECULATION
    draft: str | None = None  # a model name ("name:tag"), resolved by the store when used


@dataclass(frozen=True)
class Catalogue:
    """The valid entries of one ``models.toml``, by name and alias, and what was wrong in it."""

    entries: tuple[Entry, ...] = ()
    problems: tuple[Problem, ...] = ()
    _names: Mapping[str, Entry] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        names: dict[str, Entry] = {}
        for entry in self.entries:
            for name in (entry.name, *entry.aliases):
                names.setdefault(name, entry)
        object.__setattr__(self, "_names", MappingProxyType(names))

    def lookup(self, full_name: str) -> Entry | None:
        """The entry called ``full_name`` ("name:tag") by its own name or an alias."""
        return self._names.get(full_name)

    @property
    def names(self) -> Mapping[str, Entry]:
        """Every name (entries' own and aliases) → its entry."""
        return self._names

    @property
    def preload(self) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if e.preload)


def load_catalogue(path: Path, root: Path | None = None) -> Catalogue:
    """Read ``path`` (absent: an empty catalogue). Relative model paths are under ``root``
    (default: the file's folder)."""
    root = path.parent if root is None else root
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Catalogue()
    except (OSError, UnicodeDecodeError) as exc:
        return Catalogue(problems=(Problem(str(path), "(file)", f"cannot read it: {exc}"),))
    return parse_catalogue(text, str(path), root)


def parse_catalogue(text: str, file: str, root: Path) -> Catalogue:
    """Parse the text of a ``models.toml`` (see the module docstring)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        reason = f"not valid TOML ({exc}); no model of this file is served, the folder's *.gguf files still are"
        return Catalogue(problems=(Problem(file, "(file)", reason),))
    problems: list[Problem] = []
    for key in data:
        if key != "models":
            problems.append(Problem(file, key, "unknown key: models go in [models.NAME] tables"))
    models = data.get("models", {})
    if not isinstance(models, dict):
        problems.append(Problem(file, "models", "must be a table of [models.NAME] tables"))
        models = {}
    entries: list[Entry] = []
    taken: dict[str, str] = {}  # name or alias -> the entry key that has it
    for key, table in models.items():
        entry, errors = _parse_entry(key, table, file, root)
        if entry is not None:
            for name in (entry.name, *entry.aliases):
                if name in taken:
                    what, sub = ("name", "") if name == entry.name else ("alias", "aliases")
                    reason = f"{what} '{name}' is already used by [models.{_quote(taken[name])}]"
                    errors.append(Problem(file, _key(key, sub), reason))
        if errors:
            problems += [_skipped(p, key) for p in errors]
            continue
        assert entry is not None
        for name in (entry.name, *entry.aliases):
            taken[name] = key
        entries.append(entry)
        problems += _missing_files(entry, file, key)
    return Catalogue(tuple(entries), tuple(problems))


def _quote(key: str) -> str:
    return key if key.replace("-", "").replace("_", "").isalnum() else f'"{key}"'


def _key(entry_key: str, sub: str) -> str:
    return f"models.{_quote(entry_key)}" + (f".{sub}" if sub else "")


def _skipped(problem: Problem, entry_key: str) -> Problem:
    return Problem(problem.file, problem.key, f"{problem.reason} (model '{entry_key}' is not served)")


def _missing_files(entry: Entry, file: str, key: str) -> list[Problem]:
    out = []
    for what, p in (("path", entry.path), *(("adapters", a) for a in entry.adapters),
                    *((("projector", entry.projector),) if entry.projector else ())):  # fmt: skip
        if not Path(p).is_file():
            out.append(Problem(file, _key(key, what), f"{p} does not exist (yet): requests for '{entry.name}' fail until it does"))
    return out


def _parse_entry(key: str, table: object, file: str, root: Path) -> tuple[Entry | None, list[Problem]]:
    errors: list[Problem] = []

    def bad(sub: str, reason: str) -> None:
        errors.append(Problem(file, _key(key, sub), reason))

    if not isinstance(table, dict):
        bad("", "must be a table: [models.NAME] with path = \"file.gguf\"")
        return None, errors
    try:
        name = full_name(key)
    except BadRequest as exc:
        bad("", exc.message)
        name = key
    for unknown in sorted(set(table) - set(_ENTRY_KEYS)):
        if isinstance(table[unknown], dict):  # [models.qwen2.5] is models -> qwen2 -> 5
            bad(unknown, f'unknown key; a name with a dot must be quoted: [models."{key}.{unknown}"]')
        else:
            bad(unknown, f"unknown key; known: {', '.join(_ENTRY_KEYS)} (other options go in options = {{...}})")

    def file_path(sub: str, value: object) -> str | None:
        if not isinstance(value, str) or not value:
            bad(sub, f"must be a file path, got {value!r}")
            return None
        p = Path(value).expanduser()
        return str(p if p.is_absolute() else root / p)

    def str_list(sub: str) -> list[str]:
        value = table.get(sub, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            bad(sub, f"must be a list of strings, got {value!r}")
            return []
        return value

    def integer(sub: str, minimum: int | None) -> int | None:
        value = table.get(sub)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            bad(sub, f"must be an integer, got {value!r}")
            return None
        if minimum is not None and value < minimum:
            bad(sub, f"must be at least {minimum}, got {value}")
            return None
        return value

    def flag(sub: str) -> bool:
        value = table.get(sub, False)
        if not isinstance(value, bool):
            bad(sub, f"must be true or false, got {value!r}")
            return False
        return value

    path = file_path("path", table["path"]) if "path" in table else None
    if "path" not in table:
        bad("path", 'is required: the GGUF file, e.g. path = "model.gguf"')
    aliases = []
    for alias in str_list("aliases"):
        try:
            aliases.append(full_name(alias))
        except BadRequest as exc:
            bad("aliases", exc.message)
    adapters, scales = _adapters(table.get("adapters", []), file_path, lambda reason: bad("adapters", reason))
    projector = file_path("projector", table["projector"]) if "projector" in table else None
    options = table.get("options", {})
    if not isinstance(options, dict):
        bad("options", f"must be a table like {{ temperature = 0.2 }}, got {options!r}")
        options = {}
    num_ctx = integer("num_ctx", 1)
    if num_ctx is not None:
        options = {**options, "num_ctx": num_ctx}
    num_parallel = integer("num_parallel", 1)
    priority = integer("priority", None) or 0
    keep_alive = None
    if "keep_alive" in table:
        try:
            keep_alive = parse_duration(table["keep_alive"])
        except (ValueError, TypeError) as exc:
            bad("keep_alive", str(exc))
    pinned, preload = flag("pinned"), flag("preload")
    system = table.get("system", "")
    if not isinstance(system, str):
        bad("system", f"must be a string, got {system!r}")
        system = ""
    args = _parse_args(table.get("args", []), lambda reason: bad("args", reason))
    speculation = None
    if "speculation" in table:
        try:
            speculation = parse_speculation(table["speculation"])
        except ValueError as exc:
            bad("speculation", str(exc))
    draft = None
    if "draft" in table:
        if not isinstance(table["draft"], str) or not table["draft"]:
            bad("draft", f"must be the name of a model in the store, e.g. draft = \"qwen2.5-0.5b\", got {table['draft']!r}")
        else:
            try:
                draft = full_name(table["draft"])
            except BadRequest as exc:
                bad("draft", exc.message)
        if speculation == OFF:
            bad("draft", 'speculation = "off" and a draft model contradict each other; remove one')
    if errors or path is None:
        return None, errors
    if pinned and keep_alive is None:
        keep_alive = math.inf  # a pinned model stays loaded unless a request says otherwise
    return (
        Entry(
            name=name,
            path=path,
            aliases=tuple(a for a in dict.fromkeys(aliases) if a != name),
            adapters=tuple(adapters),
            adapter_scales=tuple(scales) if any(x != 1.0 for x in scales) else (),
            projector=projector,
            options=tuple(sorted(options.items())),
            num_parallel=num_parallel,
            keep_alive=keep_alive,
            pinned=pinned,
            preload=preload,
            priority=priority,
            args=args,
            system=system,
            speculation=speculation,
            draft=draft,
        ),
        errors,
    )


def _adapters(
    value: object, file_path: Callable[[str, object], str | None], bad: Callable[[str], None]
) -> tuple[list[str], list[float]]:
    """``adapters``: each a file path, or a table ``{ path = "...", scale = 0.5 }`` (scale 1.0
    unless given). A path with a comma is refused: llama-server's ``--lora`` takes a
    comma-separated list."""
    shape = 'a list of files, e.g. ["a.gguf", { path = "b.gguf", scale = 0.5 }]'
    if not isinstance(value, list):
        bad(f"must be {shape}, got {value!r}")
        return [], []
    paths: list[str] = []
    scales: list[float] = []
    for item in value:
        scale: object = 1.0
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"path", "scale"})
            if unknown or "path" not in item:
                bad(f"an adapter table takes path and scale, got {item!r}")
                continue
            item, scale = item["path"], item.get("scale", 1.0)
        if not isinstance(scale, int | float) or isinstance(scale, bool) or not math.isfinite(scale):
            bad(f"an adapter's scale must be a number, got {scale!r}")
            continue
        path = file_path("adapters", item)
        if path is None:
            continue
        if "," in path:
            bad(f"{path!r} holds a comma, which llama-server's --lora cannot take: rename the file")
            continue
        paths.append(path)
        scales.append(float(scale))
    return paths, scales


def _parse_args(value: object, bad: Callable[[str], None]) -> tuple[str, ...]:
    """Check ``args`` against :data:`ALLOWED_ARGS`: each flag followed by its values.
    ``"--flag=value"`` is split. Numbers are accepted as values."""
    if not isinstance(value, list) or not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in value):
        bad(f"must be a list of strings, e.g. [\"--rope-scaling\", \"yarn\"], got {value!r}")
        return ()
    tokens = [str(v) for v in value]
    out: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        flag_, eq, inline = token.partition("=")
        if flag_ not in ALLOWED_ARGS:
            if token.startswith("-"):
                bad(f"{flag_!r} is not allowed (trioshed sets it, or it changes memory use); allowed: {', '.join(ALLOWED_ARGS)}")
            else:
                bad(f"unexpected value {token!r}: every value must follow a flag that takes one")
            return ()
        arity = ALLOWED_ARGS[flag_]
        if eq:
            if arity != 1:
                bad(f"{flag_} takes no value")
                return ()
            out += [flag_, inline]
            i += 1
            continue
        values = tokens[i + 1 : i + 1 + arity]
        if len(values) < arity:
            bad(f"{flag_} needs a value")
            return ()
        out += [flag_, *values]
        i += 1 + arity
    return tuple(out)
