"""The Modelfile parser, parameter typing, template checks and create-request checks: pure, no I/O.
And the blob writer's refusals (a wrong digest, too large, no room) leave nothing behind."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from trioshed.errors import BadRequest, InsufficientStorage, PayloadTooLarge
from trioshed.models import modelfile as mf
from trioshed.models.blobs import receive_blob
from trioshed.models.create import parse_request

HEX = "ab" * 32


def test_every_instruction_comments_and_quoting() -> None:
    text = (
        "# comment\n\n"
        "from llama3.2\n"
        "PARAMETER temperature 0.7\n"
        "PARAMETER stop <|eot|>\n"
        'PARAMETER stop "two words"\n'
        'TEMPLATE """{{ if .System }}{{ .System }}\n{{ end }}{{ .Prompt }}"""\n'
        'SYSTEM "say \\"hi\\" \\\\ bye"\n'
        "ADAPTER ./lora.gguf\n"
        "MESSAGE User hello there\n"
        'MESSAGE assistant """multi\nline"""\n'
        "LICENSE MIT\n"
        "REQUIRES 0.6.0\n"
    )
    commands = mf.parse(text)
    assert [(c.name, c.line) for c in commands] == [
        ("from", 3), ("parameter", 4), ("parameter", 5), ("parameter", 6), ("template", 7), ("system", 9),
        ("adapter", 10), ("message", 11), ("message", 12), ("license", 14), ("requires", 15),
    ]  # fmt: skip
    fields = mf.request_fields(commands)
    assert fields["from"] == "llama3.2"
    assert fields["parameters"] == {"temperature": 0.7, "stop": ["<|eot|>", "two words"]}
    assert fields["template"] == "{{ if .System }}{{ .System }}\n{{ end }}{{ .Prompt }}"
    assert fields["system"] == 'say "hi" \\ bye'
    assert fields["messages"] == [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "multi\nline"}]
    assert fields["license"] == ["MIT"] and fields["requires"] == "0.6.0" and fields["_adapters"] == ["./lora.gguf"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("FROM x\nFOO bar\n", "line 2: unknown instruction 'FOO'"),
        ("FROM x\nPARAMETER num_ctx\n", "line 2: PARAMETER needs a name and a value"),
        ("FROM x\nPARAMETER num_ctx big\n", "line 2: invalid integer value for parameter 'num_ctx'"),
        ("FROM x\nPARAMETER temperature hot\n", "line 2: invalid float value"),
        ("FROM x\nPARAMETER use_mmap maybe\n", "line 2: invalid bool value"),
        ("FROM x\n\nPARAMETER bogus 1\n", "line 3: unknown parameter 'bogus'"),
        ("FROM x\nMESSAGE wizard hi\n", 'line 2: message role must be one of "system", "user", or "assistant"'),
        ('FROM x\nSYSTEM """never closed\n', 'line 2: unterminated """ string'),
        ('FROM x\nSYSTEM "open\n', 'line 2: unterminated " string'),
        ('FROM x\nSYSTEM "a" b\n', "line 2: unexpected text"),
        ("PARAMETER num_ctx 1\n", "no FROM line"),
        ("FROM\n", "line 1: FROM needs a value"),
    ],
)
def test_bad_modelfiles_name_the_line(text: str, words: str) -> None:
    with pytest.raises(BadRequest) as info:
        mf.parameters_of(mf.parse(text))
    assert words in info.value.message


def test_rendered_modelfiles_parse_back_to_the_same_fields() -> None:
    text = mf.render(
        name="m:latest", model=["/s/blobs/sha256-" + HEX], adapters=["/s/blobs/sha256-" + "cd" * 32],
        template='{{ .Prompt }} with """ inside', system="line one\nline two",
        parameters=(("num_ctx", 2048), ("stop", ("a", 'b "q"')), ("temperature", 0.5)),
        messages=[{"role": "user", "content": "hi"}], licenses=["MIT", "Apache"], requires="0.6.0",
    )  # fmt: skip
    fields = mf.server_fields(text)
    assert fields["from"] == "/s/blobs/sha256-" + HEX
    assert fields["adapters"] == {f"sha256-{'cd' * 32}.gguf": f"sha256:{'cd' * 32}"}
    assert fields["template"] == '{{ .Prompt }} with """ inside' and fields["system"] == "line one\nline two"
    assert fields["parameters"] == {"num_ctx": 2048, "stop": ["a", 'b "q"'], "temperature": 0.5}
    assert fields["license"] == ["MIT", "Apache"] and fields["requires"] == "0.6.0"
    request = parse_request({"model": "again", "modelfile": text})
    assert request.files == {f"sha256-{HEX}.gguf": f"sha256:{HEX}"} and request.base is None


@pytest.mark.parametrize(
    "template",
    ["{{ .Prompt }}", "{{ if .System }}<s>{{ .System }}{{ else }}x{{ end }}", "{{- range .Messages }}{{ .Content }}{{ end -}}",
     "{{/* a comment */}}plain", "{% for m in messages %}{{ m.content }}{% endfor %}", "no actions at all"],
)
def test_templates_ollama_accepts(template: str) -> None:
    mf.check_template(template)


