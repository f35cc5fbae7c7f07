"""An export in programs nobody here wrote: transformers' tokenizer and generate, lm-evaluation-harness.

In the shards every document follows the end-of-text token that ends the one before, and project.generate puts
one before a prompt; a model trained with document_mask never attended across one, and gets none. The export
must make the other programs do the same by default. The references are the tokenizer files read directly,
project.generate, and our model's log-probabilities computed here. llama.cpp cannot run here: what its
converter reads from the folder is checked (docs/published-models.md shows its commands).
"""

import json

import pytest
import torch

from project.generate import generate
from project.generate import main as generate_main
from project.hf.export import main as export_main
from tests.test_export import (
    SAMPLE,
    tiny_config,
    train_byte_level_bpe,
    train_llama_style_sentencepiece,
    write_checkpoint,
)

transformers = pytest.importorskip("transformers")

PROMPT = "To be, or not"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def llama3_style_bpe(path):
    """The byte-level BPE with the post-processor of Llama 3's tokenizer.json, which puts <|begin_of_text|>
    first: a token the shards never have. Returns (bos_id, eos_id)."""
    from tokenizers import Tokenizer, processors

    bos_id, eos_id = train_byte_level_bpe(path)
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                special_tokens=[("<|begin_of_text|>", bos_id)],
            ),
        ]
    )
    tokenizer.save(str(path))
    return bos_id, eos_id


def export_with(tmp_path, tokenizer: str, document_mask: bool = False, **config):
    """Export a checkpoint trained (as far as its files say) with `tokenizer`: (folder, our ids of a text, eos id)."""
    data = tmp_path / "data"
    data.mkdir()
    if tokenizer == "sentencepiece":
        pytest.importorskip("google.protobuf", reason="transformers needs protobuf to read a sentencepiece model")
        import sentencepiece as spm

        train_llama_style_sentencepiece(data / "tokenizer.model", tmp_path)
        sp = spm.SentencePieceProcessor(model_file=str(data / "tokenizer.model"))
        file, bos_id, eos_id = "tokenizer.model", sp.bos_id(), sp.eos_id()

        def encode(text):
            return sp.encode(text)
    else:
        from tokenizers import Tokenizer

        train = llama3_style_bpe if tokenizer == "bpe-llama3" else train_byte_level_bpe
        bos_id, eos_id = train(data / "tokenizer.json")
        file = "tokenizer.json"
        ours = Tokenizer.from_file(str(data / file))

        def encode(text):
            return ours.encode(text, add_special_tokens=False).ids

    ckpt_path, model = write_checkpoint(tmp_path, tiny_config(**config), file, bos_id, eos_id)
    if document_mask:
        ckpt = torch.load(ckpt_path, weights_only=False)
        ckpt["hyper_parameters"]["document_mask"] = True
        torch.save(ckpt, ckpt_path)
    export_main([f"ckpt_path={ckpt_path}", f"output_dir={tmp_path / 'hf'}"])
    return tmp_path / "hf", encode, eos_id, ckpt_path, model


@pytest.mark.parametrize(
    ("tokenizer", "document_mask"),
    [("bpe", False), ("bpe-llama3", False), ("sentencepiece", False), ("bpe", True), ("sentencepiece", True)],
    ids=["bpe", "bpe-with-llama3-template", "sentencepiece", "bpe-document-mask", "sentencepiece-document-mask"],
)
def test_transformers_tokenizer_of_an_export_puts_what_the_model_saw_before_each_document(
    tmp_path, tokenizer, document_mask
):
    out, encode, eos_id, _, _ = export_with(tmp_path, tokenizer, document_mask)

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)

    before = [] if document_mask else [eos_id]
    assert hf_tokenizer(SAMPLE)["input_ids"] == [*before, *encode(SAMPLE)]
    assert hf_tokenizer(SAMPLE, add_special_tokens=False)["input_ids"] == encode(SAMPLE)
    # The first token of an unconditional sample, and lm-evaluation-harness's prefix for a text without context.
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (eos_id, eos_id)
    assert transformers.GenerationConfig.from_pretrained(out).bos_token_id == eos_id


