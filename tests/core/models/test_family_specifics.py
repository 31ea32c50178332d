"""Family-specific behaviour the shared suite does not cover: Wan native names, input errors,
prompt length, LoRA export validation, the tiny tokenizers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from diffsynth_core.models import get_family, lora_export, tiny_tokenizers
from diffsynth_core.models.single_file import strip_prefixes


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return get_family("wan").save_tiny_model(tmp_path_factory.mktemp("wan") / "model", 0)


def test_wan_native_names_invert_diffusers_converter(wan_dir):
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from diffsynth_core.models.wan import native_name

    sd = WanTransformer3DModel.from_pretrained(wan_dir / "transformer").state_dict()
    native = {native_name(k): v for k, v in sd.items()}
    assert "blocks.0.self_attn.q.weight" in native and "head.modulation" in native and "blocks.1.norm3.weight" in native
    assert convert_wan_transformer_to_diffusers(dict(native)).keys() == sd.keys()


def test_wan_loads_a_comfyui_native_checkpoint_with_fp32_modules(wan_dir, tmp_path):
    from diffsynth_core.models.wan import native_name

    spec = get_family("wan")
    ref = spec.load_components(wan_dir, ("transformer",), torch.float32, "cpu")["transformer"]
    file = tmp_path / "wan_native.safetensors"
    save_file({"model.diffusion_model." + native_name(k): v.to(torch.bfloat16) for k, v in ref.state_dict().items()},
              str(file))
    loaded = spec.load_transformer_file(file, wan_dir, torch.bfloat16)
    got = loaded.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k].float(), v.to(torch.bfloat16).float()), k
    assert got["scale_shift_table"].dtype == torch.float32  # _keep_in_fp32_modules
    assert got["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16


def test_native_name_rejects_unknown_modules():
    from diffsynth_core.models.wan import native_name

    with pytest.raises(ValueError, match="mystery"):
        native_name("mystery.linear")


def test_strip_prefixes_only_strips_leading_checkpoint_prefixes():
    sd = {"model.diffusion_model.a.weight": 1, "diffusion_model.b.bias": 2, "c.diffusion_model.d": 3}
    assert strip_prefixes(sd) == {"a.weight": 1, "b.bias": 2, "c.diffusion_model.d": 3}


@pytest.mark.parametrize("family, shape, message", [
    ("qwen_image", (3, 2, 64, 64), "one frame"),
    ("flux", (3, 1, 64, 40), "multiples of 16"),
    ("wan", (3, 4, 64, 64), "4k\\+1"),
    ("wan", (1, 5, 64, 64), "\\(3, F, H, W\\)"),
])
def test_encode_pixels_rejects_bad_shapes_before_touching_the_vae(family, shape, message):
    with pytest.raises(ValueError, match=message):
        get_family(family).encode_pixels({}, torch.zeros(shape), "cpu")


def test_prompt_length_is_a_keyword_defaulting_to_the_tokenizers_limit(wan_dir):
    spec = get_family("wan")
    comps = spec.load_components(wan_dir, ("text_encoder", "tokenizer"), torch.float32, "cpu")
    assert spec.encode_prompt(comps, "a cat", "cpu")["prompt_embeds"].shape == (32, 32)
    short = spec.encode_prompt(comps, "a cat", "cpu", max_sequence_length=8)["prompt_embeds"]
    assert short.shape == (8, 32)


def test_qwen_tokenizer_template_prefix_is_the_34_tokens_the_pipeline_drops():
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    tok = tiny_tokenizers.qwen2_tokenizer()
    assert len(tok(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34


@pytest.mark.parametrize("bad, message", [
    ({"a.lora_A.weight": torch.zeros(1)}, "only"),
    ({"a.weight": torch.zeros(1)}, "does not end in"),
    ({}, "empty"),
])
def test_lora_export_rejects_malformed_state_dicts(bad, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        get_family("wan").export_lora(bad, {"r": 1, "lora_alpha": 1, "target_modules": ["a"]}, tmp_path)


def test_a_failed_lora_write_leaves_no_temp_file(tmp_path, monkeypatch):
    def disk_full(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(lora_export.os, "replace", disk_full)
    with pytest.raises(OSError, match="No space"):
        lora_export.write_safetensors(tmp_path / "lora.safetensors", {"a": torch.zeros(2)}, {})
    assert list(tmp_path.iterdir()) == []


def test_comfy_alpha_matches_peft_scale_for_rslora():
    cfg = {"r": 16, "lora_alpha": 8, "use_rslora": True}
    assert lora_export.comfy_alpha(cfg, 16) / 16 == pytest.approx(8 / 16 ** 0.5)
    assert lora_export.needs_alpha_tensors(cfg)
    assert not lora_export.needs_alpha_tensors({"r": 4, "lora_alpha": 4})


def test_qwen_batch_of_padded_prompts_matches_each_prompt_alone(tmp_path):
    spec = get_family("qwen_image")
    folder = spec.save_tiny_model(tmp_path / "qwen", 0)
    comps = spec.load_components(folder, spec.encoder_components + ("transformer",), torch.float32, "cpu")
    short, long = (spec.encode_prompt(comps, p, "cpu") for p in ("a cat", "a photo of a red dog and a blue cat"))
    n = long["prompt_embeds"].shape[0]
    assert short["prompt_embeds"].shape[0] < n

    def pad(t):
        return torch.cat([t, t.new_zeros((n - t.shape[0], *t.shape[1:]))])

    cond = {k: torch.stack([pad(short[k]), long[k]]) for k in short}
    latents = torch.randn(2, 16, 1, 4, 6, generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        batched = spec.dit_forward(comps["transformer"], latents, sigmas, cond)
        alone = [spec.dit_forward(comps["transformer"], latents[i:i + 1], sigmas[i:i + 1],
                                  {k: v[None] for k, v in c.items()}) for i, c in enumerate((short, long))]
    assert torch.allclose(batched, torch.cat(alone), atol=1e-5)


def _bfl_flux_checkpoint(d=3072, mlp=12288, head_dim=128):
    """Original BFL names and shapes of a FLUX.1-dev with one double and one single block, on meta."""
    def lin(name, out, inp):
        return {name + ".weight": torch.empty(out, inp, device="meta"), name + ".bias": torch.empty(out, device="meta")}

    def qk_norm(prefix):
        return {prefix + "query_norm.scale": torch.empty(head_dim, device="meta"),
                prefix + "key_norm.scale": torch.empty(head_dim, device="meta")}

    sd = lin("img_in", d, 64) | lin("txt_in", d, 4096)
    for embedder, width in (("time_in", 256), ("vector_in", 768), ("guidance_in", 256)):
        sd |= lin(embedder + ".in_layer", d, width) | lin(embedder + ".out_layer", d, d)
    for stream in ("img", "txt"):
        p = f"double_blocks.0.{stream}"
        sd |= lin(p + "_mod.lin", 6 * d, d) | lin(p + "_attn.qkv", 3 * d, d) | lin(p + "_attn.proj", d, d)
        sd |= lin(p + "_mlp.0", mlp, d) | lin(p + "_mlp.2", d, mlp) | qk_norm(p + "_attn.norm.")
    p = "single_blocks.0."
    sd |= lin(p + "linear1", 3 * d + mlp, d) | lin(p + "linear2", d, d + mlp) | lin(p + "modulation.lin", 3 * d, d)
    sd |= qk_norm(p + "norm.")
    return sd | lin("final_layer.linear", 64, d) | lin("final_layer.adaLN_modulation.1", 2 * d, d)


def test_flux_original_bfl_names_convert_to_the_diffusers_layout():
    """Real FLUX.1 width on the meta device (diffusers' converter assumes inner_dim 3072)."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    from diffsynth_core.models.flux import _convert_bfl

    converted = _convert_bfl(_bfl_flux_checkpoint())
    with init_empty_weights():
        expected = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True).state_dict()
    assert converted.keys() == expected.keys()
    assert all(converted[k].shape == v.shape for k, v in expected.items())


