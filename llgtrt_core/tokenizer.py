"""The model's tokenizer as the serving layer needs it: encode, decode, stop tokens, chat template.

Loaded from a Hugging Face style directory (`tokenizer.json`, `tokenizer_config.json`, optional
`generation_config.json` and `chat_template.jinja`). Encoding and decoding go straight to the Rust
`tokenizers` object (no Python post-processing such as `clean_up_tokenization_spaces`); the
transformers wrapper is kept for libraries that need it (llguidance).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from llgtrt_core.chat_template import ChatTemplate

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: Any) -> Optional[str]:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _find_chat_template(model_dir: Path, config: dict[str, Any]) -> Optional[str]:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = model_dir / "chat_template.jinja"  # where transformers >= 4.43 saves it
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return _read_json(model_dir / "chat_template.json").get("chat_template")


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer  # heavy import, only when a model is loaded

        model_dir = Path(model_dir)
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self._fast = self.hf.backend_tokenizer  # the Rust tokenizers.Tokenizer
        config = _read_json(model_dir / "tokenizer_config.json")
        self.special_tokens = {name: _token_content(config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        self.eos_token_ids = self._eos_ids(config, _read_json(model_dir / "generation_config.json"))
        template = _find_chat_template(model_dir, config)
        self.chat_template = ChatTemplate(template, self.special_tokens) if template else None

    def _eos_ids(self, config: dict[str, Any], generation_config: dict[str, Any]) -> frozenset[int]:
        """End-of-sequence ids: the tokenizer's eos plus generation_config's (Llama 3 lists several)."""
        ids: set[int] = set()
        eos = _token_content(config.get("eos_token"))
        if eos is not None and (eos_id := self._fast.token_to_id(eos)) is not None:
            ids.add(eos_id)
        from_generation = generation_config.get("eos_token_id")
        if isinstance(from_generation, int):
            ids.add(from_generation)
        elif isinstance(from_generation, list):
            ids.update(i for i in from_generation if isinstance(i, int))
        return frozenset(ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._fast.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_many([text], add_special_tokens)[0]

    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        # The batch call releases the GIL while it works (`encode` holds it: seconds for megabytes,
        # the event loop frozen even when the call runs in another thread).
        return [encoding.ids for encoding in self._fast.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._fast.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
