"""Fixtures for the slime plugin: ``fake_sglang``, a fake SGLang ``/generate`` server on 127.0.0.1. The
stand-in ``Sample``, the byte tokenizer, slime-like ``args`` and the server itself are the shared
harness in weenv/testing/_slime.py, re-exported here for the tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from weenv.testing import ByteTokenizer, FakeSGLang, LegacySample, Reply, Sample, byte_tokenizer, sampling_params
from weenv.testing import slime_args, train_side_checks, turns


@pytest.fixture
def fake_sglang() -> Iterator[FakeSGLang]:
    server = FakeSGLang()
    try:
        yield server
    finally:
        server.close()


__all__ = ["ByteTokenizer", "FakeSGLang", "LegacySample", "Reply", "Sample", "byte_tokenizer", "fake_sglang",
           "sampling_params", "slime_args", "train_side_checks", "turns"]
