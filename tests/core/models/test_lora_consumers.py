"""Each exported LoRA file is applied the way its consumer applies it, and applies fully.

The consumers' key mappings are re-implemented here from their source (each function names the
file it follows): ComfyUI's ``model_lora_keys_unet`` + ``load_lora`` + the LoRA weight adapter,
and DiffSynth-Studio's ``GeneralLoRALoader`` (+ ``FluxLoRALoader``'s format guess).  Each is run
on the base weights laid out the way that consumer's model names them (ComfyUI: Wan native and
FLUX/BFL names, DiffSynth: its own FLUX DiT names), and must consume every key of its file and
produce W + (alpha/r)·B·A for every LoRA module.  diffusers is the real thing:
``pipe.load_lora_weights`` on a fresh transformer reproduces the LoRA model's output exactly.

The LoRA sits on *every* Linear of the tiny DiT (so every name mapping is exercised), with
alpha != r and random A and B.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from diffsynth_core.models import get_family
from diffsynth_core.training.lora import inject_lora, lora_state_dict

RANK, ALPHA = 4, 6.0
SCALE = ALPHA / RANK


def _lora_model(spec, targets=None, seed=0):
    model = spec.build_transformer("tiny", torch.float32, "cpu")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    config = inject_lora(model, targets or linears, RANK, ALPHA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return model, config


def _merged(base: dict[str, torch.Tensor], peft_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers base weights with every LoRA update merged: the ground truth, W + s·B·A."""
    out = {k: v.clone() for k, v in base.items()}
    for key, down in peft_sd.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            out[module + ".weight"] += SCALE * (peft_sd[module + ".lora_B.weight"] @ down)
    return out


@pytest.fixture(scope="module", params=["qwen_image", "qwen_image:edit", "qwen_image:edit-2509", "flux", "wan",
                                        "z_image", "qwen_image21", "flux2"])
def exported(request, tmp_path_factory):
    spec = get_family(*request.param.split(":"))  # family[:variant]: the edit DiTs share Qwen-Image's names
    model, config = _lora_model(spec)
    peft_sd = lora_state_dict(model)
    base = {k: v.clone() for k, v in spec.build_transformer("tiny", torch.float32, "cpu").state_dict().items()}
    out = tmp_path_factory.mktemp(request.param.replace(":", "-"))
    paths = spec.export_lora(peft_sd, config, out)
    return dict(spec=spec, model=model, config=config, peft_sd=peft_sd, base=base, paths=paths,
                truth=_merged(base, peft_sd))


# --- diffusers: the real loader ---------------------------------------------------------------

def _pipeline_with(spec, transformer):
    import diffusers

    cls = getattr(diffusers, spec.pipeline_class_name)
    names = [n for n in cls._get_signature_keys(cls)[0] if n != "transformer"]
    parts = {n: None for n in names}
    if spec.name == "qwen_image21":  # its pipeline reads the prompt template's length from its processor
        from diffsynth_core.models.qwen_image21 import tiny_processor

        parts["processor"] = tiny_processor()
    return cls(transformer=transformer, **parts)


def test_diffusers_load_lora_weights_restores_every_tensor_and_the_output(exported):
    spec, path = exported["spec"], exported["paths"]["diffusers"]
    fresh = spec.build_transformer("tiny", torch.float32, "cpu")
    pipe = _pipeline_with(spec, fresh)
    pipe.load_lora_weights(path.parent, weight_name=path.name)
    from peft.utils import get_peft_model_state_dict

    adapters = list(pipe.transformer.peft_config)
    assert len(adapters) == 1
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=adapters[0])
    assert loaded.keys() == exported["peft_sd"].keys()
    assert all(torch.equal(loaded[k], v) for k, v in exported["peft_sd"].items())
    scalings = {s for m in pipe.transformer.modules() for s in getattr(m, "scaling", {}).values()}
    assert scalings == {SCALE}
    latents, cond = spec.dummy_inputs(fresh.config, height=32, width=32, text_len=5)
    sigmas = torch.tensor([0.7])
    with torch.no_grad():  # not bitwise: CPU GEMM paths depend on the loaded tensors' alignment
        torch.testing.assert_close(spec.dit_forward(pipe.transformer, latents, sigmas, cond),
                                   spec.dit_forward(exported["model"], latents, sigmas, cond), rtol=1e-5, atol=1e-6)


