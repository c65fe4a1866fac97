"""Tokenizer (from the GGUF's vocab) against transformers' AutoTokenizer and llama.cpp's rules."""

from __future__ import annotations

import gguf
import pytest
import tokenizers
from transformers import AutoTokenizer

from bucketserve.runtime.io.tokenizer import Tokenizer
from bucketserve.runtime.loader.gguf_converter import GGUFConverter

TEXTS = [
    "Hello world",
    "Hello 12345 world, it's 3.14159!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines",
    "unicode: café, naïve, 日本語, emoji 🤖🎉, Ελληνικά",
    "code: def f(x):\n    return x**2  # square",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Count to 3."},
    ],
]


@pytest.fixture(scope="module")
def tok(smollm_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def hf_tok(smollm_tokenizer_dir):
    return AutoTokenizer.from_pretrained(smollm_tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_tok, text):
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == hf_tok.encode(text, add_special_tokens=special)
    ids = tok.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
            ids, skip_special_tokens=skip
        )
    assert tok.decode(ids, skip_special_tokens=False) == text  # lossless round trip


def test_digits_are_split_one_by_one_like_llama_cpp_smollm(tok):
    ids = tok.encode("Hello 12345 world")
    assert ids == [19556, 216, 33, 34, 35, 36, 37, 905]
    assert [tok.decode([i]) for i in ids[2:7]] == ["1", "2", "3", "4", "5"]
    assert len(tok.encode("2024")) == 4


def test_chat_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|im_start|>assistant\n")[0] == 1
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)


def test_special_ids_and_vocab_match_transformers(tok, hf_tok):
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.all_special_ids == sorted(hf_tok.all_special_ids)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id)
    assert tok.decode([1, 19556, 2]) == "Hello"


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    theirs = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours == theirs
    assert ours.startswith("<|im_start|>system\n")
    assert ours.endswith("<|im_start|>assistant\n") == generation_prompt


def test_bad_input_errors(tok):
    with pytest.raises(ValueError, match="messages must be a list"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="messages must be a list"):
        tok.apply_chat_template("hello")
    with pytest.raises(ValueError, match="must be a str"):
        tok.encode(["not", "a", "string"])
    bare = Tokenizer(tok.backend)
    with pytest.raises(ValueError, match=r"has no chat template.*--chat-template FILE"):
        bare.apply_chat_template(CHATS[0])
    strict = Tokenizer(tok.backend, "{{ raise_exception('only user turns') }}")
    with pytest.raises(ValueError, match="chat template error: only user turns"):
        strict.apply_chat_template(CHATS[0])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_bos_template_for_models_that_add_bos(smollm_tokenizer_dir, tmp_path):
    """A tokenizer.json whose post-processor adds BOS (Llama style) is honoured."""
    backend = tokenizers.Tokenizer.from_file(str(smollm_tokenizer_dir / "tokenizer.json"))
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    tok = Tokenizer(backend, special_tokens={"bos_token": "<|im_start|>"})
    assert tok.encode("Hello") == [1, 19556]
    assert tok.encode("Hello", add_special_tokens=False) == [19556]


def write_vocab_gguf(path, pre: str):
    """A GGUF holding only a byte-level vocabulary in which digits do merge."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|im_start|>", *alphabet, "\u01201", "12"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(["\u0120 1", "1 2"])
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return GGUFConverter(path).build_tokenizer(), tokens


def test_gguf_pre_tokenizer_follows_llama_cpp(tmp_path):
    """llama.cpp's smollm pre-tokenizer cuts every digit apart before BPE; gpt-2's does not."""
    smollm, tokens = write_vocab_gguf(tmp_path / "smollm.gguf", "smollm")
    gpt2, _ = write_vocab_gguf(tmp_path / "gpt2.gguf", "gpt-2")

    def pieces(tok, text):
        return [tokens[i] for i in tok.encode(text).ids]

    assert pieces(smollm, " 12") == ["\u0120", "1", "2"]
    assert pieces(gpt2, " 12") == ["\u01201", "2"]
    assert pieces(gpt2, "12") == ["12"]
    assert smollm.encode("<|im_start|>1").ids == [0, tokens.index("1")]


TURNS = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_a_given_chat_template_replaces_the_models(smollm_tokenizer_dir, tmp_path):
    """A file or the template text itself, as vLLM's --chat-template; a model without one
    (a base model) renders chat only with it."""
    (tmp_path / "turns.jinja").write_text(TURNS + "{{ bos_token }}")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((smollm_tokenizer_dir / "tokenizer.json").read_bytes())
    (bare / "tokenizer_config.json").write_text('{"bos_token": "<|im_start|>"}')
    with pytest.raises(ValueError, match="has no chat template"):
        Tokenizer.from_dir(bare).apply_chat_template(CHATS[0])
    want = "[user] What is 2+2?\n<|im_start|>"
    assert Tokenizer.from_dir(bare, str(tmp_path / "turns.jinja")).apply_chat_template(
        CHATS[0]
    ) == want
    assert Tokenizer.from_dir(smollm_tokenizer_dir, TURNS).apply_chat_template(
        CHATS[0]
    ) == "[user] What is 2+2?\n"
    own = Tokenizer.from_dir(smollm_tokenizer_dir)
    assert own.apply_chat_template(CHATS[0], chat_template=TURNS) == "[user] What is 2+2?\n"
    assert own.apply_chat_template(CHATS[0]).startswith("<|im_start|>")  # its own unchanged
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        Tokenizer.from_dir(bare, str(tmp_path / "missing.jinja"))


def test_llm_takes_a_chat_template_as_vllm_does(tiny_model_dir, tmp_path):
    """LLM(chat_template=...) for every chat, LLM.chat(chat_template=...) for one call."""
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.engine.llm import LLM

    (tmp_path / "turns.jinja").write_text(TURNS)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm = LLM(str(tiny_model_dir), chat_template=str(tmp_path / "turns.jinja"), num_kv_blocks=32)
    out = llm.chat(CHATS[0], greedy, use_tqdm=False)[0]
    assert out.prompt == "[user] What is 2+2?\n"
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    once = llm.chat(CHATS[0], greedy, use_tqdm=False, chat_template="{{ messages[0].content }}")
    assert once[0].prompt == "What is 2+2?"