@pytest.mark.parametrize(
    "template",
    ["{{ if .System }}open", "{{ end }}", "{{ .Prompt ", "{{ }}", '{{ "unterminated }}', "{{ else }}",
     "{% if x %}never closed", "{% endfor %}", "{% for m in messages %}{% endif %}"],
)
def test_templates_ollama_refuses(template: str) -> None:
    with pytest.raises(BadRequest, match="template error"):
        mf.check_template(template)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"from": "x"}, '"model" is required'),
        ({"model": "a/b/c/d", "from": "x"}, "invalid model name"),
        ({"model": "hf.co/u/r", "from": "x"}, "Hugging Face"),
        ({"model": "m", "from": "/etc/passwd"}, "file path"),
        ({"model": "m", "from": "C:\\models\\x.gguf"}, "file path"),
        ({"model": "m", "files": {"a/b.gguf": f"sha256:{HEX}"}}, "not a path"),
        ({"model": "m", "files": {"..": f"sha256:{HEX}"}}, "not a path"),
        ({"model": "m", "files": {"m.gguf": "sha256:short"}}, "invalid digest"),
        ({"model": "m", "files": ["m.gguf"]}, "must map file names"),
        ({"model": "m", "from": "x", "parameters": {"num_ctx": True}}, "num_ctx"),
        ({"model": "m", "from": "x", "parameters": {"stop": [1]}}, "stop"),
        ({"model": "m", "from": "x", "license": 3}, "license"),
        ({"model": "m", "from": "x", "messages": "hi"}, "messages"),
        ({"model": "m", "path": "/tmp/Modelfile"}, '"path" is not supported'),
        ({"model": "m", "modelfile": "FROM ./here.gguf\n"}, "file path"),
        ({"model": "m", "modelfile": "FROM x\nADAPTER ./l.gguf\n"}, "file path"),
    ],
)
def test_create_requests_are_checked_before_anything_happens(body: dict[str, object], words: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(body)
    assert words in info.value.message


def test_typed_parameters() -> None:
    request = parse_request({"model": "m", "from": "x", "parameters": {"num_ctx": 4096.0, "temperature": 1, "stop": "x", "seed": None}})
    assert request.parameters == {"num_ctx": 4096, "temperature": 1.0, "stop": ["x"]}


class _chunks:
    def __init__(self, *parts: bytes) -> None:
        self.parts = list(parts)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if not self.parts:
            raise StopAsyncIteration
        return self.parts.pop(0)


def files(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*") if p.is_file()]


async def test_blob_refusals_keep_nothing(tmp_path: Path) -> None:
    import hashlib

    data = b"GGUF" + bytes(range(256)) * 10
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with pytest.raises(BadRequest, match="digest mismatch"):
        await receive_blob(tmp_path, digest, _chunks(data[:100], b"x" + data[101:]), length=None)
    with pytest.raises(BadRequest, match="ended after"):
        await receive_blob(tmp_path, digest, _chunks(data[:100]), length=len(data))
    with pytest.raises(PayloadTooLarge):
        await receive_blob(tmp_path, digest, _chunks(data), length=None, limit=100)
    with pytest.raises(InsufficientStorage):
        await receive_blob(tmp_path, digest, _chunks(data), length=len(data), space=lambda _: 1000)
    with pytest.raises(InsufficientStorage):  # no length announced: found while it arrives
        await receive_blob(tmp_path, digest, _chunks(data), length=None, space=lambda _: (64 << 20) + 100)
    assert files(tmp_path) == []
    assert await receive_blob(tmp_path, digest, _chunks(data[:7], data[7:]), length=len(data)) is True
    assert hashlib.sha256(data).hexdigest() == digest[7:] and files(tmp_path) == [f"sha256-{digest[7:]}"]
    assert await receive_blob(tmp_path, digest, _chunks(data), length=len(data)) is False
    assert files(tmp_path) == [f"sha256-{digest[7:]}"]


def test_a_models_messages_come_before_the_requests_after_its_system_prompt() -> None:
    from trioshed.api.protocols.ollama import with_model_system

    preamble = (("user", "Hello"), ("assistant", "Ahoy"))
    asked = {"messages": [{"role": "user", "content": "u"}]}
    assert with_model_system("chat", asked, "S", preamble)["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Ahoy"},
        {"role": "user", "content": "u"},
    ]  # fmt: skip
    own = {"messages": [{"role": "system", "content": "mine"}, {"role": "user", "content": "u"}]}
    assert with_model_system("chat", own, "S", preamble)["messages"][:2] == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Ahoy"}]
    assert with_model_system("chat", asked, "", ()) == asked
    assert with_model_system("generate", {"prompt": "p"}, "", preamble) == {"prompt": "p"}
