"""Vision encoders of real shapes (random weights) for ``ggmlpy bench -i --mmproj ... --vs llama.cpp``, converted
by llama.cpp's own converter (tests/hf_convert.py fetches it) to F16: SmolVLM-256M's vision tower (idefics3: 512 px,
patch 16, width 768, 12 layers, pixel shuffle 4), Llama 4 Scout's (llama4: 336 px, patch 14, width 1408, 16
heads, ff 5632) with 8 of its 34 layers, Qwen2.5-VL-3B/7B's (qwen25vl: patch 14, width 1280, 16 heads, ff 3420,
windows, 8 of its 32 layers with full attention in the 8th) and Qwen3-VL-4B's (qwen3vl: patch 16, width 1024,
16 heads, ff 4096, a 48 x 48 position table, 8 of its 24 layers with 3 deepstack mergers), each with a small
text model (the bench's image tests time the encoder; the Qwen ones have the Qwen-VL width 2048).

    python bench/vision_encoders.py OUT_DIR [smolvlm] [llama4] [qwen25vl] [qwen3vl]

writes ``OUT_DIR/NAME-{text,mmproj}-f16.gguf`` (bench/README, "Vision encoder precision").
Needs torch, transformers and what tests/hf_convert.py needs.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]

import hf_convert  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import vision_helpers as vh  # noqa: E402

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
which = sys.argv[2:] or ["smolvlm", "llama4", "qwen25vl", "qwen3vl"]
tok = transformers.AutoTokenizer.from_pretrained(str(hf_convert.tokenizer_dir("llama-bpe")))
if "smolvlm" in which:
    t = vh._idefics3_tokenizer()
    text = transformers.LlamaConfig(vocab_size=len(t), hidden_size=576, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    vision = transformers.Idefics3VisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                               num_attention_heads=12, image_size=512, patch_size=16)
    cfg = transformers.Idefics3Config(text_config=text, vision_config=vision, scale_factor=4,
                                      image_token_id=t.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    m = transformers.Idefics3ForConditionalGeneration(cfg).float().eval()
    ip = transformers.Idefics3ImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                                size={"longest_edge": 2048}, max_image_size={"longest_edge": 512})
    proc = transformers.Idefics3Processor(image_processor=ip, tokenizer=t, image_seq_len=64)
    d = vh._new_dir(out, "smolvlm")
    m.save_pretrained(str(d))
    proc.save_pretrained(str(d))
    vh._edit_json(d / "config.json", lambda c: c["text_config"].__setitem__("architectures", ["VLlama3ForCausalLM"]))
    print(vh.convert_dir(d, out, name="smolvlm", outtype="f16"))
if "llama4" in which:
    tok.add_special_tokens({"additional_special_tokens": ["<|image_start|>", "<|image_end|>", "<|image|>",
                                                          "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"]})
    vision = dict(image_size=336, patch_size=14, hidden_size=1408, num_attention_heads=16, num_hidden_layers=8,
                  intermediate_size=5632, pixel_shuffle_ratio=0.5, projector_input_dim=4096,
                  projector_output_dim=4096, vision_output_dim=4096, hidden_act="gelu", norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    text = dict(vocab_size=len(tok), hidden_size=256, intermediate_size=256, intermediate_size_mlp=512,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=2,
                attention_chunk_size=8192)
    ids = tok.convert_tokens_to_ids
    cfg = transformers.Llama4Config(vision_config=vision, text_config=text, image_token_index=ids("<|patch|>"),
                                    boi_token_index=ids("<|image_start|>"), eoi_token_index=ids("<|image_end|>"))
    torch.manual_seed(0)
    m = transformers.Llama4ForConditionalGeneration(cfg).float().eval()
    d = vh._new_dir(out, "llama4")
    m.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    (d / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "size": {"height": 336, "width": 336}, "max_patches": 16, "image_processor_type": "Llama4ImageProcessor"}))
    print(vh.convert_dir(d, out, name="llama4", outtype="f16"))
for name in ("qwen25vl", "qwen3vl"):
    if name not in which:
        continue
    n_vocab = len(hf_convert.tokenizer("qwen2"))
    text = dict(vocab_size=n_vocab, hidden_size=2048, intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": [16, 24, 24] if name == "qwen25vl" else [24, 20, 20]})
    if name == "qwen25vl":
        vision = dict(depth=8, hidden_size=1280, num_heads=16, intermediate_size=3420, patch_size=14,
                      window_size=112, out_hidden_size=2048, fullatt_block_indexes=[7], hidden_act="silu")
        cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text)
        cls, patch, mean = transformers.Qwen2_5_VLForConditionalGeneration, 14, [0.48145466, 0.4578275, 0.40821073]
        std = [0.26862954, 0.26130258, 0.27577711]
    else:
        text["rope_parameters"]["mrope_interleaved"] = True
        vision = dict(depth=8, hidden_size=1024, num_heads=16, intermediate_size=4096, patch_size=16,
                      num_position_embeddings=2304, deepstack_visual_indexes=[1, 4, 7], out_hidden_size=2048,
                      hidden_act="gelu_pytorch_tanh")
        cfg = transformers.Qwen3VLConfig(vision_config=vision, text_config=text)
        cls, patch, mean, std = transformers.Qwen3VLForConditionalGeneration, 16, [0.5] * 3, [0.5] * 3
    torch.manual_seed(0)
    m = cls(cfg).float().eval()
    d = hf_convert.save_model_dir(m, out / f"{name}-hf", "qwen2")
    hf_convert.qwen_vision_tokens(d)
    (d / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": patch, "temporal_patch_size": 2, "merge_size": 2, "image_mean": mean, "image_std": std,
        "image_processor_type": "Qwen2VLImageProcessor"}))
    for args, kind in (((), "text"), (("--mmproj",), "mmproj")):
        print(hf_convert.convert_dir(d, out / f"{name}-{kind}-f16.gguf", "f16", args))