# --- ComfyUI ------------------------------------------------------------------------------------

def _swap_scale_shift(weight):  # comfy/utils.py swap_scale_shift
    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def comfy_flux_to_diffusers(depth, depth_single, hidden, prefix="diffusion_model."):
    """comfy/utils.py ``flux_to_diffusers``: diffusers key -> native key, (key, (dim, start, len)) or
    (key, None, function).  Weight keys of Linear layers (the ones LoRA can target)."""
    key_map = {}
    for i in range(depth):
        src, dst = f"transformer_blocks.{i}", f"{prefix}double_blocks.{i}"
        for end in ("weight", "bias"):
            for names, qkv in ((("to_q", "to_k", "to_v"), "img_attn.qkv"),
                               (("add_q_proj", "add_k_proj", "add_v_proj"), "txt_attn.qkv")):
                for j, name in enumerate(names):
                    key_map[f"{src}.attn.{name}.{end}"] = (f"{dst}.{qkv}.{end}", (0, hidden * j, hidden))
        block = {"attn.to_out.0": "img_attn.proj", "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
                 "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
                 "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2"}
        for d, n in block.items():
            for end in ("weight", "bias"):
                key_map[f"{src}.{d}.{end}"] = f"{dst}.{n}.{end}"
    for i in range(depth_single):
        src, dst = f"single_transformer_blocks.{i}", f"{prefix}single_blocks.{i}"
        for end in ("weight", "bias"):
            for j, name in enumerate(("to_q", "to_k", "to_v")):
                key_map[f"{src}.attn.{name}.{end}"] = (f"{dst}.linear1.{end}", (0, hidden * j, hidden))
            key_map[f"{src}.proj_mlp.{end}"] = (f"{dst}.linear1.{end}", (0, hidden * 3, hidden * 4))
            key_map[f"{src}.norm.linear.{end}"] = f"{dst}.modulation.lin.{end}"
            key_map[f"{src}.proj_out.{end}"] = f"{dst}.linear2.{end}"
    basic = {"proj_out": "final_layer.linear", "x_embedder": "img_in", "context_embedder": "txt_in",
             "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
             "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
             "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
             "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
             "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
             "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer"}
    for d, n in basic.items():
        for end in ("weight", "bias"):
            key_map[f"{d}.{end}"] = f"{prefix}{n}.{end}"
    for end in ("weight", "bias"):
        key_map[f"norm_out.linear.{end}"] = (f"{prefix}final_layer.adaLN_modulation.1.{end}", None, _swap_scale_shift)
    return key_map


def comfy_z_image_to_diffusers(n_layers, n_refiners, hidden, prefix="diffusion_model."):
    """comfy/utils.py ``z_image_to_diffusers`` (what comfy/lora.py's Lumina2 branch maps LoRA keys through):
    diffusers key -> native key, or (native key, (dim, start, len)) for q/k/v in the fused ``attention.qkv``.
    Weight keys of Linear layers (the ones LoRA can target)."""
    key_map = {}

    def block(src, dst):
        for j, name in enumerate(("to_q", "to_k", "to_v")):
            key_map[f"{src}.attention.{name}.weight"] = (f"{dst}.attention.qkv.weight", (0, hidden * j, hidden))
        for d, n in {"attention.to_out.0": "attention.out", "feed_forward.w1": "feed_forward.w1",
                     "feed_forward.w2": "feed_forward.w2", "feed_forward.w3": "feed_forward.w3",
                     "adaLN_modulation.0": "adaLN_modulation.0"}.items():
            key_map[f"{src}.{d}.weight"] = f"{dst}.{n}.weight"

    for container, count in (("layers", n_layers), ("context_refiner", n_refiners), ("noise_refiner", n_refiners)):
        for i in range(count):
            block(f"{container}.{i}", f"{prefix}{container}.{i}")
    basic = {"all_final_layer.2-1.linear": "final_layer.linear",
             "all_final_layer.2-1.adaLN_modulation.1": "final_layer.adaLN_modulation.1",
             "all_x_embedder.2-1": "x_embedder", "cap_embedder.1": "cap_embedder.1",
             "t_embedder.mlp.0": "t_embedder.mlp.0", "t_embedder.mlp.2": "t_embedder.mlp.2"}
    for d, n in basic.items():
        key_map[f"{d}.weight"] = f"{prefix}{n}.weight"
    return key_map


