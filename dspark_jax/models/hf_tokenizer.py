"""A Hugging Face tokenizer for a target: loaded quietly (transformers' PyTorch advisory is
silenced around the one import), checked against the model's vocabulary and chat template."""

from __future__ import annotations

import os
import sys

from dspark_jax import runtime
from dspark_jax.config import TargetConfig
from dspark_jax.errors import CheckpointError


def quiet_transformers():
    """`import transformers` without its advisory "PyTorch was not found" line: we only use its
    tokenizers, never its models. Only that import is quieted; later warnings are untouched."""
    if "transformers" not in sys.modules:
        with runtime.environ_set("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"):
            # here: inside the quieted environment (the advisory is printed at import time)
            import transformers  # noqa: F401
    return sys.modules["transformers"]


def load_tokenizer(
    path: str | os.PathLike,
    cfg: TargetConfig | None = None,
    *,
    require_chat_template: bool = False,
):
    """`transformers.AutoTokenizer` from a directory, offline (no hub access): the one tokenizer
    loader, for HF checkpoints and run directories (train/tokenizer.py's output) alike.

    With `cfg`, checks that every token id the tokenizer can emit (`len(tokenizer)`, including
    added special tokens) indexes a row of the model's embedding; a larger tokenizer raises
    CheckpointError (a smaller one is normal: models pad their vocabulary). With
    `require_chat_template`, a tokenizer without a chat template raises CheckpointError.
    """
    path = os.fspath(path)
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, n)) for n in names):
        raise CheckpointError(
            f"missing files: no tokenizer in {path!r} (expected one of {list(names)}); train one "
            "with train.py --stages tokenizer (dspark_jax.train.tokenizer.train_tokenizer), point "
            "to a Hugging Face model directory, or save one with tokenizer.save_pretrained(path)"
        )
    try:
        tok = quiet_transformers().AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types; report them as one
        raise CheckpointError(f"could not load the tokenizer in {path!r}: {e}") from e
    if require_chat_template and getattr(tok, "chat_template", None) is None:
        raise CheckpointError(
            f"the tokenizer in {path!r} has no chat template; add one to tokenizer_config.json "
            "(chat_template) or chat_template.jinja"
        )
    if cfg is not None:
        check_tokenizer_fits(tok, cfg)
    return tok


def check_tokenizer_fits(tokenizer, cfg: TargetConfig) -> None:
    """CheckpointError if the tokenizer can emit ids >= the model's embedding rows."""
    n = len(tokenizer)
    if n > cfg.vocab_size:
        raise CheckpointError(
            f"tokenizer vocabulary ({n} tokens incl. added ones) is larger than the model's "
            f"embedding rows (vocab_size={cfg.vocab_size}); ids >= {cfg.vocab_size} would index "
            "past the embedding: use the tokenizer that belongs to this checkpoint"
        )
