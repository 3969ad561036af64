"""The Qwen-style adapter (a tokenizer.json for the `tokenizers` library, thinking switch enable_thinking), on a small
tokenizer built here."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.conftest import read_rows

QWEN_STYLE_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content is defined and m.reasoning_content -%}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif -%}{{ m.content + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]


def build_model_dir(path):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "what is two plus two", "it is four", "think step by step"]
    tok.train_from_iterator(corpus * 50, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    from tokenizers import decoders
    tok.decoder = decoders.ByteLevel()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}))
    (path / "chat_template.jinja").write_text(QWEN_STYLE_TEMPLATE)
    return tok


def test_qwen_style_target_through_the_stage(run_stage, tmp_path):
    tok = build_model_dir(tmp_path / "model")
    row = {"prompt_id": "q", "source": "s", "messages": [{"role": "user", "content": "what is two plus two"}],
           "reasoning": "think step by step", "content": "it is four", "finish_reason": "stop",
           "prompt_tokens": 1, "completion_tokens": 1}
    (tmp_path / "in").mkdir()
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "in" / "c.parquet")
    run_stage("tokenize", "target=qwen3", f"target.tokenizer_dir={tmp_path / 'model'}", "target.mask_token_id=4",
              f"tokenize.input={tmp_path / 'in'}", f"tokenize.output={tmp_path / 'out'}")
    (out,) = read_rows(tmp_path / "out")
    prompt = "<|im_start|>user\nwhat is two plus two<|im_end|>\n<|im_start|>assistant\n"
    body = "<think>\nthink step by step\n</think>\n\nit is four<|im_end|>\n"
    assert out["input_ids"] == tok.encode(prompt + body, add_special_tokens=False).ids
    start = out["loss_mask"].index(1)
    assert set(out["loss_mask"][start:]) == {1} and set(out["loss_mask"][:start]) == {0}
    assert tok.decode(out["input_ids"][:start], skip_special_tokens=False) == prompt
    assert tok.decode(out["input_ids"][start:], skip_special_tokens=False) == body
    assert out["input_ids"][start] == tok.token_to_id("<think>")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["template_kwargs"] == {} and meta["thinking_kwarg"] == "enable_thinking" and meta["thinking"] is True
    assert meta["tokenizer"]["kind"] == "hf_tokenizers"
