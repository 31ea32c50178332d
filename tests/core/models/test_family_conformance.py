"""One conformance suite for every registered model family, on tiny random models.

save tiny -> load (folder, single file, ComfyUI prefix) -> encode prompt and pixels (against the
diffusers pipeline) -> dit_forward (against the pipeline's own transformer call) -> peft LoRA,
3 AdamW steps under gradient checkpointing -> export -> a fresh pipeline + load_lora_weights
reproduces the trained transformer's output exactly.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diffsynth_core.models import get_family, known_families
from diffsynth_core.training.lora import resolve_lora_targets

from .family_cases import CASES

PROMPT = "a photo of a red cat"
LORA_CONFIG = {"r": 4, "lora_alpha": 8, "init_lora_weights": "gaussian"}


def test_every_registered_family_has_a_case():
    assert {c.family for c in CASES} == set(known_families())


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def case(request):
    return request.param


@pytest.fixture(scope="module")
def spec(case):
    return get_family(case.family, case.variant)


@pytest.fixture(scope="module")
def tiny_dir(case, spec, tmp_path_factory):
    return case.save_tiny(spec, tmp_path_factory.mktemp(case.id) / "model", seed=0)


@pytest.fixture(scope="module")
def components(spec, tiny_dir):
    names = spec.encoder_components + (spec.transformer_component,)
    return spec.load_components(tiny_dir, names, torch.float32, "cpu")


def _pipeline(spec, tiny_dir):
    import diffusers

    # The edit pipelines' processor is loaded as the family loads it (transformers' own needs torchvision).
    sees_images = spec.references is not None and spec.references.text_area is not None
    extra = spec.load_components(tiny_dir, ("processor",), torch.float32, "cpu") if sees_images else {}
    return getattr(diffusers, spec.pipeline_class_name).from_pretrained(tiny_dir, **extra)


def _cond(case, spec, components):
    """Batched conditioning of one sample: its prompt (with the case's reference images) and their latents."""
    cond = dict(spec.encode_prompt(components, PROMPT, "cpu", **case.prompt_kwargs))
    for i, shape in enumerate(case.reference_shapes):
        pixels = torch.rand(shape, generator=torch.Generator().manual_seed(10 + i)) * 2 - 1
        cond[f"ref_latents_{i}"] = spec.encode_pixels(components, pixels, "cpu")["latents"]
    return _batched(cond)


def _pixels(case, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(case.pixels_shape, generator=g) * 2 - 1


def _batched(cond):
    return {k: v[None] for k, v in cond.items()}


def test_spec_declares_consistent_metadata(spec, components):
    transformer = components[spec.transformer_component]
    for container in spec.block_container_names:
        assert isinstance(getattr(transformer, container), torch.nn.ModuleList)
    for target in spec.lora_target_modules:  # as the engine resolves them (exact, suffix or * pattern)
        assert resolve_lora_targets(transformer, [target]), target
    assert spec.frame_multiple >= 1


def test_load_components_rejects_unknown_names(spec, tiny_dir):
    with pytest.raises(ValueError, match="unknown component"):
        spec.load_components(tiny_dir, ("not_a_component",), torch.float32, "cpu")


def test_load_in_bf16_keeps_the_models_fp32_modules(spec, tiny_dir):
    transformer = spec.load_components(tiny_dir, (spec.transformer_component,), torch.bfloat16, "cpu")[
        spec.transformer_component]
    keep = tuple(getattr(transformer, "_keep_in_fp32_modules", None) or ())
    for name, p in transformer.named_parameters():
        expected = torch.float32 if any(m in name.split(".") for m in keep) else torch.bfloat16
        assert p.dtype == expected, name


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_transformer_loads_from_a_single_file(spec, tiny_dir, components, tmp_path, prefix):
    reference = components[spec.transformer_component]
    file = tmp_path / "dit.safetensors"
    save_file({prefix + k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}, str(file))
    loaded = spec.load_transformer_file(file, tiny_dir, torch.bfloat16)
    assert _public(loaded.config) == _public(reference.config)
    ref_sd, got_sd = reference.state_dict(), loaded.state_dict()
    assert set(ref_sd) == set(got_sd)
    keep = tuple(getattr(loaded, "_keep_in_fp32_modules", None) or ())
    for k, v in got_sd.items():
        assert v.device.type == "cpu", k
        assert torch.equal(v.float(), ref_sd[k].to(torch.bfloat16).float()), k
        if any(m in k.split(".") for m in keep):
            assert v.dtype == torch.float32, k


def _public(config):
    return {k: v for k, v in config.items() if not k.startswith("_")}


def test_single_file_with_foreign_weights_names_the_problem(spec, tiny_dir, tmp_path):
    file = tmp_path / "bad.safetensors"
    save_file({"not.a.weight": torch.zeros(2)}, str(file))
    with pytest.raises(ValueError, match="bad.safetensors"):
        spec.load_transformer_file(file, tiny_dir, torch.float32)


def test_encode_prompt_matches_the_pipeline(case, spec, tiny_dir, components):
    pipe = _pipeline(spec, tiny_dir)
    ours = spec.encode_prompt(components, PROMPT, "cpu", **case.prompt_kwargs)
    with torch.no_grad():  # T5 takes other kernels with autograd on (differences of 1e-7)
        theirs = case.pipeline_prompt(pipe, PROMPT)
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        assert not value.requires_grad
        assert torch.equal(value, theirs[key]), key


def test_encode_pixels_is_the_normalised_posterior_mode(case, spec, tiny_dir, components):
    pixels = _pixels(case)
    latents = spec.encode_pixels(components, pixels, "cpu")["latents"]
    assert not latents.requires_grad
    assert torch.equal(latents, spec.encode_pixels(components, pixels, "cpu")["latents"])  # deterministic
    pipe = _pipeline(spec, tiny_dir)
    video_vae = "z_dim" in pipe.vae.config  # Qwen-Image/Wan VAEs take (B, C, F, H, W)
    with torch.no_grad():
        raw = pipe.vae.encode(pixels[None] if video_vae else pixels[:, 0][None]).latent_dist.mode()
    # Invert with the formula the pipeline's decode step uses: back to the raw VAE latent.
    assert torch.allclose(_denormalise(pipe, latents[None]), raw.reshape(_denormalise(pipe, latents[None]).shape),
                          atol=1e-5)


def _denormalise(pipe, latents):
    cfg = pipe.vae.config
    if hasattr(cfg, "latents_mean") and cfg.latents_mean is not None:  # Qwen-Image / Wan
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
        std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
        return latents / std + mean
    if hasattr(pipe.vae, "bn"):  # FLUX.2: batch-norm statistics over 2x2 patches
        std = torch.sqrt(pipe.vae.bn.running_var + cfg.batch_norm_eps).view(1, -1, 1, 1)
        return pipe._unpatchify_latents(latents[:, :, 0] * std + pipe.vae.bn.running_mean.view(1, -1, 1, 1))
    return (latents / cfg.scaling_factor + cfg.shift_factor)[:, :, 0]  # FLUX: 2-D VAE


def test_dit_forward_matches_the_pipelines_transformer_call(case, spec, tiny_dir):
    pipe = _pipeline(spec, tiny_dir)
    seen = {}

    def first_call(module, args, kwargs, out):  # arguments by name, however the pipeline passed them
        named = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        seen.setdefault("call", (named, out[0]))  # returns None: the output is left alone

    pipe.transformer.register_forward_hook(first_call, with_kwargs=True)
    with case.pipeline_context():
        pipe(prompt=PROMPT, output_type="latent", generator=torch.Generator().manual_seed(0), **case.pipeline_kwargs)
    kwargs, out = seen["call"]
    latents, sigmas, cond, expected = case.from_pipeline_call(pipe, kwargs, out)
    with torch.no_grad():
        ours = spec.dit_forward(pipe.transformer, latents, sigmas, cond)
    assert ours.shape == latents.shape
    assert torch.allclose(ours, expected, atol=1e-6, rtol=1e-5)


# --- LoRA: train, export, reload ------------------------------------------------------------

def _train_lora(spec, transformer, latents, cond, steps=3):
    """Inject peft LoRA on the family's default targets; plain AdamW + flow-matching loss."""
    from peft import LoraConfig

    config = dict(LORA_CONFIG, target_modules=resolve_lora_targets(transformer, spec.lora_target_modules))
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(**config))
    transformer.enable_gradient_checkpointing()
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        noise = torch.randn(latents.shape, generator=g)
        sigmas = torch.rand(latents.shape[0], generator=g)
        s = sigmas.view(-1, *[1] * (latents.ndim - 1))
        pred = spec.dit_forward(transformer, (1 - s) * latents + s * noise, sigmas, cond)
        loss = torch.nn.functional.mse_loss(pred.float(), (noise - latents).float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    transformer.eval()
    return config, losses


@pytest.fixture(scope="module")
def trained(case, spec, tiny_dir, components, tmp_path_factory):
    from peft.utils import get_peft_model_state_dict

    transformer = spec.load_components(tiny_dir, (spec.transformer_component,), torch.float32, "cpu")[
        spec.transformer_component]
    latents = spec.encode_pixels(components, _pixels(case), "cpu")["latents"][None]
    cond = _cond(case, spec, components)
    config, losses = _train_lora(spec, transformer, latents, cond)
    out_dir = tmp_path_factory.mktemp(case.id + "-lora")
    paths = spec.export_lora(get_peft_model_state_dict(transformer), config, out_dir)
    probe_sigmas = torch.full((1,), 0.6)
    probe = (torch.randn(latents.shape, generator=torch.Generator().manual_seed(5)), probe_sigmas, cond)
    with torch.no_grad():
        expected = spec.dit_forward(transformer, *probe)
    return dict(config=config, losses=losses, paths=paths, probe=probe, expected=expected)


def test_training_updates_the_lora_and_the_loss_is_finite(trained):
    assert len(trained["losses"]) == 3 and all(torch.isfinite(torch.tensor(trained["losses"])))


def test_diffusers_lora_file_has_prefixed_keys_and_alpha(spec, trained):
    path = trained["paths"]["diffusers"]
    assert path.name == "lora.safetensors"
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
        header = f.metadata()
    assert keys and all(k.startswith("transformer.") for k in keys)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    meta = json.loads(header["lora_adapter_metadata"])
    assert meta["transformer.lora_alpha"] == LORA_CONFIG["lora_alpha"] and meta["transformer.r"] == LORA_CONFIG["r"]


def _reload_output(spec, tiny_dir, out_dir, weight_name, probe):
    pipe = _pipeline(spec, tiny_dir)
    with torch.no_grad():
        base = spec.dit_forward(pipe.transformer, *probe)
        pipe.load_lora_weights(out_dir, weight_name=weight_name)
        return base, spec.dit_forward(pipe.transformer, *probe)


def test_fresh_pipeline_with_the_exported_lora_reproduces_the_trained_output(spec, tiny_dir, trained):
    path = trained["paths"]["diffusers"]
    base, reloaded = _reload_output(spec, tiny_dir, path.parent, path.name, trained["probe"])
    assert not torch.allclose(base, trained["expected"])  # the LoRA changes the output
    assert torch.equal(reloaded, trained["expected"])


def test_comfyui_file_carries_alpha_and_loads_with_identical_output(spec, tiny_dir, trained):
    """Every module carries the scale alpha/rank of the training (FLUX.2's fused q/k/v: rank and alpha 3x)."""
    path = trained["paths"]["comfyui"]
    with safe_open(str(path), "pt") as f:
        alphas = {k[: -len(".alpha")]: float(f.get_tensor(k)) for k in f.keys() if k.endswith(".alpha")}
        ranks = {k.rsplit(".", 2)[0]: f.get_slice(k).get_shape()[0] for k in f.keys()
                 if k.endswith((".lora_A.weight", ".lora_down.weight"))}
    assert alphas.keys() == ranks.keys()
    assert all(alphas[m] / ranks[m] == LORA_CONFIG["lora_alpha"] / LORA_CONFIG["r"] for m in ranks)
    _, reloaded = _reload_output(spec, tiny_dir, path.parent, path.name, trained["probe"])
    assert torch.equal(reloaded, trained["expected"])


def test_bf16_base_with_fp32_lora_trains_under_checkpointing(case, spec, tiny_dir, components):
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    name = spec.transformer_component
    transformer = spec.load_components(tiny_dir, (name,), torch.bfloat16, "cpu")[name]
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(**LORA_CONFIG, target_modules=resolve_lora_targets(transformer,
                                                                                       spec.lora_target_modules)))
    cast_training_params(transformer, torch.float32)
    transformer.enable_gradient_checkpointing()
    transformer.train()
    latents = spec.encode_pixels(components, _pixels(case), "cpu")["latents"][None]
    cond = _cond(case, spec, components)
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(3))
    pred = spec.dit_forward(transformer, 0.5 * latents + 0.5 * noise, torch.tensor([0.5]), cond)
    assert pred.shape == latents.shape and pred.dtype == torch.bfloat16
    torch.nn.functional.mse_loss(pred.float(), noise - latents).backward()
    lora = [p for p in transformer.parameters() if p.requires_grad]
    assert lora and all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
                        for p in lora)
    assert all(torch.isfinite(p.grad).all() for p in lora) and any(p.grad.abs().sum() > 0 for p in lora)
