"""The router's tokenizer: the class AutoTokenizer builds, loaded without importing torch where it can be."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.router.prompt import load_tokenizer
from tests.support.router_stand_in import build_tokenizer

LOAD = """
import sys
from kvstore.router.prompt import load_tokenizer
tok = load_tokenizer(sys.argv[1])
print(type(tok).__name__, "torch" in sys.modules)
"""


@pytest.fixture(scope="module")
def generic_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("generic"))


def test_a_generic_tokenizer_is_autotokenizers_class_with_the_same_ids(generic_dir):
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(generic_dir), AutoTokenizer.from_pretrained(str(generic_dir), local_files_only=True)
    assert type(ours) is type(auto)
    messages = [{"role": "system", "content": "w1 w2 w3"}, {"role": "user", "content": "w4 w5"}]
    assert ours("w7 w8 w9")["input_ids"] == auto("w7 w8 w9")["input_ids"]
    assert (ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


@pytest.mark.system
def test_a_generic_tokenizer_loads_without_importing_torch(generic_dir):
    pytest.importorskip("torch")  # only where torch is installed can its import be the cost
    out = subprocess.run([sys.executable, "-c", LOAD, str(generic_dir)], capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out == ["TokenizersBackend", "False"]


def test_a_model_specific_class_still_goes_through_autotokenizer(generic_dir, tmp_path):
    import shutil

    other = tmp_path / "specific"
    shutil.copytree(generic_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # a class of its own: AutoTokenizer's registry resolves it
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(other), AutoTokenizer.from_pretrained(str(other), local_files_only=True)
    assert type(ours) is type(auto) and type(ours).__name__ != "TokenizersBackend"