def _z_image_comfy_map(spec_config):
    return comfy_z_image_to_diffusers(spec_config["n_layers"], spec_config["n_refiner_layers"], spec_config["dim"])


def _flux_comfy_map(spec_config):
    return comfy_flux_to_diffusers(spec_config["num_layers"], spec_config["num_single_layers"],
                                   spec_config["num_attention_heads"] * spec_config["attention_head_dim"])


def _to_native(diffusers_sd, key_map):
    """A native (ComfyUI) state dict from a diffusers one, through ``key_map`` (offsets concatenate)."""
    parts: dict[str, list] = {}
    for k, v in diffusers_sd.items():
        if k not in key_map:
            continue
        to = key_map[k]
        if isinstance(to, str):
            parts[to] = [(0, v)]
        elif to[1] is None:
            parts[to[0]] = [(0, to[2](v))]
        else:
            parts.setdefault(to[0], []).append((to[1][1], v))
    return {k: torch.cat([v for _, v in sorted(p, key=lambda x: x[0])]) for k, p in parts.items()}


def comfy_native(family, diffusers_sd, config):
    """The DiT's weights under ComfyUI's names: Qwen-Image keeps the diffusers names
    (comfy/ldm/qwen_image/model.py), Qwen-Image-2.1 too but with ``img_mlp.gate_layer`` and ``proj`` fused
    into ``gate_up`` at load (comfy/ldm/qwen_image21/model.py), Wan uses its native names
    (comfy/ldm/wan/model.py, the inverse of diffusers' convert_wan_transformer_to_diffusers), FLUX the BFL
    names (flux_to_diffusers), FLUX.2 BFL's (comfy/ldm/flux/model.py with FLUX.2's parameters; the inverse of
    diffusers' convert_flux2_transformer_checkpoint_to_diffusers, checked in test_flux2.py)."""
    from diffsynth_core.models.flux2_released import diffusers_to_bfl
    from diffsynth_core.models.qwen_image21_released import fused
    from diffsynth_core.models.wan import native_name
    from diffsynth_core.models.z_image_released import diffusers_to_native

    if family == "qwen_image":
        return {"diffusion_model." + k: v.clone() for k, v in diffusers_sd.items()}
    if family == "qwen_image21":
        return {"diffusion_model." + k: v.clone() for k, v in fused(diffusers_sd).items()}
    if family == "wan":
        return {"diffusion_model." + native_name(k): v.clone() for k, v in diffusers_sd.items()}
    if family == "z_image":  # Z-Image's original names (comfy/ldm/lumina/model.py), q/k/v fused
        return {"diffusion_model." + k: v.clone() for k, v in diffusers_to_native(diffusers_sd).items()}
    if family == "flux2":  # FLUX.2's LoRA keys are lora_unet_<BFL name>: the generic part of the key map
        return {"diffusion_model." + k: v.clone() for k, v in diffusers_to_bfl(diffusers_sd).items()}
    return _to_native(diffusers_sd, _flux_comfy_map(config))


