"""Parse the buffer sizes llama-server reports in its verbose (``-v``) log into ``MeasuredMemory``.

llama.cpp prints what it allocated, per buffer, while it loads (verbose only):

    load_tensors:   CPU_Mapped model buffer size =   235.16 MiB
    llama_kv_cache:        CPU KV buffer size =    30.00 MiB
    llama_kv_cache: size =   30.00 MiB (  1024 cells,  15 layers,  2/2 seqs), K (f16):   15.00 MiB, V (f16):   15.00 MiB
    llama_context:        CPU  output buffer size =     1.00 MiB
    sched_reserve:        CPU compute buffer size =    20.77 MiB

Models with sliding-window attention (gemma3) have two KV caches, each with its own lines: their
sizes add up. The compute line can repeat when the graph is reserved again: the last report per
backend wins. The ``memory breakdown`` table at exit is in whole MiB and adds nothing the lines
above lack, so it is only used as a fallback for the model size.

A multimodal projector (``--mmproj``) is loaded by llama.cpp's ``clip`` code after the model and
reports its own lines, which must not replace the model's (the same ``CPU compute buffer`` words):

    clip_ctx: CLIP using CPU backend
    load_hparams: model size:         0.09 MiB
    reserve_compute_meta:        CPU compute buffer size =     0.04 MiB

Its weights (``model size``, on the backend it names) and compute buffers are kept apart, per
projector context (a model that sees and hears loads two), in ``projector`` and
``projector_compute``.

Each LoRA adapter (``--lora``) reports its tensors' buffers, one line per buffer type (the
buffer of the base layer each tensor adapts), summed per buffer name in ``adapters``:

    llama_adapter_lora_init_impl: CPU_Mapped LoRA buffer size =     0.01 MiB

A draft model (``--model-draft``) is loaded after the target and reports the same lines after
``loading draft model``: its buffers are added to the target's (its output and compute buffers
kept apart first, so that neither model's last report replaces the other's).

Lines may carry a timestamp/level prefix; the patterns are searched, not anchored. The parser is
incremental so that the runner can feed each stderr line as it arrives. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from trioshed.core.model import MeasuredMemory

__all__ = ["MemoryLogParser", "parse_memory_log"]

_MIB = 1024 * 1024

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_MODEL = re.compile(r"\b(\S+) model buffer size = +" + _NUM + r" MiB")
_KV_BUFFER = re.compile(r"\b(\S+) KV buffer size = +" + _NUM + r" MiB")
_RS_BUFFER = re.compile(r"\b(\S+) RS buffer size = +" + _NUM + r" MiB")
_KV_SUMMARY = re.compile(
    r"llama_kv_cache: size = +"
    + _NUM
    + r" MiB \(.*?\), K \((\w+)\): +"
    + _NUM
    + r" MiB, V \((\w+)\): +"
    + _NUM
    + r" MiB"
)
_OUTPUT = re.compile(r"\b(\S+) +output buffer size = +" + _NUM + r" MiB")
_COMPUTE = re.compile(r"\b(\S+) compute buffer size = +" + _NUM + r" MiB")
_LORA = re.compile(r"\b(\S+) LoRA buffer size = +" + _NUM + r" MiB")
_CLIP_BACKEND = re.compile(r"CLIP using (\S+) backend")
_CLIP_WEIGHTS = re.compile(r"load_hparams: model size: +" + _NUM + r" MiB")
# "| - CUDA0 (desc) | total = free + (self = model + context + compute) + unaccounted |"
_BREAKDOWN_GPU = re.compile(
    r"\|\s*- (.+?)\s*\|\s*\d+\s*=\s*\d+\s*\+\s*\(\s*\d+\s*=\s*(\d+)\s*\+\s*\d+\s*\+\s*\d+\s*\)"
)
# "| - Host | self = model + context + compute |"
_BREAKDOWN_OTHER = re.compile(r"\|\s*- (.+?)\s*\|\s*\d+\s*=\s*(\d+)\s*\+\s*\d+\s*\+\s*\d+")


def _mib(text: str) -> int:
    """``"235.16"`` MiB as bytes (llama.cpp rounds to 0.01 MiB, so this is within 5 KiB)."""
    return round(float(text) * _MIB)


class MemoryLogParser:
    """Feed llama-server's log lines one at a time; ``result()`` is what has been reported so far."""

    def __init__(self) -> None:
        self._model: dict[str, int] = {}
        self._kv_buffers: dict[str, int] = {}
        self._kv_total = 0
        self._kv_k = 0
        self._kv_v = 0
        self._kv_caches = 0
        self._rs = 0
        self._output: dict[str, int] = {}
        self._compute: dict[str, int] = {}
        self._breakdown_model: dict[str, int] = {}
        self._adapters: dict[str, int] = {}  # LoRA buffers, summed over the adapters
        self.kv_types: tuple[str, str] | None = None
        #: Output and compute buffers of the model now loading: the target's, then a draft's.
        self._phases: list[tuple[dict[str, int], dict[str, int]]] = [(self._output, self._compute)]
        #: Per projector context: its backend, its weights and its compute buffers by backend.
        self._clips: list[tuple[str, dict[str, int], dict[str, int]]] = []

    def feed(self, line: str) -> None:
        """Take one log line (with or without its newline); unrelated lines are ignored cheaply."""
        if "loading draft model" in line:
            self._output, self._compute = {}, {}
            self._phases.append((self._output, self._compute))
            return
        if "CLIP using" in line and (m := _CLIP_BACKEND.search(line)):
            self._clips.append((m[1], {}, {}))
            return
        if "size" not in line and "|" not in line:
            return
        if self._clips and ("load_hparams" in line or "reserve_compute_meta" in line):
            backend, weights, compute = self._clips[-1]
            if m := _CLIP_WEIGHTS.search(line):
                weights[backend] = _mib(m[1])
            elif m := _COMPUTE.search(line):
                compute[m[1]] = _mib(m[2])
            return
        if "buffer size" in line:
            if m := _MODEL.search(line):
                self._model[m[1]] = self._model.get(m[1], 0) + _mib(m[2])
            elif m := _KV_BUFFER.search(line):
                self._kv_buffers[m[1]] = self._kv_buffers.get(m[1], 0) + _mib(m[2])
            elif m := _RS_BUFFER.search(line):
                self._rs += _mib(m[2])
            elif m := _OUTPUT.search(line):
                self._output[m[1]] = _mib(m[2])
            elif m := _COMPUTE.search(line):
                self._compute[m[1]] = _mib(m[2])
            elif m := _LORA.search(line):
                self._adapters[m[1]] = self._adapters.get(m[1], 0) + _mib(m[2])
        elif m := _KV_SUMMARY.search(line):
            self._kv_total += _mib(m[1])
            self._kv_k += _mib(m[3])
            self._kv_v += _mib(m[5])
            self._kv_caches += 1
            self.kv_types = (m[2], m[4])
        elif "|" in line and "memory breakdown" not in line:
            if m := (_BREAKDOWN_GPU.search(line) or _BREAKDOWN_OTHER.search(line)):
                self._breakdown_model[m[1]] = int(m[2]) * _MIB

    def _summed(self, which: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for phase in self._phases:
            for name, n in phase[which].items():
                out[name] = out.get(name, 0) + n
        return out

    @property
    def output_buffers(self) -> dict[str, int]:
        """The logits/embeddings output buffers (``output buffer size``), by backend."""
        return self._summed(0)

    @property
    def kv_caches(self) -> int:
        """How many KV caches reported a size (2 for sliding-window models such as gemma3)."""
        return self._kv_caches

    def result(self) -> MeasuredMemory | None:
        """The sizes seen so far, or None before llama.cpp reported any model buffer."""
        model = self._model or self._breakdown_model
        if not model:
            return None
        kv = self._kv_total or sum(self._kv_buffers.values())
        return MeasuredMemory(
            model=dict(model),
            kv=kv + self._rs,
            kv_k=self._kv_k,
            kv_v=self._kv_v,
            compute=self._summed(1),
            output=self._summed(0),
            kv_buffers=dict(self._kv_buffers),
            projector=_sum_by_name(w for _, w, _ in self._clips),
            projector_compute=_sum_by_name(c for _, _, c in self._clips),
            adapters=dict(self._adapters),
        )


def _sum_by_name(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for name, n in part.items():
            out[name] = out.get(name, 0) + n
    return out


def parse_memory_log(text: str) -> MeasuredMemory | None:
    """Parse a whole log at once (tests, post-mortems)."""
    parser = MemoryLogParser()
    for line in text.splitlines():
        parser.feed(line)
    return parser.result()
