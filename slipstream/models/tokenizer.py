"""Tokenizers: local HF / GGUF tokenizers, and a char-level tokenizer built in code for tests."""

from __future__ import annotations

import os
import string
import warnings
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Enough for arithmetic prompts and short English answers; ids stay far below 256.
CHAR_VOCAB = (
    string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=?.,:;!()'\"\n<>_#%"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Char-level tokenizer: <pad>=0 <bos>=1 <eos>=2 <unk>=3, then one id per character."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHAR_VOCAB:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character (newline included) is its own piece; Fuse joins them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_id_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Benchmark tokenizer over a model's whole id range: the text "17 4096 3" is the ids [17, 4096, 3].

    Prompts of random token ids (bench workloads on random-weight presets) then travel through the
    same text -> ids path as real data. Id 0 is "<pad>" (also the unknown token) and the last id
    "<eos>": special tokens must not be digit strings, which would split numbers such as "4096".
    """
    if vocab_size < 3:
        raise ValueError(f"an id tokenizer needs at least 3 ids, got {vocab_size}")
    vocab = {"<pad>": 0, **{str(i): i for i in range(1, vocab_size - 1)}, "<eos>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the pieces with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<pad>", eos_token="<eos>")


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local HF directory or a .gguf file (never touches the network)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if not path.is_dir():
        raise ValueError(f"tokenizer path {path} is neither a directory nor a .gguf file")
    has_hf_files = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if has_hf_files:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return AutoTokenizer.from_pretrained(str(path), gguf_file=ggufs[0].name, local_files_only=True)
    raise ValueError(f"{path} holds no tokenizer files and {len(ggufs)} .gguf files (need exactly one)")


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict], use_chat_template: bool
) -> list[int]:
    """Token ids of a prompt: text (wrapped as one user turn) or chat messages, via the chat template.

    Chat messages (dataset rows like [{"role": "system", ...}, {"role": "user", ...}]) need the
    tokenizer's chat template; text is wrapped in it when asked and available.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, list):
        if not (use_chat_template and has_template):
            raise ValueError(
                "this prompt is a list of chat messages, which needs a tokenizer with a chat template and "
                f"model.use_chat_template=true (now {use_chat_template}, template "
                f"{'present' if has_template else 'absent'})"
            )
        messages = prompt
    elif use_chat_template and has_template:
        messages = [{"role": "user", "content": prompt}]
    else:
        if use_chat_template:
            warnings.warn("use_chat_template=True but the tokenizer has no chat template; encoding plain text")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    # Render to text first: the return type of tokenize=True differs across versions.
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template already writes any BOS it wants; do not add a second one.
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