def comfy_lora_keys(family, native_sd, config):
    """comfy/lora.py ``model_lora_keys_unet``: LoRA key -> model weight (generic part + this family's branch)."""
    key_map = {}
    for k in native_sd:
        if k.startswith("diffusion_model.") and k.endswith(".weight"):
            stem = k[len("diffusion_model."):-len(".weight")]
            key_map["lora_unet_" + stem.replace(".", "_")] = k
            key_map[k[:-len(".weight")]] = k  # generic lora format without any weird key names
            if family in ("qwen_image", "qwen_image21"):  # QwenImage branch (QwenImage21 is a QwenImage)
                targets = [(stem, k)]
                if stem.endswith(".img_mlp.gate_up"):  # 2.1 fuses gate_layer/proj at load; LoRAs address the halves
                    half = native_sd[k].shape[0] // 2
                    targets = [(stem.replace(".gate_up", ".gate_layer"), (k, (0, 0, half))),
                               (stem.replace(".gate_up", ".proj"), (k, (0, half, half)))]
                for name, to in targets:
                    key_map[name] = to
                    key_map["transformer." + name] = to
    if family == "z_image":  # Lumina2 branch: diffusers names onto the native layers, q/k/v into qkv
        for k, to in _z_image_comfy_map(config).items():
            for form in ("diffusion_model.", "transformer.", ""):
                key_map[form + k[:-len(".weight")]] = to
    if family == "flux":  # Flux branch: diffusers names onto the fused BFL layers
        for k, to in _flux_comfy_map(config).items():
            if k.endswith(".weight"):
                key_map["transformer." + k[:-len(".weight")]] = to
                key_map[k[:-len(".weight")]] = to
    return key_map


def comfy_apply(lora, key_map, native_sd):
    """comfy/lora.py ``load_lora`` + comfy/weight_adapter/lora.py ``LoRAAdapter.load/calculate_weight``
    (strength 1); returns the keys it consumed."""
    loaded = set()
    for x, to in key_map.items():
        alpha = None
        if f"{x}.alpha" in lora:
            alpha = lora[f"{x}.alpha"].item()
            loaded.add(f"{x}.alpha")
        for up_name, down_name in ((f"{x}.lora_up.weight", f"{x}.lora_down.weight"),
                                   (f"{x}.lora_B.weight", f"{x}.lora_A.weight")):
            if up_name not in lora:
                continue
            up, down = lora[up_name].float(), lora[down_name].float()
            loaded.update((up_name, down_name))
            key, offset, function = (to, None, None) if isinstance(to, str) else (to + (None,))[:3]
            weight = native_sd[key]
            target = weight.narrow(*offset) if offset is not None else weight
            scale = alpha / down.shape[0] if alpha is not None else 1.0
            diff = (scale * (up.flatten(1) @ down.flatten(1))).reshape(target.shape)
            target += (function or (lambda t: t))(diff)
            break
    return loaded


def test_comfyui_loads_every_key_at_the_right_scale(exported):
    family = exported["spec"].name
    config = dict(exported["model"].config)
    lora = load_file(str(exported["paths"]["comfyui"]))
    native = comfy_native(family, exported["base"], config)
    loaded = comfy_apply(lora, comfy_lora_keys(family, native, config), native)
    assert loaded == set(lora), f"ComfyUI would not load {sorted(set(lora) - loaded)[:3]}"
    expected = comfy_native(family, exported["truth"], config)
    for key, value in native.items():
        torch.testing.assert_close(value, expected[key], msg=key)
    base = comfy_native(family, exported["base"], config)
    assert sum(not torch.equal(v, base[k]) for k, v in native.items()) >= len(lora) // 3 // 3  # not vacuous


