"""GGUFs of the Llama 3, Qwen 2 and Qwen 3 families (byte-level BPE vocabularies with their
own pre-tokenizer regexes), written here as llama.cpp writes them (Q8_0 matrices), against
transformers loading the same file: the same greedy tokens, the same token ids."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.engine.llm import LLM
from bucketserve.runtime.io.tokenizer import Tokenizer
from bucketserve.runtime.layers.linear import Linear
from bucketserve.runtime.loader.gguf_converter import GGUFConverter
from bucketserve.runtime.loader.model_files import resolve_model
from tests.conftest import TINY_CONFIG
from tests.runtime.conftest import SMALL_VOCAB
from tests.runtime.test_weights import runner_logits, write_gguf

# llama.cpp architecture -> (transformers config class, overrides, llama.cpp pre-tokenizer)
FAMILIES = {
    "llama": ("LlamaConfig", {}, "llama-bpe"),
    "qwen2": ("Qwen2Config", {}, "qwen2"),
    # transformers' GGUF loader takes Qwen 3's head_dim as 128 whatever the file says
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 128}, "qwen2"),
    "phi3": ("Phi3Config", {"pad_token_id": 0}, "llama-bpe"),  # q, k, v and gate, up fused
}
# merges that only some pre-tokenizers let happen: digits in runs (GPT-2 all, Llama 3 by
# three, Qwen one at a time), a contraction in capitals, a bracket before a word
EXTRA_MERGES = ["2 0", "20 2", "202 4", "' R", "'R E", "( t", "(t he"]
TEXTS = [
    "The year 2024 had 366 days; 1234567 is not prime.",
    "don't you'll WE'RE\n\n  indented\tline\r\n",
    "x=1+2*3 (the 2024) // fast!!! ... ünïcödé 日本語",
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_gguf(request, small_vocab, tmp_path_factory) -> tuple[str, Path]:
    """(architecture, GGUF): a seeded random model of the family over the small vocabulary
    and EXTRA_MERGES, its biases and norms made to count, its matrices in Q8_0."""
    arch = request.param
    config_cls, overrides, pre = FAMILIES[arch]
    extra = [m.replace(" ", "") for m in EXTRA_MERGES]
    vocab = {
        **small_vocab, "tokens": small_vocab["tokens"] + extra,
        "token_type": small_vocab["token_type"] + [1] * len(extra),
        "merges": small_vocab["merges"] + EXTRA_MERGES,
    }  # fmt: skip
    base = {k: v for k, v in TINY_CONFIG.items() if k != "rope_scaling"}
    size = {"vocab_size": len(vocab["tokens"])}
    config = getattr(transformers, config_cls)(**{**base, **size, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    out = tmp_path_factory.mktemp(arch)
    model.save_pretrained(out / "hf")
    path = write_gguf(
        out / f"tiny-{arch}.gguf", out / "hf", vocab, arch, pre=pre, linear_rope=False,
        qtype=gguf.GGMLQuantizationType.Q8_0,
    )  # fmt: skip
    return arch, path


def test_a_family_gguf_serves_the_greedy_tokens_of_transformers_on_the_same_file(
    family_gguf, cache_dir
) -> None:
    arch, path = family_gguf
    theirs = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompts = [[5 + (i * 37 + j * 11) % (SMALL_VOCAB - 5) for j in range(n)]
               for i, n in enumerate((7, 19, 12))]  # fmt: skip
    want = []
    for ids in prompts:
        with torch.no_grad():
            out = theirs.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                  min_new_tokens=8)  # fmt: skip
        want.append(out[0, len(ids):].tolist())
    model_dir = resolve_model(path)
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [f"{arch.title()}ForCausalLM"]


def test_a_family_gguf_kept_in_its_blocks_stays_close_to_its_expansion(
    family_gguf, cache_dir
) -> None:
    """Every GEMM weight in Q8_0 blocks (Phi-3's fused q/k/v and gate/up split by rows),
    logits within test_weights' bound of the float32 expansion's."""
    _, path = family_gguf
    kept, logits = runner_logits(path, "auto")
    _, reference = runner_logits(path, "none")
    linears = [m for m in kept.model.model.layers.modules() if isinstance(m, Linear)]
    assert linears and all(m.blocks and m.weight.numel() == 0 for m in linears)
    assert (logits - reference).norm() / reference.norm() < 0.06
    # the token chosen is the reference's or ties with it within the logits' error (Qwen2's
    # top two here are 2 % apart)
    error = (logits - reference).abs().max()
    assert reference[logits.argmax()] >= reference.max() - 2 * error


def test_a_family_gguf_tokenizes_like_transformers(family_gguf, cache_dir) -> None:
    _, path = family_gguf
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_dir(resolve_model(path))
    for text in TEXTS:
        want = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.decode(want) == theirs.decode(want, skip_special_tokens=True)


CONTROL, BYTE = 3, 6
SPM_WORDS = ["\u2581", "a", "b", "c", "h", "i", "t", "e", "r", "bc", "ab", "\u2581a", "\u2581h",
             "hi", "\u2581hi", "th", "er", "\u2581the", "\u2581th", "ere", "\u2581there"]
# "habc": "ab" outscores "bc", which comes first in the file
SPM_TEXTS = ["abc", "habc", "hi habc", "hi abc", "  hi", "a\nb  c", "hi there", "<s>hi</s>",
             "é", "", " there"]


def test_a_sentencepiece_llama_vocab_tokenizes_like_transformers(tmp_path) -> None:
    """Llama 2's and Mistral's files: merges ranked by score (here against file order: the
    later tokens score higher), a space before the text, bytes for what the words miss."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_WORDS]
    types = [2, CONTROL, CONTROL] + [BYTE] * 256 + [1] * len(SPM_WORDS)
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [float(i) for i in range(len(SPM_WORDS))])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    GGUFConverter(path).write_tokenizer(tmp_path / "ours")
    ours = Tokenizer.from_dir(tmp_path / "ours")
    for text in SPM_TEXTS:
        want = theirs.encode(text)
        assert ours.encode(text) == want, text
        assert ours.decode(want) == theirs.decode(want, skip_special_tokens=True), text
