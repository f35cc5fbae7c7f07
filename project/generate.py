"""Continue a prompt with a trained model, to see what it learned.

    python -m project.generate ckpt_path=PATH [prompt=TEXT] [max_new_tokens=200] [temperature=0.8] [top_k=50]
                               [seed=1234] [stop_at_eos=true] [tokenizer=PATH]

Loads any checkpoint the platform writes (a .ckpt file, or the sharded folder of fsdp, fsdp2, tp, tp_fsdp or
pipeline) whole, on the CPU; takes the tokenizer as project.hf.export does (the one the checkpoint carries, or
`tokenizer=`; for an older checkpoint, the one in the manifest.json of the data directory it names, refused where
its vocabulary is not the checkpoint's); prints the prompt followed by its continuation. temperature=0 is
greedy decoding; otherwise each token is drawn from the `top_k` most likely (top_k=0: from all) by a generator
seeded with `seed`, so the same command prints the same text. Generation stops after max_new_tokens, when prompt
and continuation fill model.max_seq_len, or (stop_at_eos=true) when the model ends the document; a note on
stderr says which of the last two it was. An empty prompt gives an unconditional sample.

`generate(model, prompt_ids, ...)` is the library function beneath, for a `Llama` and token ids. It keeps a KV
cache, so each new token costs one position's forward pass, not the whole sequence's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from project.model.families import build_model
from project.model.llama import KVCache, Llama
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError, exit_on_config_error

DEFAULTS = {
    "ckpt_path": "", "prompt": "", "max_new_tokens": "200", "temperature": "0.8", "top_k": "50", "seed": "1234",
    "stop_at_eos": "true", "tokenizer": "",
}  # fmt: skip
USAGE = (
    "usage: python -m project.generate ckpt_path=PATH [prompt=TEXT] [max_new_tokens=200] [temperature=0.8] "
    "[top_k=50] [seed=1234] [stop_at_eos=true] [tokenizer=PATH]"
)


@dataclass
class Generation:
    tokens: list[int]  # the new tokens, without the EOS that stopped them
    stop: str  # why generation stopped: "max_new_tokens", "max_seq_len" or "eos"


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> int:
    """The next token from one position's logits [vocab]: the most likely at temperature 0, else a sample
    from softmax(logits / temperature) over the `top_k` most likely (None or 0: all)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k:
        kth_largest = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
) -> Generation:
    """Continue `prompt_ids` (at least one token) by up to `max_new_tokens`, stopping early where prompt and
    continuation reach model.config.max_seq_len tokens, or at `eos_id` if given.

    `generator` (on the model's device) makes sampling reproducible; `vocab_size` restricts the choice to the
    tokenizer's ids, where the model's embedding table is larger (padded).
    """
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token to condition on.")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy).")
    steps = max(0, min(max_new_tokens, model.config.max_seq_len - len(prompt_ids)))
    weight = model.tok_embeddings.weight
    # The last sampled token is never fed back, hence the - 1.
    cache = KVCache(model.config, 1, len(prompt_ids) + max(steps - 1, 0), weight.device, weight.dtype)
    tokens = torch.tensor([prompt_ids], device=weight.device)
    new: list[int] = []
    for _ in range(steps):
        logits = model(tokens, cache=cache)[0, -1, :vocab_size]
        token = next_token(logits, temperature, top_k, generator)
        if token == eos_id:
            return Generation(new, "eos")
        new.append(token)
        tokens = torch.tensor([[token]], device=weight.device)
    return Generation(new, "max_new_tokens" if steps == max_new_tokens else "max_seq_len")