def test_comfyui_flux_names_are_the_bfl_names_diffusers_converts():
    """The native key set behind ComfyUI's FLUX map is what diffusers' own converter reads
    (convert_flux_transformer_checkpoint_to_diffusers, released width, on the meta device)."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    with init_empty_weights():
        reference = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True).state_dict()
    linear = {k: v for k, v in reference.items() if not k.endswith(("norm_q.weight", "norm_k.weight",
                                                                     "norm_added_q.weight", "norm_added_k.weight"))}
    key_map = comfy_flux_to_diffusers(1, 1, 3072, prefix="")
    native = _to_native(linear, key_map)
    norms = {f"{b}.norm.{n}_norm.scale": torch.empty(128, device="meta")
             for b in ("double_blocks.0.img_attn", "double_blocks.0.txt_attn", "single_blocks.0") for n in ("query", "key")}
    converted = convert_flux_transformer_checkpoint_to_diffusers({**native, **norms})
    assert converted.keys() == reference.keys()
    assert all(converted[k].shape == v.shape for k, v in reference.items())


# --- DiffSynth-Studio ---------------------------------------------------------------------------

def diffsynth_wan_names(diffusers_sd):
    """diffsynth/utils/state_dict_converters/wan_video_dit.py ``WanVideoDiTFromDiffusers`` (the
    entries of its rename table that a T2V DiT has), block index substituted as it does."""
    block = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
             "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
             "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "attn1.norm_q": "self_attn.norm_q",
             "attn1.norm_k": "self_attn.norm_k", "attn2.norm_q": "cross_attn.norm_q",
             "attn2.norm_k": "cross_attn.norm_k", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2", "norm2": "norm3"}
    root = {"condition_embedder.text_embedder.linear_1": "text_embedding.0",
            "condition_embedder.text_embedder.linear_2": "text_embedding.2",
            "condition_embedder.time_embedder.linear_1": "time_embedding.0",
            "condition_embedder.time_embedder.linear_2": "time_embedding.2",
            "condition_embedder.time_proj": "time_projection.1", "patch_embedding": "patch_embedding",
            "proj_out": "head.head"}
    out = {}
    for name, value in diffusers_sd.items():
        if name == "scale_shift_table":
            out["head.modulation"] = value
        elif name.startswith("blocks.") and name.endswith(".scale_shift_table"):
            out[name.replace("scale_shift_table", "modulation")] = value
        else:
            stem, _, end = name.rpartition(".")
            parts = stem.split(".")
            if parts[0] == "blocks" and ".".join(parts[2:]) in block:
                out[".".join(parts[:2] + [block[".".join(parts[2:])], end])] = value
            elif stem in root:
                out[f"{root[stem]}.{end}"] = value
    return out


def diffsynth_flux_names(diffusers_sd):
    """diffsynth/utils/state_dict_converters/flux_dit.py ``FluxDiTStateDictConverterFromDiffusers``
    (its ``param[3072:], param[:3072]`` swap is the halves of the released width)."""
    glob = {"context_embedder": "context_embedder", "x_embedder": "x_embedder",
            "time_text_embed.timestep_embedder.linear_1": "time_embedder.timestep_embedder.0",
            "time_text_embed.timestep_embedder.linear_2": "time_embedder.timestep_embedder.2",
            "time_text_embed.guidance_embedder.linear_1": "guidance_embedder.timestep_embedder.0",
            "time_text_embed.guidance_embedder.linear_2": "guidance_embedder.timestep_embedder.2",
            "time_text_embed.text_embedder.linear_1": "pooled_text_embedder.0",
            "time_text_embed.text_embedder.linear_2": "pooled_text_embedder.2",
            "norm_out.linear": "final_norm_out.linear", "proj_out": "final_proj_out"}
    double = {"proj_out": "proj_out", "norm1.linear": "norm1_a.linear", "norm1_context.linear": "norm1_b.linear",
              "attn.to_q": "attn.a_to_q", "attn.to_k": "attn.a_to_k", "attn.to_v": "attn.a_to_v",
              "attn.to_out.0": "attn.a_to_out", "attn.add_q_proj": "attn.b_to_q", "attn.add_k_proj": "attn.b_to_k",
              "attn.add_v_proj": "attn.b_to_v", "attn.to_add_out": "attn.b_to_out", "ff.net.0.proj": "ff_a.0",
              "ff.net.2": "ff_a.2", "ff_context.net.0.proj": "ff_b.0", "ff_context.net.2": "ff_b.2"}
    single = {"attn.to_q": "a_to_q", "attn.to_k": "a_to_k", "attn.to_v": "a_to_v", "norm.linear": "norm.linear",
              "proj_mlp": "proj_in_besides_attn", "proj_out": "proj_out"}
    out = {}
    for name, param in diffusers_sd.items():
        if not name.endswith((".weight", ".bias")):
            continue
        prefix, _, end = name.rpartition(".")
        names = prefix.split(".")
        if prefix in glob:
            if glob[prefix] == "final_norm_out.linear":
                half = param.shape[0] // 2
                param = torch.cat([param[half:], param[:half]])
            out[f"{glob[prefix]}.{end}"] = param
        elif names[0] == "transformer_blocks" and ".".join(names[2:]) in double:
            out[f"blocks.{names[1]}.{double['.'.join(names[2:])]}.{end}"] = param
        elif names[0] == "single_transformer_blocks" and ".".join(names[2:]) in single:
            out[f"single_blocks.{names[1]}.{single['.'.join(names[2:])]}.{end}"] = param
    for name in list(out):
        if "single_blocks." in name and ".a_to_q." in name:
            mlp = out.pop(name.replace(".a_to_q.", ".proj_in_besides_attn."))
            out[name.replace(".a_to_q.", ".to_qkv_mlp.")] = torch.cat(
                [out.pop(name), out.pop(name.replace(".a_to_q.", ".a_to_k.")),
                 out.pop(name.replace(".a_to_q.", ".a_to_v.")), mlp])
    for name in list(out):
        for c in ("a", "b"):
            if f".{c}_to_q." in name:
                out[name.replace(f".{c}_to_q.", f".{c}_to_qkv.")] = torch.cat(
                    [out.pop(name.replace(f".{c}_to_q.", f".{c}_to_{p}.")) for p in "qkv"])
    return out


def diffsynth_native(family, diffusers_sd):
    """The DiT's weights under DiffSynth's names.  Its Qwen-Image and Z-Image DiTs load the diffusers files
    with no converter (diffsynth/configs/model_configs.py), so the names are the diffusers ones."""
    # diffsynth/models/z_image_dit.py, qwen_image_21_dit.py and flux2_dit.py keep diffusers' names
    if family in ("qwen_image", "z_image", "qwen_image21", "flux2"):
        return {k: v.clone() for k, v in diffusers_sd.items()}
    convert = diffsynth_wan_names if family == "wan" else diffsynth_flux_names
    return {k: v.clone() for k, v in convert(diffusers_sd).items()}


def diffsynth_pairs(lora):
    """diffsynth/utils/lora/general.py ``GeneralLoRALoader.get_name_dict`` + ``convert_state_dict``:
    target module -> (up, down), alpha folded into down as it does.  Returns pairs and used keys."""
    pairs, used = {}, set()
    for key in lora:
        a_key, b_key = ("lora_down", "lora_up") if ".lora_up." in key else ("lora_A", "lora_B")
        if b_key not in key:
            continue
        keys = key.split(".")
        if len(keys) > keys.index(b_key) + 2:
            keys.pop(keys.index(b_key) + 1)
        keys.pop(keys.index(b_key))
        if keys[0] == "diffusion_model":
            keys.pop(0)
        keys.pop(-1)
        down_key = key.replace(b_key, a_key)
        alpha_key = key.replace(b_key + ".weight", "alpha")
        down = lora[down_key].float()
        if alpha_key in lora:
            down = down * (lora[alpha_key] / down.shape[0])
            used.add(alpha_key)
        pairs[".".join(keys)] = (lora[key].float(), down)
        used.update((key, down_key))
    return pairs, used


def flux_guess_resource(lora):
    """diffsynth/utils/lora/flux.py ``FluxLoRALoader.convert_state_dict``'s format guess: None means
    the file is used as it is (already in DiffSynth's names)."""
    for key in lora:
        if "lora_unet_" in key:
            return "civitai"
        if key.startswith("transformer."):
            return "diffusers"
    return None


def test_diffsynth_fuses_every_module_at_the_right_scale(exported):
    family = exported["spec"].name
    lora = load_file(str(exported["paths"]["diffsynth"]))
    if family == "flux":
        assert flux_guess_resource(lora) is None
    weights = diffsynth_native(family, exported["base"])
    pairs, used = diffsynth_pairs(lora)
    assert used == set(lora)
    missing = sorted(name for name in pairs if name + ".weight" not in weights)
    assert not missing, f"DiffSynth has no module {missing[:3]}"
    for name, (up, down) in pairs.items():  # fuse_lora_to_base_model, alpha=1
        weights[name + ".weight"] += up @ down
    expected = diffsynth_native(family, exported["truth"])
    assert weights.keys() == expected.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value, expected[key], msg=key)