RELEASED_SIZES = {"Qwen-Image": 20.43e9, "FLUX.1-dev": 11.90e9, "FLUX.1-schnell": 11.90e9,
                  "Wan2.1-T2V-14B": 14.29e9, "Wan2.1-T2V-1.3B": 1.42e9,
                  "Wan2.2-TI2V-5B": 5.00e9, "Wan2.2-T2V-A14B": 14.29e9}  # A14B: each of its two experts


@pytest.mark.parametrize("family", ["qwen_image", "flux", "wan"])
def test_released_layouts_have_the_published_parameter_counts(family):
    spec = get_family(family)
    released = [v for v in spec.transformer_variants if not v.startswith("tiny")]
    assert released
    for variant in released:
        model = spec.build_transformer(variant, torch.bfloat16, "meta")
        count = sum(p.numel() for p in model.parameters())
        assert count == pytest.approx(RELEASED_SIZES[variant], rel=2e-3), variant


@pytest.mark.parametrize("family, frames", [("qwen_image", 1), ("flux", 1), ("wan", 5)])
def test_random_tiny_transformer_runs_on_dummy_inputs(family, frames):
    spec = get_family(family)
    model = spec.build_transformer("tiny", torch.bfloat16, "cpu")
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p.float()).all(), name
        assert p.dtype == (torch.float32 if any(m in name.split(".") for m in keep) else torch.bfloat16), name
    latents, cond = spec.dummy_inputs(model.config, batch=2, height=32, width=48, num_frames=frames, text_len=7)
    with torch.no_grad():
        out = spec.dit_forward(model, latents, torch.tensor([0.2, 0.9]), cond)
    assert out.shape == latents.shape and torch.isfinite(out.float()).all()
    with pytest.raises(KeyError, match="known"):
        spec.build_transformer("nope", torch.float32, "cpu")


