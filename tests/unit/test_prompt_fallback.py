"""The plain-text prompt (tokenizers without a chat template) starts with BOS when the tokenizer would add one."""

from clarifier.core.prompt import SYSTEM_PROMPT, render_prompt


class _Tok:
    chat_template = None

    def __init__(self, adds_bos: bool):
        self.bos_token, self.bos_token_id, self.adds_bos = "<bos>", 2, adds_bos

    def __call__(self, text, add_special_tokens=True):
        if isinstance(text, list):  # a batch, as transformers tokenizers take it
            return {"input_ids": [self(t, add_special_tokens)["input_ids"] for t in text]}
        ids = [ord(c) + 10 for c in text]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens and self.adds_bos else []) + ids}


def test_fallback_writes_bos_when_the_tokenizer_adds_one():
    assert render_prompt(_Tok(adds_bos=True), [], "reset it?").startswith("<bos>" + SYSTEM_PROMPT)


def test_fallback_has_no_bos_when_the_tokenizer_adds_none():
    assert render_prompt(_Tok(adds_bos=False), [], "reset it?").startswith(SYSTEM_PROMPT)
