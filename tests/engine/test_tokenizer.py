"""Tokenizer, chat template and incremental detokenizer against transformers."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "Ünïcödé: 日本語のテキスト, emoji 🤖🚀, math ∑∫",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n\treturn x ** 2  # comment\n",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke 😀"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    return Tokenizer(smollm_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_token_ids_equal_transformers(tokenizer, hf_smollm, text):
    _, hf_tok = hf_smollm
    assert tokenizer.encode(text) == hf_tok(text).input_ids
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == hf_tok.decode(
        hf_tok(text).input_ids
    )


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tokenizer, hf_smollm, conversation, add_generation_prompt):
    _, hf_tok = hf_smollm
    ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert tokenizer.encode(ours, add_special_tokens=False) == hf_tok(theirs, add_special_tokens=False).input_ids


def test_chat_template_is_sandboxed(smollm_dir):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(smollm_dir, chat_template=evil)
    with pytest.raises(ChatTemplateError, match="failed to render"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    mutating = "{% set _ = messages.append({'role': 'x'}) %}{{ messages|length }}"
    with pytest.raises(ChatTemplateError):
        Tokenizer(smollm_dir, chat_template=mutating).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_override_and_raise_exception(smollm_dir):
    template = "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    tok = Tokenizer(smollm_dir, chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "[user]hey"
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def _stream(tokenizer, token_ids, params, prompt_ids=()):
    detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), params)
    deltas, stop = [], None
    for token_id in token_ids:
        stop = detok.add_token(token_id)
        if stop is not None:
            break
        deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    return deltas, stop, detok.output_text


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_incremental_detokenizer_never_splits_characters(tokenizer, text):
    token_ids = tokenizer.encode(text)
    deltas, _, full = _stream(tokenizer, token_ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == full == tokenizer.decode(token_ids, skip_special_tokens=False)
    assert all("\ufffd" not in d for d in deltas), deltas


def test_detokenizer_skips_special_tokens(tokenizer):
    token_ids = tokenizer.encode("<|im_start|>assistant\nSure.<|im_end|>")
    _, _, text = _stream(tokenizer, token_ids, SamplingParams(skip_special_tokens=True))
    assert text == "assistant\nSure."


def test_stop_string_cut_and_held_back(tokenizer):
    text = "The answer is 42. STOP here and nothing more"
    token_ids = tokenizer.encode(text)
    deltas, stop, full = _stream(tokenizer, token_ids, SamplingParams(stop=["STOP"]))
    assert stop == "STOP"
    assert full == "The answer is 42. "
    assert "".join(deltas) == full
    # while "ST" was at the end of the text it must not have been streamed
    assert not any(d.endswith("S") for d in deltas[:-1])
    _, _, kept = _stream(tokenizer, token_ids, SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    assert kept == "The answer is 42. STOP"


def test_stop_string_spanning_tokens_is_found(tokenizer):
    token_ids = tokenizer.encode("alpha beta gamma delta")
    _, stop, full = _stream(tokenizer, token_ids, SamplingParams(stop=["a gam", "zzz"]))
    assert stop == "a gam" and full == "alpha bet"