def test_dit_forward_accepts_wrapped_models():
    """DDP-style ``.module`` and torch.compile-style ``._orig_mod`` wrappers are looked through."""
    spec = get_family("flux")
    model = spec.build_transformer("tiny", torch.float32, "cpu")

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    latents, cond = spec.dummy_inputs(model.config, height=32, width=32)
    sigmas = torch.tensor([0.4])
    with torch.no_grad():
        assert torch.equal(spec.dit_forward(Wrapper(model), latents, sigmas, cond),
                           spec.dit_forward(model, latents, sigmas, cond))


def _tiny_lora_state_dict(rank=2):
    g = torch.Generator().manual_seed(0)
    sd = {}
    for module in ("blocks.0.attn1.to_q", "blocks.1.attn2.to_out.0"):
        sd[module + ".lora_A.weight"] = torch.randn(rank, 24 * 2, generator=g)
        sd[module + ".lora_B.weight"] = torch.randn(24 * 2, rank, generator=g)
    return sd


def test_export_header_names_exact_modules_and_a_reload_safe_init(tmp_path):
    import json

    from safetensors import safe_open

    config = {"r": 2, "lora_alpha": 2.0, "target_modules": ["to_q", "to_out.0"], "init_lora_weights": "default"}
    paths = get_family("wan").export_lora(_tiny_lora_state_dict(), config, tmp_path)
    with safe_open(str(paths["diffusers"]), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert sorted(meta["transformer.target_modules"]) == ["blocks.0.attn1.to_q", "blocks.1.attn2.to_out.0"]
    assert meta["transformer.init_lora_weights"] is True
    with safe_open(str(paths["comfyui"]), "pt") as f:
        assert sorted(f.keys()) == sorted(
            f"diffusion_model.{m}.{s}" for m in ("blocks.0.self_attn.q", "blocks.1.cross_attn.o")
            for s in ("alpha", "lora_A.weight", "lora_B.weight"))


@pytest.mark.parametrize("config, message", [
    ({"r": 3, "lora_alpha": 3, "target_modules": ["to_q"]}, "rank 2"),
    ({"r": 2, "lora_alpha": 2, "target_modules": ["to_q"], "not_a_field": 1}, "not_a_field"),
    ({"r": 2, "target_modules": ["to_q"]}, "lora_alpha"),
])
def test_export_rejects_configs_that_do_not_describe_the_weights(config, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        get_family("qwen_image").export_lora(_tiny_lora_state_dict(), config, tmp_path)


def test_concurrent_loads_leave_no_meta_patch_behind(tmp_path):
    """Preprocess parts load encoders in threads; accelerate/diffusers init patches are process-wide."""
    from concurrent.futures import ThreadPoolExecutor

    spec = get_family("qwen_image")
    folder = spec.save_tiny_model(tmp_path / "qwen", 0)
    register_parameter = torch.nn.Module.register_parameter
    init_normal = torch.nn.init.normal_

    def load(_):
        comps = spec.load_components(folder, ("vae", "transformer", "text_encoder"), torch.float32, "cpu")
        return all(p.device.type == "cpu" for m in comps.values() for p in m.parameters())

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(load, range(12)))
    assert torch.nn.Module.register_parameter is register_parameter and torch.nn.init.normal_ is init_normal
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