@pytest.mark.parametrize("tokenizer", ["bpe", "sentencepiece"])
def test_an_export_says_to_llama_cpp_that_every_text_starts_with_the_end_of_text_token(tmp_path, tokenizer):
    """What llama.cpp's convert_hf_to_gguf.py reads (gguf-py's SpecialVocab): add_bos_token from
    tokenizer_config.json, the BOS id from config.json (tokenizer.model) or the token tokenizer_config.json names
    (tokenizer.json, whose post-processor's template it also reads)."""
    out, _, eos_id, _, _ = export_with(tmp_path, tokenizer)

    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is True and tokenizer_config["add_eos_token"] is False
    assert tokenizer_config["bos_token"] == tokenizer_config["eos_token"]
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == eos_id
    if tokenizer == "bpe":
        post_processor = json.loads((out / "tokenizer.json").read_text())["post_processor"]
        first = post_processor["single"][0]["SpecialToken"]["id"]
        assert first == tokenizer_config["eos_token"] and post_processor["special_tokens"][first]["ids"] == [eos_id]


def test_transformers_greedy_generation_from_an_export_gives_the_tokens_of_project_generate(tmp_path, capsys):
    from project.data.tokenizer import load_tokenizer

    # A larger init than training's so that greedy has no near-ties; 320 embeddings for the tokenizer's 300 ids,
    # padded as training may pad them: project.generate never picks a padding id, and transformers must not either.
    out, encode, eos_id, ckpt_path, ours = export_with(tmp_path, "bpe", init_std=0.2)
    capsys.readouterr()  # the export's report
    generate_main([f"ckpt_path={ckpt_path}", f"prompt={PROMPT}", "max_new_tokens=24", "temperature=0"])
    printed = capsys.readouterr().out

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    inputs = hf_tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        output = hf.generate(**inputs, max_new_tokens=24, do_sample=False)
    new = output[0, inputs["input_ids"].shape[1] :].tolist()
    new = new[:-1] if new[-1] == eos_id else new  # transformers keeps the token that stopped it; we do not print it

    tokenizer = load_tokenizer(tmp_path / "data" / "tokenizer.json")
    body = encode(PROMPT)
    expected = generate(ours, [eos_id, *body], 24, temperature=0, eos_id=eos_id, vocab_size=tokenizer.vocab_size)
    assert new == expected.tokens
    assert printed == tokenizer.decode(body + new) + "\n"


def log_probability(model, tokens: list[int], scored_from: int) -> float:
    """Sum of log p(token | the tokens before it) over tokens[scored_from:], by our model."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0].double()
    log_probs = torch.log_softmax(logits, dim=-1)
    return sum(float(log_probs[i - 1, tokens[i]]) for i in range(scored_from, len(tokens)))


def test_lm_evaluation_harness_scores_an_export_as_our_model_does(tmp_path):
    # lm_eval and accelerate lie beside the environment, as transformers does (Makefile)
    huggingface = pytest.importorskip("lm_eval.models.huggingface", exc_type=ImportError)
    from lm_eval.api.instance import Instance

    out, encode, eos_id, _, ours = export_with(tmp_path, "bpe")
    context, continuation = "To be, or not to be:", " that is the question."

    lm = huggingface.HFLM(pretrained=str(out), device="cpu", batch_size=1)
    requests = [
        Instance("loglikelihood", {}, ("", SAMPLE), 0),  # a whole document, after lm_eval's prefix token
        Instance("loglikelihood", {}, (context, continuation), 1),  # a continuation of a context (multiple choice)
    ]
    scores = [score for score, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    # Perplexity tasks (loglikelihood_rolling) put the prefix token first themselves: with the tokenizer's too, the
    # document would start with two; add_bos_token=False leaves the one (docs/published-models.md says so).
    rolling = huggingface.HFLM(pretrained=str(out), device="cpu", batch_size=1, add_bos_token=False)
    [document] = rolling.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (SAMPLE,), 0)], True)

    whole = [eos_id, *encode(SAMPLE)]
    pair = [eos_id, *encode(context + continuation)]
    expected = [log_probability(ours, whole, 1), log_probability(ours, pair, 1 + len(encode(context)))]
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(document, expected[0], atol=1e-4, rtol=1e-5)
