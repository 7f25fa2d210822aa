"""Prompt-embedding cache: encode each distinct prompt once, in memory and optionally on disk.

Keys combine a model fingerprint (the adapter's model id, its text encoders' configs and weights,
and its tokenizers' vocabularies) with a SHA-256 of the prompt, so a cache folder can be shared across runs
of the same model and is never reused for another one. Files are safetensors, one per prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from ..console import stderr_line
from ..models.adapter import Cond, ModelAdapter
from ..rewards.weights import safetensors_damage


def _tokenizer_identity(tokenizer: object) -> str:
    """Class, size and a hash of the vocabulary: a changed tokenizer changes every embedding."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    return f"{type(tokenizer).__name__}:{len(vocab)}:{digest}"


def model_fingerprint(model: ModelAdapter) -> str:
    """Short hash of what the embeddings depend on.

    That is the model id, each text encoder's config and weights (a checksum), and each tokenizer's
    vocabulary.
    """
    pipe = model.pipe
    parts = {"model": model.model_id, "max_len": model.max_sequence_length}
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):  # optional pipeline components
        encoder = getattr(pipe, name, None)
        if encoder is not None:
            parts[name] = encoder.config.to_json_string(use_diff=False)
            parts[name + "_weights"] = float(sum(p.double().sum() for p in encoder.parameters()))
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        tokenizer = getattr(pipe, name, None)
        if tokenizer is not None:
            parts[name] = _tokenizer_identity(tokenizer)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class PromptCache:
    """Caches ``model.encode_prompt`` per distinct prompt.

    Args:
        model: the model adapter whose encoders produce the embeddings.
        directory: optional folder for a persistent cache (``<dir>/<fingerprint>/<sha>.safetensors``).

    Attributes:
        hits: prompts served from the cache (memory or disk).
        misses: prompts encoded by the model.
    """

    def __init__(self, model: ModelAdapter, directory: str | Path | None = None):
        self.model = model
        self.fingerprint = model_fingerprint(model)
        self.directory = Path(directory) / self.fingerprint if directory else None
        self.memory: dict[str, Cond] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(prompt: str) -> str:
        """The cache key of a prompt: the hex SHA-256 of its UTF-8 text."""
        return hashlib.sha256(prompt.encode("utf-8")).hexdigest()

    def _load(self, key: str) -> Cond | None:
        """The stored conditioning of ``key``; None when it is not on disk or its file is damaged.

        A damaged file (truncated, garbled) is a miss, said in one warning line: the prompt is encoded
        again and the file rewritten, so a bad cache entry never stops a run.
        """
        path = self.directory / f"{key}.safetensors" if self.directory else None
        if path is None or not path.is_file():
            return None
        if (reason := safetensors_damage(path)) is not None:
            stderr_line(f"flowrl: warning: prompt cache file {path} is damaged ({reason}); encoding its prompt again")
            return None
        return load_file(str(path))

    def _store(self, key: str, cond: Cond) -> None:
        """Keep ``cond`` in memory and, with a folder, write it there atomically.

        Several writers may store the same prompt at once (the ranks of a launch sharing
        ``prompts.cache_dir``), so each writes its own temporary file before the atomic rename: the
        last rename wins and a reader only ever sees a whole file.
        """
        self.memory[key] = cond
        if self.directory:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f"{key}.", suffix=".tmp", dir=self.directory)
            os.close(fd)
            tmp = Path(name)
            try:
                save_file({k: v.contiguous() for k, v in cond.items()}, str(tmp))
                tmp.replace(self.directory / f"{key}.safetensors")
            finally:
                tmp.unlink(missing_ok=True)

    def encode(self, prompts: Sequence[str]) -> Cond:
        """Conditioning for ``prompts`` (B,), encoding only prompts never seen before."""
        keys = [self.key(p) for p in prompts]
        todo = {}
        for prompt, key in zip(prompts, keys):
            if key in self.memory or key in todo:
                continue
            cached = self._load(key)
            if cached is not None:
                self.memory[key] = cached
            else:
                todo[key] = prompt
        for key, prompt in todo.items():
            # one prompt per call: an embedding never depends on which prompts shared its batch,
            # so a warm and a cold cache give bit-identical conditioning (exact resume)
            self._store(key, {k: v.detach().cpu() for k, v in self.model.encode_prompt([prompt]).items()})
        self.misses += len(todo)
        self.hits += len(prompts) - len(todo)
        names = self.memory[keys[0]].keys()
        device = self.model.device
        return {n: torch.cat([self.memory[k][n] for k in keys]).to(device) for n in names}

    def __contains__(self, prompt: str) -> bool:
        """True when ``prompt`` is cached in memory or on disk (does not count as a hit)."""
        key = self.key(prompt)
        return key in self.memory or (self.directory is not None and (self.directory / f"{key}.safetensors").is_file())

    def warm(self, prompts: Sequence[str]) -> int:
        """Make sure every distinct prompt is cached (encoding only the missing ones).

        Returns:
            How many prompts had to be encoded.
        """
        before = self.misses
        distinct = list(dict.fromkeys(prompts))
        for start in range(0, len(distinct), 64):
            self.encode(distinct[start : start + 64])
        return self.misses - before