def parse_args(argv: list[str]) -> dict:
    """The arguments with their types, checked before any checkpoint is read."""
    raw = parse_key_values(argv, DEFAULTS, doc=__doc__, usage=USAGE)
    if not raw["ckpt_path"]:
        raise ConfigError(
            "ckpt_path= is required: a checkpoint file or sharded folder, e.g. "
            f"outputs/runs/<run>/checkpoints/last.ckpt.\n{USAGE}"
        )
    args: dict = {"ckpt_path": raw["ckpt_path"], "prompt": raw["prompt"], "tokenizer": raw["tokenizer"] or None}
    numbers = (("max_new_tokens", int, 0), ("top_k", int, 0), ("seed", int, None), ("temperature", float, 0.0))
    for key, kind, minimum in numbers:
        try:
            args[key] = kind(raw[key])
        except ValueError:
            raise ConfigError(f"{key}={raw[key]} is not {'an integer' if kind is int else 'a number'}.") from None
        if minimum is not None and args[key] < minimum:
            greedy = " (0: greedy)" if key == "temperature" else ""
            raise ConfigError(f"{key}={raw[key]} must be at least {minimum}{greedy}.")
    if raw["stop_at_eos"].lower() not in ("true", "false"):
        raise ConfigError(f"stop_at_eos={raw['stop_at_eos']} must be true or false.")
    args["stop_at_eos"] = raw["stop_at_eos"].lower() == "true"
    # Said before `load` imports Lightning (one in object storage is looked for as it is read).
    if "://" not in args["ckpt_path"] and not Path(args["ckpt_path"]).exists():
        raise ConfigError(
            f"checkpoint {args['ckpt_path']} does not exist; pass ckpt_path= a .ckpt file or sharded checkpoint folder."
        )
    return args


def load(ckpt_path: str, tokenizer: str | None):
    """(the plain Llama in eval mode, its tokenizer, whether it was trained with document_mask)."""
    # Imported here, after the arguments are checked: project.hf.export imports Lightning, which takes seconds.
    from project.data.tokenizer import load_tokenizer
    from project.hf.export import checkpoint_tokenizer, load_checkpoint

    config, weights, ckpt = load_checkpoint(ckpt_path)
    state_dict = weights.read(list(weights.shapes))  # the whole model: generation runs it on this process
    with checkpoint_tokenizer(ckpt, tokenizer, f"ckpt_path={ckpt_path}") as (tokenizer_path, _, _):
        if tokenizer_path.suffix not in (".json", ".model"):
            raise ConfigError(
                f"tokenizer {tokenizer_path} is neither a HF tokenizer.json (.json) nor a sentencepiece .model."
            )
        tok = load_tokenizer(tokenizer_path)  # read whole: the file may be a temporary copy of the checkpoint's
    document_mask = bool(ckpt["hyper_parameters"].get("document_mask"))
    del ckpt  # optimizer state can be twice the weights
    if tok.vocab_size > config.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_path} has {tok.vocab_size} tokens but the model only {config.vocab_size} "
            "embeddings: is it the tokenizer this model was trained with?"
        )
    model = build_model(config)
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        raise ConfigError(f"the weights in {ckpt_path} do not fit its own model config: {e}") from None
    return model.eval(), tok, document_mask


@exit_on_config_error()
def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    model, tokenizer, document_mask = load(args["ckpt_path"], args["tokenizer"])
    body = tokenizer.encode(args["prompt"])
    # In the shards every document follows the previous one's EOS: a leading EOS makes the prompt the start of a
    # document, and gives an empty prompt something to condition on. A model trained with document_mask never
    # attended across an EOS, so it gets one only for an empty prompt.
    prompt_ids = body if document_mask and body else [tokenizer.eos_id, *body]
    limit = model.config.max_seq_len
    if len(prompt_ids) >= limit:
        raise ConfigError(
            f"the prompt is {len(prompt_ids)} tokens, but the model reads at most model.max_seq_len={limit}: "
            "shorten it to leave room for a continuation."
        )
    result = generate(
        model,
        prompt_ids,
        args["max_new_tokens"],
        temperature=args["temperature"],
        top_k=args["top_k"],
        generator=torch.Generator().manual_seed(args["seed"]),
        eos_id=tokenizer.eos_id if args["stop_at_eos"] else None,
        vocab_size=tokenizer.vocab_size,
    )
    # Decoded together, not prompt + decode(new): a sentencepiece continuation would lose its leading space.
    print(tokenizer.decode(body + result.tokens), flush=True)
    n = len(result.tokens)
    if result.stop == "max_seq_len":
        print(f"note: stopped after {n} new tokens: prompt and continuation reached model.max_seq_len={limit}.",
              file=sys.stderr)  # fmt: skip
    elif result.stop == "eos":
        print(
            f"note: the model ended the document after {n} new tokens (stop_at_eos=false continues).", file=sys.stderr
        )


if __name__ == "__main__":
    main()