def test_diffsynth_flux_file_fuses_partial_qkv_targets(tmp_path):
    """LoRA on to_q only: DiffSynth's fused a_to_qkv gets a pair whose k/v rows are exactly zero."""
    spec = get_family("flux")
    model, config = _lora_model(spec, targets=["attn.to_q"])
    peft_sd = lora_state_dict(model)
    base = spec.build_transformer("tiny", torch.float32, "cpu").state_dict()
    lora = load_file(str(spec.export_lora(peft_sd, config, tmp_path)["diffsynth"]))
    assert {k.rsplit(".", 2)[0] for k in lora} == {"blocks.0.attn.a_to_qkv", "single_blocks.0.to_qkv_mlp",
                                                   "single_blocks.1.to_qkv_mlp"}
    weights = diffsynth_native("flux", base)
    for name, (up, down) in diffsynth_pairs(lora)[0].items():
        weights[name + ".weight"] += up @ down
    expected = diffsynth_native("flux", _merged(base, peft_sd))
    for key, value in weights.items():
        torch.testing.assert_close(value, expected[key], msg=key)


# --- bytes --------------------------------------------------------------------------------------

def test_the_same_weights_give_byte_identical_files(exported, tmp_path):
    spec = exported["spec"]
    again = spec.export_lora(dict(exported["peft_sd"]), exported["config"], tmp_path, stem="again")
    for consumer, path in exported["paths"].items():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert hashlib.sha256(again[consumer].read_bytes()).hexdigest() == digest, consumer
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.safetensors", "again_comfyui.safetensors",
                                                         "again_diffsynth.safetensors"]


