"""Converts the embedded Gemma 3 270M GGUF into a Hugging Face safetensors checkpoint that vLLM (0.32, which loads no
GGUF) can serve. Run by the vLLM environment's own Python (drafter_data/server/vllm_local.py), standalone:

    python gguf_to_hf.py GGUF TEMPLATE OUT_DIR

transformers refuses `save_pretrained` on a GGUF-loaded model, so the GGUF is loaded dequantized and its weights are
copied into a model built from the same config, which is saved. The tokenizer never adds `<bos>` (neither does vLLM
for a chat prompt): the chat template (our conf/templates/gemma3-270m.jinja, with the thinking switch) starts with it.
`<end_of_turn>` (106) is an EOS in generation_config.json, so vLLM stops where the template closes a turn.
"""
import json
import shutil
import sys
from pathlib import Path

END_OF_TURN = "<end_of_turn>"


def convert(gguf: Path, template: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(0)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    config = loaded.config
    config.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise SystemExit(f"the GGUF's weights do not fit the model built from its config: missing "
                         f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model = model.to(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if not isinstance(eot, int) or eot == tokenizer.unk_token_id:
        raise SystemExit(f"the GGUF's vocabulary has no {END_OF_TURN} token")
    eos = [i for i in dict.fromkeys([tokenizer.eos_token_id, eot]) if i is not None]
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tokenizer.pad_token_id)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    # a plain bf16 checkpoint now: the GGUF-loading marks would send vLLM looking for a `gguf` quantization
    model_config = json.loads((tmp / "config.json").read_text())
    for key in ("quantization_config", "_model_name_or_path"):
        model_config.pop(key, None)
    (tmp / "config.json").write_text(json.dumps(model_config, indent=2, ensure_ascii=False))
    tokenizer.chat_template = template.read_text()
    tokenizer.save_pretrained(str(tmp))
    shutil.copyfile(template, tmp / "chat_template.jinja")
    # the template's <bos>, never the tokenizer's: a chat prompt must hold exactly one
    config_path = tmp / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config.update(add_bos_token=False, add_eos_token=False)
    for key in ("is_local", "local_files_only"):
        tok_config.pop(key, None)
    tok_config.pop("chat_template", None)  # chat_template.jinja is the one
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"converted {gguf.name} -> {out} (eos ids {eos})")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: python gguf_to_hf.py GGUF TEMPLATE OUT_DIR")
    convert(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
