"""Fuzz every documented operation with schemathesis against ``/openapi.json`` of a real
``python -m trioshed serve``: no 5xx, responses as documented (schema, content type, status).

Quick profile here (3 examples per operation, seed 1, ~10 s); ``make fuzz`` runs the same with
``TRIOSHED_FUZZ_EXAMPLES`` (100 there) and a random seed. The routes that write the store
(``/api/push``, ``/api/create``, ``/api/blobs``, ``/api/pull``) are left out: pull and push
would reach out to the internet, and their bad input is tested against loopback stand-ins in
``test_pull*.py`` and ``test_create*.py``; so is ``/api/events``, a stream that never ends.
The server has no API key, so ``/api/keys`` answers 403 (documented) and makes no key: a key
made there would turn every later request into a 401.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import trio

from tests.support.serve_process import serve_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance,status_code_conformance"
# /api/events never ends (the status page's stream): a request to it would only time out
UNSERVED = r"^/api/(blobs|create|pull|push|events)"


async def test_schemathesis_finds_no_server_error_and_no_schema_violation(model_store: Path, tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st is not None, "schemathesis is a test dependency: pip install -e '.[test]'"
    examples = os.environ.get("TRIOSHED_FUZZ_EXAMPLES", "3")
    seed = ["--seed", "1"] if "TRIOSHED_FUZZ_EXAMPLES" not in os.environ else []
    report = tmp_path / "fuzz.log"
    with trio.fail_after(int(examples) * 60 + 120):
        async with serve_process(model_store, TRIOSHED_MAX_LOADED_MODELS="1", TRIOSHED_CONTEXT_LENGTH="512") as served:
            with open(report, "wb") as out:  # noqa: ASYNC230 - a local file, opened once
                done = await trio.run_process(
                    [st, "run", f"{served.url}/openapi.json", "--checks", CHECKS, "-n", examples, *seed,
                     "--exclude-path-regex", UNSERVED, "--generation-database", "none", "--request-timeout", "60", "--max-failures", "50"],
                    stdout=out, stderr=out, check=False, cwd=tmp_path,  # its crash cache stays out of the tree
                )  # fmt: skip
            text = report.read_text(errors="replace")
            print(text[-3000:])
            assert done.returncode == 0, text[-6000:]
            counts = re.search(r"(\d+) generated, (\d+) passed", text)
            assert counts and counts.group(1) == counts.group(2) and int(counts.group(1)) > 500, text[-2000:]
            assert served.process.poll() is None  # still serving after it all