def test_per_module_rank_and_alpha_are_kept_by_every_consumer(tmp_path):
    """A LoRA continued from a file with mixed ranks/alphas (rank_pattern, alpha_pattern): each
    module keeps its own scale in ComfyUI's .alpha and DiffSynth's folded lora_A.  Truth is peft's own merge."""
    from peft import LoraConfig, inject_adapter_in_model

    spec = get_family("flux")
    model = spec.build_transformer("tiny", torch.float32, "cpu")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    config = {"r": 4, "lora_alpha": 6.0, "target_modules": linears, "rank_pattern": {"attn.to_k": 2},
              "alpha_pattern": {"to_v": 3.0, "proj_mlp": 1.0}}
    inject_adapter_in_model(LoraConfig(**config), model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    peft_sd = lora_state_dict(model)
    paths = spec.export_lora(peft_sd, config, tmp_path)
    for module in model.modules():
        if hasattr(module, "merge") and hasattr(module, "base_layer"):
            module.merge()
    truth = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert truth.keys() == base.keys()
    assert peft_sd["single_transformer_blocks.0.attn.to_k.lora_A.weight"].shape[0] == 2

    cfg = dict(model.config)
    lora = load_file(str(paths["comfyui"]))
    native = comfy_native("flux", base, cfg)
    assert comfy_apply(lora, comfy_lora_keys("flux", native, cfg), native) == set(lora)
    expected = comfy_native("flux", truth, cfg)
    for key, value in native.items():
        torch.testing.assert_close(value, expected[key], msg=key)

    weights = diffsynth_native("flux", base)
    for name, (up, down) in diffsynth_pairs(load_file(str(paths["diffsynth"])))[0].items():
        weights[name + ".weight"] += up @ down
    expected = diffsynth_native("flux", truth)
    for key, value in weights.items():
        torch.testing.assert_close(value, expected[key], msg=key)
