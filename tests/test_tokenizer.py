"""project.data.tokenizer: trained byte-level BPE, HF tokenizer.json and sentencepiece .model files."""

import random

import pytest
import sentencepiece
import tokenizers

from project.data.tokenizer import BOS_TOKEN, EOS_TOKEN, load_tokenizer, train_bpe
from project.runtime.errors import ConfigError

WORDS = "thou art more lovely and more temperate rough winds do shake the darling buds of may".split()
SAMPLE = "Shall I compare thee to a summer's day?\n  Naïve café — 日本語, tabs\tand 123!"


def texts(count: int = 6, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(100)) for _ in range(count)]


def test_trained_bpe_round_trips_any_text_without_special_tokens(tmp_path):
    tok = train_bpe(texts(), 400, tmp_path)
    vocab = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab(with_added_tokens=True)
    assert (tok.kind, tok.path) == ("hf", tmp_path / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id) == (vocab[BOS_TOKEN], vocab[EOS_TOKEN])
    assert tok.vocab_size == len(vocab) == max(vocab.values()) + 1
    assert 258 < tok.vocab_size <= 400
    # Merges learned from the corpus make its words shorter than their bytes.
    assert len(tok.encode("thou art more lovely")) < len("thou art more lovely")
    for text in (SAMPLE, f"raw text naming {EOS_TOKEN} is only text"):
        ids = tok.encode(text)
        assert tok.eos_id not in ids and tok.bos_id not in ids
        assert tok.decode(ids) == text


def test_train_bpe_gives_the_same_tokenizer_for_the_same_texts(tmp_path):
    first = train_bpe(texts(), 400, tmp_path / "a")
    second = train_bpe(texts(), 400, tmp_path / "b")
    assert first.path.read_bytes() == second.path.read_bytes()
    assert train_bpe(texts(seed=1), 400, tmp_path / "c").path.read_bytes() != first.path.read_bytes()


def test_train_bpe_refuses_a_vocabulary_without_room_for_all_bytes(tmp_path):
    with pytest.raises(ConfigError, match=r"data.vocab_size=257 .* at least 258"):
        train_bpe(texts(), 257, tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()


def test_loads_a_hf_tokenizer_json_with_its_own_special_token_names(tmp_path):
    # A word-level tokenizer with Llama-2-style names, built without project code.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(sorted(set(WORDS)))}}
    rust = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    rust.add_special_tokens(["<s>", "</s>"])
    path = tmp_path / "downloaded.json"
    rust.save(str(path))

    tok = load_tokenizer(path)
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id) == ("hf", len(vocab), 1, 2)
    assert tok.encode("thou art lovely") == [vocab["thou"], vocab["art"], vocab["lovely"]]
    saved = tok.save(tmp_path / "out")
    assert saved == tmp_path / "out" / "tokenizer.json" and saved.read_bytes() == path.read_bytes()


def test_a_hf_tokenizer_without_end_of_text_is_refused(tmp_path):
    rust = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    rust.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="no end-of-text token"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_loads_a_sentencepiece_model(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(texts(count=2)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=60,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    reference = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))

    tok = load_tokenizer(tmp_path / "sp.model")
    assert (tok.kind, tok.vocab_size) == ("sentencepiece", 60)
    assert (tok.bos_id, tok.eos_id) == (reference.bos_id(), reference.eos_id()) == (1, 2)
    text = "thou art more temperate"
    assert tok.encode(text) == reference.encode(text) and tok.eos_id not in tok.encode(text)
    assert tok.decode(tok.encode(text)) == text
    saved = tok.save(tmp_path / "out")
    assert saved.name == "tokenizer.model" and saved.read_bytes() == (tmp_path / "sp.model").read_bytes()


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.json", None, "is not a file"),
        ("vocab.txt", "a b c", "unknown suffix"),
        ("broken.json", "{not json", "could not be read as a HF tokenizer.json"),
        ("broken.model", "not a protobuf", "could not be read as a sentencepiece model"),
    ],
)
def test_bad_tokenizer_paths_name_the_setting(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=message) as error:
        load_tokenizer(tmp_path / name)
    assert "data.tokenizer=" in str(error.value) and "\n" not in str(error.value)
