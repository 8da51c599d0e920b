"""The tokenizer of an exported LLaMA-style model (``node.tools.hf``): ``AutoTokenizer`` and
``AutoModelForCausalLM`` both load the folder and generate text; the byte tokenizer is exact;
a tokenizer larger than the model's vocabulary, or not the one the dataset's manifest names, is
refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from node.compute.model import build_model, get_preset
from node.errors import DataError
from node.tools.hf import TokenizerError, byte_tokenizer, load_tokenizer, write_hf
from node.tools.shards import EOT, prepare, train_bpe

CORPUS = Path(__file__).resolve().parent.parent / "node" / "corpus"
HAMLET = CORPUS / "hamlet_gut.txt"
#: Every kind of character: ASCII controls, Latin-1, the "Ċ" that stands for "\n" inside a
#: byte-level vocabulary, CJK, an emoji (4 UTF-8 bytes), a NUL.
TEXT = "To be, or not\tto be:\nthat is the qüestion — Ċ ÿ 日本語 🙂 \x00 end\n"


def params(name: str) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in build_model(get_preset(name), seed=3).named_parameters()}


@pytest.fixture(scope="module")
def bpe_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder from ``sparseloco data prepare --train-bpe 4096`` (the ``llama_bpe4k`` pair)."""
    out = tmp_path_factory.mktemp("bpe4k")
    prepare([str(HAMLET)], out, train_vocab=4096, shard_tokens=50_000)
    return out


def test_a_bpe_export_loads_with_auto_classes_and_generates_text(
    tmp_path: Path, bpe_dataset: Path
) -> None:
    manifest = json.loads((bpe_dataset / "manifest.json").read_text())
    eot = manifest["tokenizer"]["eot_id"]
    tok = load_tokenizer(bpe_dataset)
    assert (tok.vocab_size, tok.eot_id, tok.eos_token) == (4096, eot, EOT)
    cfg = get_preset("llama_bpe4k")
    write_hf(params("llama_bpe4k"), cfg, tmp_path, {"run_id": "test"}, tok)

    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    assert tokenizer.eos_token == tokenizer.bos_token == EOT
    assert tokenizer.eos_token_id == eot == model.config.eos_token_id
    assert model.generation_config.eos_token_id == eot == model.generation_config.bos_token_id
    assert tokenizer.model_max_length == cfg.ctx_len
    # The ids are the ones the shards were made of.
    prompt = "HAMLET. To be, or not to be"
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(bpe_dataset / "tokenizer.json")).encode(prompt).ids
    inputs = tokenizer(prompt, return_tensors="pt")
    assert inputs.input_ids[0].tolist() == expected
    assert tokenizer.decode(expected) == prompt
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert generated.shape[1] > len(expected) and torch.all(generated < 4096)
    text = tokenizer.decode(generated[0], skip_special_tokens=True)
    assert isinstance(text, str) and text.startswith(prompt) and len(text) > len(prompt)


def test_the_byte_tokenizer_is_exact_and_generates_text(tmp_path: Path) -> None:
    cfg = get_preset("llama_tiny")
    write_hf(params("llama_tiny"), cfg, tmp_path, {}, byte_tokenizer())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 256 and sorted(tokenizer.get_vocab().values()) == list(range(256))
    # Text encodes to its UTF-8 bytes and decodes back, whatever the characters.
    assert tokenizer(TEXT).input_ids == list(TEXT.encode())
    assert tokenizer.decode(list(TEXT.encode())) == TEXT
    for c in [*range(0, 0x800), *range(0x800, 0x30000, 97)]:
        s = chr(c)
        if 0xD800 <= c < 0xE000:  # surrogates are not text
            continue
        ids = tokenizer(s).input_ids
        assert ids == list(s.encode()) and tokenizer.decode(ids) == s, hex(c)
    # Id b is byte b: the ASCII ones decode alone, and any byte string round-trips as UTF-8 does.
    assert [tokenizer.decode([b]) for b in range(128)] == [chr(b) for b in range(128)]
    raw = bytes(range(256))
    assert tokenizer.decode(list(raw)) == raw.decode("utf-8", errors="replace")
    # "\n" ends a document (the byte datasets' end-of-text) and stays an ordinary character.
    model = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    assert model.config.eos_token_id == model.generation_config.eos_token_id == 10
    assert tokenizer.eos_token is None and tokenizer.model_max_length == cfg.ctx_len
    inputs = tokenizer("To be, or", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    text = tokenizer.decode(generated[0])
    assert isinstance(text, str) and text.startswith("To be, or")


def test_a_bytes_dataset_folder_gives_the_byte_tokenizer(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("to be or not to be\n" * 20)
    prepare([str(src)], tmp_path / "out", shard_tokens=100)
    assert load_tokenizer(tmp_path / "out") == byte_tokenizer()


def test_a_tokenizer_larger_than_the_model_is_refused_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    train_bpe([HAMLET], "text", 512).save(str(path))
    out = tmp_path / "model"
    message = r"512 entries, more than the model's vocabulary of 256"
    with pytest.raises(TokenizerError, match=message) as caught:
        write_hf(params("llama_tiny"), get_preset("llama_tiny"), out, {}, load_tokenizer(path))
    assert isinstance(caught.value, DataError)
    assert not out.exists()


def test_a_tokenizer_that_is_not_the_datasets_is_refused(tmp_path: Path, bpe_dataset: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("manifest.json", "tokenizer.json"):
        (folder / name).write_bytes((bpe_dataset / name).read_bytes())
    other = tmp_path / "other.json"
    train_bpe([CORPUS / "macbeth_gut.txt"], "text", 4096).save(str(other))
    (folder / "tokenizer.json").write_bytes(other.read_bytes())
    with pytest.raises(TokenizerError, match=r"sha256 \w+, the dataset's manifest says"):
        load_tokenizer(folder)
    # The file on its own is a usable tokenizer: only the manifest's word is checked.
    assert load_tokenizer(other).vocab_size == 4096


def test_a_file_that_is_no_tokenizer_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerError, match=r"not a tokenizers tokenizer\.json"):
        load_tokenizer(bad)
    with pytest.raises(TokenizerError, match="cannot read"):
        load_tokenizer(tmp_path / "missing.json")
